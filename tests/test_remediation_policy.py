"""The remediation policy in the monitor loop: runtime telemetry in, ladder decisions and the
graph mutation of S4 out (the culprit's instance is replaced, so the gang restarts from its
checkpoint)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
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


def test_a_whole_job_outside_collectives_is_recorded_once_and_never_restarted() -> None:
    """Checkpointing, validation and rendezvous look like this, so nothing is restarted; but the
    docs said it was recorded and it was dropped, though it is all that shows of a pipelined job
    on NCCL stopped in a point-to-point send or receive, which only CPU runs count."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="2s"))
    events = [e for t in range(100, 130) for e in pol.decide(graph, Seen(
        float(t), {"a": snapshot(0, "trainer-0", 40, 40, t), "b": snapshot(1, "trainer-1", 40, 40, t)}))]
    assert events == []
    assert [(d.level, d.action, d.ranks) for d in pol.decisions] == [
        (MitigationLevel.OBSERVE, "stalled-outside-collectives", ())], pol.decisions
    assert "trainer-0, trainer-1" in pol.decisions[0].reason and pol.ladder.level is None
    # start-up (no rank has published a step: loading a model may outlast the timeout), or a rank
    # out of view (a gang mid-restart): nothing is recorded
    for partial in ({"a": snapshot(0, "trainer-0", 0, 0, 0.0), "b": snapshot(1, "trainer-1", 0, 0, 0.0)},
                    {"a": snapshot(0, "trainer-0", 40, 40, 0.0)}):
        quiet = policy.RemediationPolicy(Remediation(hang_timeout="2s"))
        for t in range(100, 130):
            snaps = {k: {**v, "heartbeat": float(t), "steps": [] if len(partial) == 2 else v["steps"]}
                     for k, v in partial.items()}
            assert quiet.decide(graph, Seen(float(t), snaps)) == []
        assert quiet.decisions == []


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


CLIMB = ladder.LadderCosts(rebalance=0.3, restart=2.0)  # S2 after ~4 steps of a 2× straggler, S4 ~25 later
PAIR = {0: "trainer-0", 1: "trainer-1"}


def straggler_snaps(history: dict[int, list[dict]], step: int, pods: dict[int, str], slow: set[int],
                    rng: np.random.Generator, world: int | None = None) -> dict[str, dict]:
    """Every rank's /telemetry after `step`, keyed as the operator polls them (`<pod>` for a pod's
    first rank, `<pod>/<local rank>` for the others); ranks in `slow` compute 2× longer. Each
    rank holds 4 of the step's 4 × world micro-batches, so S2 applies."""
    world = world or len(pods)
    computes = {r: 0.08 * np.exp(rng.normal(0, 0.02)) * (2.0 if r in slow else 1.0) for r in pods}
    snaps: dict[str, dict] = {}
    for rank, pod in pods.items():
        history.setdefault(rank, []).append({"step": step, "step_seconds": max(computes.values()) + 0.02,
                                             "compute_seconds": computes[rank], "comm_seconds": 0.02})
        snap = snapshot(rank, pod, 3 * step, 3 * step, float(step), history[rank][-256:])
        local = sum(1 for r in pods if pods[r] == pod and r < rank)
        snaps[pod if local == 0 else f"{pod}/{local}"] = {
            **snap, "world_size": world, "parameters": {"micro_batches": {"total": 4 * world, "mine": 4}}}
    return snaps


@pytest.mark.parametrize(("cap", "successor"), [("restart", "trainer-1-g1"), ("rebalance", "trainer-1")])
def test_after_a_hang_the_ladder_takes_a_later_fail_slow_from_s1(cap: str, successor: str) -> None:
    """S4 ends an incident, and a capped hang changes nothing: either way the ladder is at rest
    after it. Before, it stayed at S4 (or moved to the cap) for good, and a straggler after the
    hang was never even observed."""
    graph = build_graph()
    mgrs = managers.build_default_managers()
    costs = ladder.LadderCosts(rebalance=0.3, restart=1000.0)
    pol = policy.RemediationPolicy(Remediation(hang_timeout="2s", max_mitigation=cap), costs)
    for t in np.arange(100.0, 104.0, 0.5):
        seen = Seen(float(t), {"trainer-0": snapshot(0, "trainer-0", 42, 40, t),
                               "trainer-1": snapshot(1, "trainer-1", 40, 40, t)})
        for e in pol.decide(graph, seen):
            mgrs.dispatch(graph, e)
    assert pol.decisions[-1].level is MitigationLevel(cap)
    assert successor in graph.instance_names(), "S4 replaced the hung pod; a capped hang did not"
    hung = len(pol.decisions)
    rng, history = np.random.default_rng(3), {}
    for step in range(10, 130):
        slow = {1} if step >= 60 else set()
        snaps = straggler_snaps(history, step, {0: "trainer-0", 1: successor}, slow, rng)
        for e in pol.decide(graph, Seen(200.0 + step, snaps)):
            mgrs.dispatch(graph, e)
    later = pol.decisions[hung:]
    assert [d.level for d in later][:2] == [MitigationLevel.OBSERVE, MitigationLevel.REBALANCE], later
    assert f"on {successor} " in later[0].reason and "compute" in later[0].reason


