"""S2's inputs from telemetry, its decision as a set-param mutation, and adaptive k into the
mutation log: the control-plane halves, without processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from remediation_support import Seen

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import compiler, managers
from huorn.scheduler import pipeline_k
from huorn.scheduler.remediation import ladder, policy

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"



def build_graph() -> Any:
    return compiler.compile(yaml.safe_load(QUICKSTART.read_text()))


def snapshot(rank: int, compute: float, mine: int, total: int = 8, world: int = 2, steps: int = 5) -> dict:
    return {"rank": rank, "world_size": world, "replica": f"trainer-{rank}",
            "parameters": {"micro_batches": {"total": total, "mine": mine}},
            "steps": [{"step": s, "step_seconds": 1.0, "compute_seconds": compute, "comm_seconds": 0.1}
                      for s in range(steps)]}


def test_shape_from_telemetry_is_seconds_per_micro_batch_by_rank() -> None:
    shape = policy.build_shape({"a": snapshot(1, 0.8, 4), "b": snapshot(0, 0.2, 4)})
    assert shape is not None
    assert shape.microbatch_seconds == pytest.approx([0.05, 0.2]) and shape.total_microbatches == 8


@pytest.mark.parametrize("snaps", [
    {"a": snapshot(0, 0.2, 4)},  # rank 1 missing
    {"a": snapshot(0, 0.2, 4), "b": snapshot(1, 0.8, 4, steps=2)},  # too few steps
    {"a": snapshot(0, 0.2, 4), "b": snapshot(1, 0.8, 4, total=6)},  # two gangs' views
], ids=["missing-rank", "few-steps", "mixed-totals"])
def test_shape_waits_for_a_complete_view(snaps: dict) -> None:
    assert policy.build_shape(snaps) is None


def test_s2_decision_becomes_a_set_param_with_its_reason() -> None:
    g = build_graph()
    remediation = policy.RemediationPolicy(
        Remediation.model_validate({"maxMitigation": "rebalance"}))
    remediation.ladder.shape = ladder.JobShape(microbatch_seconds=[0.05, 0.2], total_microbatches=8)
    decision = ladder.Decision(MitigationLevel.REBALANCE, "rebalance-microbatches", "lost 40s",
                               plan=remediation.ladder.build_plan(MitigationLevel.REBALANCE))
    events = remediation._events_for(g, decision, ("trainer-1",))
    assert [e.type for e in events] == [managers.PARAMETER_DECISION]
    mutations = managers.build_default_managers().dispatch(g, events[0])
    assert len(mutations) == 1 and mutations[0].action == "set-param"
    counts = mutations[0].detail["new"]
    assert sum(counts) == 8 and counts[0] > counts[1]
    assert mutations[0].reason.startswith("remediation S2 (rebalance-microbatches): lost 40s")
    assert g.vertex(mutations[0].target).params["microbatches"] == counts


def test_k_choice_is_logged_once_per_change() -> None:
    g = build_graph()
    k_policy = pipeline_k.KDecisionPolicy()
    decision = {"step": 5, "k": 3, "previous_k": 1, "changed": True, "reason": "link 2.00 ms/message"}
    seen = Seen(steps=[{"event": "step", "step": 5, "k_decision": decision}])
    events = k_policy.decide(g, seen)
    assert len(events) == 1 and events[0].data["value"] == 3
    mutations = managers.build_default_managers().dispatch(g, events[0])
    assert mutations[0].detail == {"key": pipeline_k.PARAM, "old": None, "new": 3}
    assert mutations[0].reason == "adaptive k at step 5: k=1 -> k=3: link 2.00 ms/message"
    # the same k seen again through telemetry is not a new mutation
    seen = Seen(telemetry={"x": {"rank": 0, "parameters": {"pipeline": {"decision": decision}}}})
    assert k_policy.decide(g, seen) == []
