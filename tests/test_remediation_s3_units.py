"""S3's inputs from pipeline telemetry, its decision as a `stageLayers` set-param, and the local
backend's run config and restart plan for it: the control-plane halves, without processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.backends.local import backend as local_backend
from huorn.backends.local import commands
from huorn.graph import compiler, desired, managers, model
from huorn.scheduler.remediation import ladder, policy

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def build_graph(stages: int = 2) -> model.Graph:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["model"]["layers"] = 4
    manifest["spec"]["parallelism"] = {"pipelineStages": stages, "schedule": "1f1b"}
    return compiler.compile(manifest)


def snapshot(rank: int, compute: float, split: list[int], steps: int = 5) -> dict:
    return {"rank": rank, "world_size": 2 * len(split), "replica": f"trainer-{rank // len(split)}",
            "parameters": {"pipeline": {"stages": len(split), "stage_layers": split}},
            "steps": [{"step": s, "step_seconds": 1.0, "compute_seconds": compute, "comm_seconds": 0.1}
                      for s in range(steps)]}


def test_pipeline_shape_is_each_stage_speed_per_layer_from_its_slowest_replica() -> None:
    # ranks 0, 2: stage 0 (2 layers); ranks 1, 3: stage 1 (2 layers); rank 2 is the slow one
    snaps = {str(r): snapshot(r, c, [2, 2]) for r, c in enumerate([0.2, 0.2, 0.8, 0.2])}
    shape = policy.build_pipeline_shape(snaps)
    assert shape is not None and shape.layer_costs == [1.0] * 4
    assert shape.stage_speeds == pytest.approx([0.25, 1.0])
    uneven = policy.build_pipeline_shape({"a": snapshot(0, 0.3, [3, 1]), "b": snapshot(1, 0.1, [3, 1])})
    assert uneven is not None and uneven.stage_speeds == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("snaps", [
    {"a": snapshot(0, 0.2, [2, 2])},  # stage 1 missing
    {"a": snapshot(0, 0.2, [2, 2]), "b": snapshot(1, 0.2, [2, 2], steps=2)},  # too few steps
    {"a": snapshot(0, 0.2, [2, 2]), "b": snapshot(1, 0.2, [3, 1])},  # before and after a re-split
], ids=["missing-stage", "few-steps", "mixed-splits"])
def test_pipeline_shape_waits_for_a_complete_view(snaps: dict) -> None:
    assert policy.build_pipeline_shape(snaps) is None


def test_s3_decision_becomes_a_stage_layers_set_param_with_its_reason() -> None:
    g = build_graph()
    remediation = policy.RemediationPolicy(Remediation.model_validate({"maxMitigation": "resplit"}))
    remediation.ladder.shape = ladder.JobShape(layer_costs=[1.0] * 4, stage_speeds=[0.25, 1.0])
    assert remediation.ladder.applicable(MitigationLevel.RESPLIT)
    plan = remediation.ladder.build_plan(MitigationLevel.RESPLIT)
    assert plan["stageLayers"] == [1, 3] and plan["stageBoundaries"] == [0, 1]
    decision = ladder.Decision(MitigationLevel.RESPLIT, "resplit-stages", "lost 400s", plan=plan)
    events = remediation._events_for(g, decision, ())
    assert [e.type for e in events] == [managers.PARAMETER_DECISION]
    mutations = managers.build_default_managers().dispatch(g, events[0])
    assert len(mutations) == 1 and mutations[0].action == "set-param"
    assert mutations[0].detail == {"key": "stageLayers", "old": None, "new": [1, 3]}
    assert mutations[0].reason.startswith("remediation S3 (resplit-stages): lost 400s; stage layers [1, 3]")
    assert g.vertex("trainer").params["stageLayers"] == [1, 3]


def test_s3_is_skipped_for_a_job_without_pipeline_stages() -> None:
    g = build_graph(stages=1)
    remediation = policy.RemediationPolicy(Remediation.model_validate({"maxMitigation": "resplit"}))
    decision = ladder.Decision(MitigationLevel.RESPLIT, "resplit-stages", "x",
                               plan={"stageLayers": [1, 3], "stageBoundaries": [0, 1],
                                     "predictedStageSeconds": 1.0, "stageSecondsBefore": 2.0})
    assert remediation._events_for(g, decision, ()) == []


def test_run_config_carries_the_split_and_the_backend_restarts_every_running_trainer(tmp_path: Path) -> None:
    g = build_graph()
    trainer = g.vertex("trainer")
    assert "stageLayers" not in commands.build_run_config("j", trainer, tmp_path, tmp_path, 5)
    backend = local_backend.LocalBackend(g, tmp_path)
    want = desired.build_desired(g)
    backend._current = list(want)  # as if apply had started them
    backend._applied_version = g.version
    assert backend._restart_for_resplit(g, want, []) == []
    managers.build_default_managers().dispatch(g, managers.Event(
        managers.PARAMETER_DECISION, "trainer", {"key": "stageLayers", "value": [3, 1], "reason": "S3"}))
    restart = backend._restart_for_resplit(g, desired.build_desired(g), [])
    trainers = {r.name for r in want if r.kind == "instance" and r.role == "trainer"}
    assert trainers and {r.name for r in restart} == trainers
    assert commands.build_run_config("j", trainer, tmp_path, tmp_path, 5)["stageLayers"] == [3, 1]
