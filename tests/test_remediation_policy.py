"""The remediation policy in the monitor loop: runtime telemetry in, ladder decisions and the
graph mutation of S4 out (the culprit's instance is replaced, so the gang restarts from its
checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml
from remediation_support import Seen

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import compiler, managers
from huorn.scheduler.remediation import ladder, policy

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"



def build_graph() -> Any:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["elasticity"].update(minReplicas=2, maxReplicas=2)
    return compiler.compile(manifest)


def snapshot(rank: int, replica: str, entered: int, completed: int, heartbeat: float,
             steps: list[dict] | None = None) -> dict:
    """The runtime's /telemetry JSON (huorn.runtime.telemetry.Telemetry.snapshot)."""
    default = [{"step": 9, "step_seconds": 0.1, "compute_seconds": 0.08, "comm_seconds": 0.02}]
    return {"job": "quickstart", "rank": rank, "world_size": 2, "replica": replica, "pid": 100 + rank,
            "heartbeat": heartbeat, "steps": steps or default,
            "collective": {"entered": entered, "completed": completed, "in_flight": []}}


def test_hang_in_telemetry_becomes_s4_and_replaces_the_culprit_instance() -> None:
    graph = build_graph()
    assert {"trainer-0", "trainer-1"} <= set(graph.instance_names())
    pol = policy.RemediationPolicy(Remediation(hang_timeout="2s"))
    mgrs = managers.build_default_managers()
    events: list[managers.Event] = []
    for t in np.arange(100.0, 104.0, 0.5):
        seen = Seen(float(t), {"trainer-0-0": snapshot(0, "trainer-0", 42, 40, t),
                               "trainer-1-0": snapshot(1, "trainer-1", 40, 40, t)})
        events += pol.decide(graph, seen)
    assert [(e.type, e.target, e.data["instance"]) for e in events] == [
        (managers.INSTANCE_FAILED, "trainer", "trainer-1")]
    assert pol.decisions[-1].level is MitigationLevel.RESTART
    mutations = [m for e in events for m in mgrs.dispatch(graph, e)]
    assert [(m.action, m.detail) for m in mutations] == [
        ("replace", {"old": "trainer-1", "new": "trainer-1-g1"})]
    assert "remediation S4" in mutations[0].reason and "non-communication" in mutations[0].reason


def test_capped_ladder_records_the_hang_but_changes_nothing() -> None:
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="2s", max_mitigation="rebalance"))
    events = [e for t in range(100, 110) for e in pol.decide(graph, Seen(
        float(t), {"a": snapshot(0, "trainer-0", 41, 40, t), "b": snapshot(1, "trainer-1", 40, 40, t)}))]
    assert events == []
    assert pol.decisions[-1].action == "capped" and "maxMitigation" in pol.decisions[-1].reason


def test_a_whole_job_outside_collectives_is_never_restarted() -> None:
    """Checkpointing, validation and start-up look like this."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="2s"))
    events = [e for t in range(100, 130) for e in pol.decide(graph, Seen(
        float(t), {"a": snapshot(0, "trainer-0", 40, 40, t), "b": snapshot(1, "trainer-1", 40, 40, t)}))]
    assert events == [] and pol.decisions == []


def test_fail_slow_climbs_the_ladder_to_restart_of_the_slow_replica() -> None:
    graph = build_graph()
    costs = ladder.LadderCosts(rebalance=1.0, resplit=1.0, restart=2.0)
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), costs)
    rng = np.random.default_rng(4)
    history: dict[int, list[dict]] = {0: [], 1: []}
    events: list[managers.Event] = []
    seq = 0
    for step in range(120):
        seq += 3
        for rank in (0, 1):
            compute = 0.08 * np.exp(rng.normal(0, 0.02)) * (2.0 if rank == 1 and step >= 50 else 1.0)
            history[rank].append({"step": step, "step_seconds": compute + 0.02, "compute_seconds": compute,
                                  "comm_seconds": 0.02})
        seen = Seen(float(step), {f"trainer-{r}-0": snapshot(r, f"trainer-{r}", seq, seq, float(step),
                                                              history[r][-256:]) for r in (0, 1)})
        events += pol.decide(graph, seen)
    levels = [d.level for d in pol.decisions]
    assert levels[0] is MitigationLevel.OBSERVE and levels[-1] is MitigationLevel.RESTART
    assert "trainer-1" in pol.decisions[0].reason and "compute" in pol.decisions[0].reason
    assert [(e.type, e.data["instance"]) for e in events] == [(managers.INSTANCE_FAILED, "trainer-1")]


def test_the_loss_since_the_onset_pays_for_s2_even_when_detection_came_late() -> None:
    """Ski-rental's rent runs from the slowdown's onset: the steps the detector needed to be sure
    were lost too. Here they already pay for S2 when the slowdown is found, so S2 comes on the same
    tick (counting only from the detection, it came steps later, and on a noisy host too late)."""
    graph = build_graph()
    costs = ladder.LadderCosts(rebalance=0.3)  # about 4 steps of a 2× slowdown at 0.08 s
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="rebalance"), costs)
    rng = np.random.default_rng(7)
    history: dict[int, list[dict]] = {0: [], 1: []}
    ticks: list[tuple[int, MitigationLevel, str]] = []
    for step in range(120):
        computes = [0.08 * np.exp(rng.normal(0, 0.02)) * (2.0 if rank == 1 and step >= 50 else 1.0)
                    for rank in (0, 1)]
        for rank in (0, 1):
            history[rank].append({"step": step, "step_seconds": max(computes) + 0.02,
                                  "compute_seconds": computes[rank], "comm_seconds": 0.02})
        snaps = {}
        for r in (0, 1):
            snap = snapshot(r, f"trainer-{r}", 3 * step, 3 * step, float(step), history[r][-256:])
            snaps[f"trainer-{r}-0"] = {**snap, "parameters": {"micro_batches": {"total": 8, "mine": 4}}}
        before = len(pol.decisions)
        pol.decide(graph, Seen(float(step), snaps))
        ticks += [(step, d.level, d.reason) for d in pol.decisions[before:]]
    observed = [t for t, level, _ in ticks if level is MitigationLevel.OBSERVE]
    rebalanced = [(t, reason) for t, level, reason in ticks if level is MitigationLevel.REBALANCE]
    assert observed and rebalanced, ticks
    assert observed[0] > 50 + 4, ticks  # the detector needed more steps than the rent takes
    assert rebalanced[0][0] == observed[0], ticks
    lost = float(rebalanced[0][1].split("lost ")[1].split("s")[0])
    assert 0.3 <= lost < 0.3 + 0.2, rebalanced  # paid step by step from the onset, not all at once