def test_s4_after_s2_restores_the_even_counts_and_a_rebuilt_policy_agrees() -> None:
    """S2's counts were fitted to the pod S4 replaces: S4 takes them back to even, and a policy
    rebuilt from the trainer's params (a restarted operator) is at rest too. Before, the counts
    stayed in the graph (and the ConfigMap), and the old ladder stayed at S4."""
    graph = build_graph()
    mgrs = managers.build_default_managers()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), CLIMB)
    rng, history = np.random.default_rng(4), {}
    events: list[managers.Event] = []
    for step in range(120):
        snaps = straggler_snaps(history, step, PAIR, {1} if step >= 50 else set(), rng)
        for e in pol.decide(graph, Seen(float(step), snaps)):
            events.append(e)
            mgrs.dispatch(graph, e)
    levels = [d.level for d in pol.decisions]
    assert levels == [MitigationLevel.OBSERVE, MitigationLevel.REBALANCE, MitigationLevel.RESTART], levels
    s4 = [(e.type, e.data.get("instance") or e.data.get("key")) for e in events
          if "remediation S4" in str(e.data.get("reason"))]
    assert s4 == [(managers.INSTANCE_FAILED, "trainer-1"), (managers.PARAMETER_DECISION, "microbatches")]
    assert graph.vertex("trainer").params["microbatches"] == [4, 4]
    assert pol.ladder.level is None and pol.ladder.applied is None
    rebuilt = policy.RemediationPolicy(Remediation(hang_timeout="30s"))
    assert not rebuilt.resume(graph.vertex("trainer").params) and rebuilt.ladder.level is None


def test_a_job_wide_s4_is_recorded_though_it_replaces_no_pod() -> None:
    """Every rank slowed alike: the finding names no pod, so S4 replaces none. The operator used
    to drop every S4 decision as 'the InstanceManager's replace', and this one left no trace."""
    from huorn.operator import monitoring

    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), CLIMB)
    state = monitoring.JobPolicies(("uid", 1), pol, None)
    rng, history = np.random.default_rng(5), {}
    recorded = []
    for step in range(120):
        snaps = straggler_snaps(history, step, PAIR, {0, 1} if step >= 50 else set(), rng)
        assert pol.decide(graph, Seen(float(step), snaps)) == []
        recorded += monitoring.record_ladder(graph, state)
    assert "*" in pol.decisions[0].reason and pol.decisions[-1].level is MitigationLevel.RESTART
    assert recorded[-1].detail["new"]["level"] == "restart"
    assert "names no pod to replace" in recorded[-1].reason


def test_a_rebuilt_policy_takes_at_most_one_rung_from_the_history_it_replays() -> None:
    """A policy built anew for a running job (an operator restart, an edited spec) reads the
    telemetry's whole history in one tick. Those steps ran before any rung existed: it used to
    climb S1 → S2 → S4 at once."""
    graph = build_graph()
    rng, history = np.random.default_rng(6), {}
    for step in range(120):
        snaps = straggler_snaps(history, step, PAIR, {1} if step >= 50 else set(), rng)
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), CLIMB)
    pol.decide(graph, Seen(119.0, snaps))
    above = [d for d in pol.decisions if d.level is not MitigationLevel.OBSERVE]
    assert pol.decisions and pol.decisions[0].level is MitigationLevel.OBSERVE
    assert len(above) <= 1, pol.decisions


