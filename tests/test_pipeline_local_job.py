"""A pipelined TrainingJob on the local backend: one replica is one torchrun agent with a worker
per stage, `schedule: auto` chooses k inside the gang, and the monitor records each change of k in
the graph's mutation log with the planner's reason."""

from __future__ import annotations

from pathlib import Path

import job_support
import pytest

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.backends.local import report
from huorn.graph import compiler
from huorn.scheduler import pipeline_k

STEPS = 12


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_auto_pipeline_job_runs_locally_and_logs_its_k_choice(tmp_path: Path) -> None:
    manifest = job_support.tiny_job(replicas=1, steps=STEPS, micro_batch=2,
                                    parallelism={"pipelineStages": 2, "schedule": "auto"})
    g = compiler.compile(manifest)
    run_dir = tmp_path / "run"
    # slow enough steps that the monitor ticks between a decision and the end of the job
    result = job_support.run_local(g, run_dir, [{"kind": "slow-compute", "ms": 150}],
                                   [pipeline_k.KDecisionPolicy()], STEPS, budget_s=400, interval=0.3)
    assert result.observation.finished, (run_dir / "actions.jsonl").read_text()[-3000:]
    records = report.read_records(run_dir)
    steps = [r for r in records if r.get("event") == "step"]
    assert report.summarise_steps(steps).last == STEPS
    assert next(r for r in records if r.get("event") == "start")["world_size"] == 2
    decided = [r for r in steps if "k_decision" in r]
    assert [r["step"] for r in decided] == [5, 10]
    logged = [m for m in g.log if m.action == "set-param" and m.detail["key"] == pipeline_k.PARAM]
    # every decision that changed the k in force (the job starts at k=1) reaches the mutation log,
    # with its reason; one that keeps k does not (a first "keep k=1" was logged as k=1 -> k=1)
    changes, in_force = [], 1
    for record in decided:
        if record["k_decision"]["k"] != in_force:
            changes.append(record["k_decision"])
            in_force = record["k_decision"]["k"]
    assert [m.detail["new"] for m in logged] == [d["k"] for d in changes], [d["reason"] for d in changes]
    for mutation, change in zip(logged, changes, strict=True):
        assert change["reason"] in mutation.reason
        assert mutation.reason.startswith(f"adaptive k at step {change['step']}")
