"""`huorn detect STEPTIMES.csv`: findings as a table or JSON, exit 2 naming the bad column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from huorn.cli import main
from huorn.scheduler.remediation import steptable


def write_trace(path: Path, slow_worker: str | None) -> Path:
    rng = np.random.default_rng(11)
    rows = []
    for w in ("gpu-0", "gpu-1", "gpu-2"):
        t = 0.3 * np.exp(rng.normal(0, 0.02, 200))
        if w == slow_worker:
            t[90:] *= 1.5
        rows += [{"iteration": i, "worker": w, "time": float(t[i])} for i in range(200)]
    path.write_text(steptable.format_csv(steptable.build_table(rows, steptable.REQUIRED)))
    return path


def test_detect_prints_worker_kind_onset_and_factor_as_json(tmp_path: Path) -> None:
    result = CliRunner().invoke(main.app, ["detect", str(write_trace(tmp_path / "s.csv", "gpu-1")), "--json"])
    assert result.exit_code == 0, result.output
    (finding,) = json.loads(result.stdout)["findings"]
    assert (finding["worker"], finding["kind"]) == ("gpu-1", "compute")
    assert abs(finding["onset_iteration"] - 90) <= 3 and abs(finding["factor"] - 1.5) < 0.05


def test_detect_table_output_and_a_clean_trace(tmp_path: Path) -> None:
    slow = CliRunner().invoke(main.app, ["detect", str(write_trace(tmp_path / "s.csv", "gpu-2"))])
    assert slow.exit_code == 0 and "gpu-2" in slow.stdout and "1.5" in slow.stdout
    clean = CliRunner().invoke(main.app, ["detect", str(write_trace(tmp_path / "c.csv", None)), "-o", "yaml"])
    assert clean.exit_code == 0 and clean.stdout.strip() == "findings: []"


def test_malformed_csv_exits_2_and_names_the_column(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("iteration,worker,time\n0,a,0.1\n1,a,slow\n")
    result = CliRunner().invoke(main.app, ["detect", str(bad)])
    assert result.exit_code == 2
    assert "column 'time'" in result.stderr and "line 3" in result.stderr
    missing = CliRunner().invoke(main.app, ["detect", str(tmp_path / "nope.csv")])
    assert missing.exit_code == 2 and "cannot read" in missing.stderr


def test_a_header_with_a_bom_or_spaces_is_read_as_its_columns(tmp_path: Path) -> None:
    """Excel's "CSV UTF-8" starts with a BOM, and "iteration, worker, time" is a common header:
    both were refused, naming a column that looked present ('worker': value is empty)."""
    header, *rows = write_trace(tmp_path / "s.csv", "gpu-1").read_text().splitlines()
    assert header == "iteration,worker,time"
    for spelled in ("\ufeff" + header, "iteration, worker, time"):
        path = tmp_path / "steps.csv"
        path.write_text("\n".join([spelled, *rows]) + "\n", encoding="utf-8")
        result = CliRunner().invoke(main.app, ["detect", str(path), "--json"])
        assert result.exit_code == 0, result.output
        assert [f["worker"] for f in json.loads(result.stdout)["findings"]] == ["gpu-1"]
