"""The eval vertex on the local backend: a TrainingJob annotated `huorn.io/eval: "true"` gets each
landed checkpoint evaluated by its own process (huorn.runtime.evaluate) beside the running gang,
the vertex parks between checkpoints, the run waits for the last checkpoint's eval, and the
report shows the losses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from huorn.backends.local import report

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
HUORN = [sys.executable, "-c", "from huorn.cli.main import app; app()"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_each_checkpoint_is_evaluated_and_the_last_one_before_the_run_ends(tmp_path: Path) -> None:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["metadata"]["annotations"] = {"huorn.io/eval": "true"}
    manifest["spec"]["checkpoint"] = {"path": str(tmp_path / "checkpoints"), "intervalSteps": 8}
    manifest["spec"]["model"].update({"layers": 2, "width": 64, "context": 64})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    run_dir = tmp_path / "run"
    done = subprocess.run([*HUORN, "run", str(path), "--run-dir", str(run_dir), "--no-watch", "--interval",
                           "0.5", "--steps", "20", "--policy", "fixed", "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=360)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = report.read_records(run_dir)
    checkpoints = [r["step"] for r in records if r.get("event") == "checkpoint"]
    evals = [r for r in records if r.get("event") == "eval"]
    assert evals, "no checkpoint was evaluated"
    assert evals[-1]["step"] == checkpoints[-1], "the last checkpoint's eval must finish before the run ends"
    for e in evals:
        assert 0 < e["loss"] < 10 and set(e["sources"]) == {"code", "general", "math"}
        assert (run_dir / "evals" / f"eval-{e['step']:08d}.json").exists()
    graph = json.loads((run_dir / "graph.json").read_text())
    eval_log = [m for m in graph["log"] if m["target"] == "eval"]
    assert {"activate", "deactivate"} <= {m["action"] for m in eval_log}
    assert not next(v for v in graph["vertices"] if v["name"] == "eval")["active"], "parked at the end"
    text = (run_dir / "report.md").read_text()
    assert "## Evaluations (eval vertex)" in text and f"| {checkpoints[-1]} |" in text