def test_each_gpu_of_a_ddp_pod_has_its_own_history() -> None:
    """Two pods of two GPUs, and only the first GPU of trainer-0 is slow. One history per pod
    kept whichever rank was read last (its healthy second GPU), and the straggler went unseen."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="observe"))
    rng, history = np.random.default_rng(7), {}
    pods = {0: "trainer-0", 1: "trainer-0", 2: "trainer-1", 3: "trainer-1"}
    for step in range(120):
        pol.decide(graph, Seen(float(step), straggler_snaps(history, step, pods, {0} if step >= 50 else set(),
                                                             rng)))
    assert pol.decisions, "the slow GPU was not found"
    assert pol.decisions[0].level is MitigationLevel.OBSERVE
    assert "compute" in pol.decisions[0].reason and "on trainer-0 " in pol.decisions[0].reason



def test_every_gpu_of_one_slow_pod_is_that_pod_not_half_of_the_job() -> None:
    """Two pods of two GPUs, and both GPUs of trainer-0 slow down (its host did). Counted by
    rank, two of four workers were half of the job, the finding was job-wide, and S4 had no pod
    to replace; counted by pod it is trainer-0's (found by review)."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="observe"))
    rng, history = np.random.default_rng(7), {}
    pods = {0: "trainer-0", 1: "trainer-0", 2: "trainer-1", 3: "trainer-1"}
    for step in range(120):
        pol.decide(graph, Seen(float(step), straggler_snaps(history, step, pods,
                                                             {0, 1} if step >= 50 else set(), rng)))
    assert pol.decisions, "the slow pod was not found"
    assert "on trainer-0 " in pol.decisions[0].reason and "*" not in pol.decisions[0].reason

def test_a_replaced_pods_history_does_not_count_as_a_worker() -> None:
    """Half of the live pods slowing down together is job-wide. The history of a pod replaced
    earlier used to stay, and as a fifth worker it made two of four live pods less than half."""
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["elasticity"].update(minReplicas=4, maxReplicas=4)
    graph = compiler.compile(manifest)
    mgrs = managers.build_default_managers()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="observe"))
    rng, history = np.random.default_rng(8), {}
    pods = {r: f"trainer-{r}" for r in range(4)}
    for step in range(160):
        if step == 60:
            mgrs.dispatch(graph, managers.Event(managers.INSTANCE_FAILED, "trainer", {
                "instance": "trainer-3", "reason": "its node went away"}))
            pods[3], history[3] = "trainer-3-g1", []
        pol.decide(graph, Seen(float(step), straggler_snaps(history, step, pods,
                                                             {0, 1} if step >= 110 else set(), rng)))
    assert pol.decisions, "nothing found"
    assert "job-wide" in pol.decisions[0].reason and " on * " in pol.decisions[0].reason, pol.decisions



def test_a_rank_whose_poll_timed_out_keeps_its_history_while_its_pods_other_ranks_answer() -> None:
    """A slow rank is the one likeliest to miss a poll. Its pod's other rank answering, its
    history was dropped as if torchrun had renumbered the pod, and its baseline was lost (found by
    the final review)."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s", max_mitigation="observe"))
    rng, history = np.random.default_rng(9), {}
    pods = {0: "trainer-0", 1: "trainer-0", 2: "trainer-1", 3: "trainer-1"}
    for step in range(20):
        pol.decide(graph, Seen(float(step), straggler_snaps(history, step, pods, set(), rng)))
    kept = len(pol.history["trainer-0/1"])
    snaps = straggler_snaps(history, 20, pods, set(), rng)
    del snaps["trainer-0/1"]  # its /telemetry timed out
    pol.decide(graph, Seen(20.0, snaps))
    assert len(pol.history["trainer-0/1"]) == kept
    # renumbered (torchrun gave rank 1 to trainer-1 after a restart): the old history goes
    renumbered = {0: "trainer-0", 1: "trainer-1"}
    pol.decide(graph, Seen(21.0, straggler_snaps({}, 21, renumbered, set(), rng, world=4)))
    assert "trainer-0/1" not in pol.history

def test_a_hang_inside_one_collective_with_no_culprit_is_recorded_once() -> None:
    """Every rank entered collective #41 and none completed it, all heartbeats alive: no rank
    stands out, so nothing can be replaced, but the hang is recorded (once), where it used to
    leave no trace."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="2s"))
    events = [e for t in range(100, 110) for e in pol.decide(graph, Seen(
        float(t), {"a": snapshot(0, "trainer-0", 41, 40, t), "b": snapshot(1, "trainer-1", 41, 40, t)}))]
    assert events == []
    assert [(d.level, d.action) for d in pol.decisions] == [(MitigationLevel.OBSERVE, "suspect-communicator")]
    assert "communicator" in pol.decisions[0].reason and "trainer-0, trainer-1" in pol.decisions[0].reason
    assert pol.ladder.level is None
    # one rank out of view (its pod being replaced): it may be the one that stands out
    partial = policy.RemediationPolicy(Remediation(hang_timeout="2s"))
    for t in range(100, 110):
        partial.decide(graph, Seen(float(t), {"a": snapshot(0, "trainer-0", 41, 40, t)}))
    assert partial.decisions == []
