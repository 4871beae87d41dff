"""The scheduling benchmark's runs of many cases and seeds: a bad case is refused before any
runs, and a seed that fails ends the run with the rows of those that finished already printed.
Before, with --jobs, the queued cases ran on after a failure and rewrote their committed reports,
with no summary.json written after them (found by the session's final review)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)


def test_a_bad_case_is_refused_before_any_case_runs(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = _run("benchmarks/scheduling_sim.py", "--sizes", "32", "--qps-start", "middle,bogus",
                "--loads", "0.8", "--jobs", "2", "--output", str(out))
    assert done.returncode == 2, done.stderr
    assert "qps_start must be middle or beginning, got 'bogus'" in done.stderr
    assert not out.exists()  # the good case did not run either: nothing half-written


def test_a_failing_seed_ends_the_run_and_the_finished_rows_are_kept(tmp_path: Path) -> None:
    out = tmp_path / "seeds.json"
    done = _run("benchmarks/scheduling_seeds.py", "--seeds", "1,-1", "--gpus", "32", "--jobs", "1",
                "--output", str(out))
    assert done.returncode != 0 and "seed must be >= 0" in done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"seed"')]
    assert [row["seed"] for row in rows] == [1]
    assert not out.exists()
