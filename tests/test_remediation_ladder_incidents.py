"""The ladder across incidents: what one slowdown, recovery or S4 leaves behind must not decide
the next one (findings of a review that replayed whole jobs through the policy)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from remediation_support import Seen

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import compiler, managers, model
from huorn.scheduler.remediation import failslow, ladder, policy

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def build_graph(replicas: int = 2) -> model.Graph:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["elasticity"].update(minReplicas=replicas, maxReplicas=replicas)
    return compiler.compile(manifest)


class Gang:
    """A simulated gang under the policy, one tick a step: each rank's runtime serves its last 256
    step records, an S4 replacement takes the new pod's place in the gang, which restarts from
    its checkpoint `rewind` steps back (the new pod's runtime serves nothing before it)."""

    def __init__(self, graph: model.Graph, pol: policy.RemediationPolicy, pods: dict[int, str],
                 seed: int, rewind: int = 5, extra: Callable[[int], dict[str, Any]] | None = None) -> None:
        self.graph, self.pol, self.pods, self.rewind = graph, pol, dict(pods), rewind
        self.managers = managers.build_default_managers()
        self.rng = np.random.default_rng(seed)
        self.served: dict[int, list[dict]] = {r: [] for r in pods}
        self.extra = extra or (lambda rank: {})
        self.replaced: list[str] = []
        self.step = 0

    def run(self, until: int, factor: Callable[[int, str, int], float], replacements: int = 5) -> None:
        """Steps until `until`, or until S4 made `replacements` (a runaway S4 loop ends the run);
        `factor(rank, pod, step)` scales a rank's compute."""
        while self.step < until and len(self.replaced) < replacements:
            computes = {r: 0.04 * np.exp(self.rng.normal(0, 0.02)) * factor(r, self.pods[r], self.step)
                        for r in self.pods}
            for r, compute in computes.items():
                self.served[r].append({"step": self.step, "step_seconds": max(computes.values()) + 0.01,
                                       "compute_seconds": compute,
                                       "comm_seconds": max(computes.values()) - compute + 0.01})
            snaps = {f"{pod}/{r}": {"job": "q", "rank": r, "world_size": len(self.pods), "replica": pod,
                                    "heartbeat": float(self.step), "steps": self.served[r][-256:],
                                    "collective": {"entered": 3 * self.step, "completed": 3 * self.step,
                                                   "in_flight": []}, **self.extra(r)}
                     for r, pod in self.pods.items()}
            events = self.pol.decide(self.graph, Seen(float(self.step), snaps))
            self.step += 1
            for event in events:
                for mutation in self.managers.dispatch(self.graph, event):
                    if mutation.action == "replace":
                        self._replace(mutation.detail["old"], mutation.detail["new"])

    def _replace(self, old: str, new: str) -> None:
        self.replaced.append(old)
        self.step -= self.rewind + 1
        for r, pod in list(self.pods.items()):
            if pod == old:
                self.pods[r], self.served[r] = new, []
            else:
                self.served[r] = [x for x in self.served[r] if x["step"] < self.step]


def pipelined(rank: int) -> dict[str, Any]:
    return {"parameters": {"pipeline": {"stages": 2}}}


def test_after_s4_a_pipelined_ranks_old_steps_are_not_its_replacements() -> None:
    """2 stages × 2 replicas, a pod per replica. Rank 2 (trainer-1) computes 2× slower from step
    50 until S4 replaces its pod; rank 0 (trainer-0) from step 160. A pipelined rank's history
    was keyed by its rank alone, so the replacement inherited trainer-1's slow steps: S4 replaced
    trainer-1-g1, -g2, ... from the old onset, each a cordoned node, and trainer-0 never."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(restart=3.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-0", 2: "trainer-1", 3: "trainer-1"}, seed=2,
                extra=pipelined)

    def factor(rank: int, pod: str, step: int) -> float:
        slow = (rank == 2 and pod == "trainer-1" and step >= 50) or (rank == 0 and step >= 160)
        return 2.0 if slow else 1.0

    gang.run(260, factor)
    assert gang.replaced == ["trainer-1", "trainer-0"], pol.decisions
    assert not [d for d in pol.decisions if "trainer-1-g1" in d.reason], pol.decisions


def test_a_slowdown_that_recovered_at_s1_does_not_take_the_next_stragglers_s4() -> None:
    """trainer-1 is 1.5× slow for 30 steps (a loss well under S4's price) and recovers; trainer-0
    slows 3× from step 150 for good. The ladder ignored recoveries and took new findings only at
    rest, so it sat at S1 on trainer-1's finding, trainer-0's loss paid for S4 under that name,
    and S4 replaced trainer-1, which had recovered 90 steps before."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(restart=2.5))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=1)

    def factor(rank: int, pod: str, step: int) -> float:
        if rank == 1 and 30 <= step < 60:
            return 1.5
        return 3.0 if rank == 0 and step >= 150 else 1.0

    gang.run(220, factor)
    assert gang.replaced == ["trainer-0"], pol.decisions


def micro_batches(rank: int) -> dict[str, Any]:
    return {"parameters": {"micro_batches": {"total": 8, "mine": 4}}}


def eases(rank: int, pod: str, step: int, until: int = 10_000) -> float:
    """trainer-1 computes 4× slower from step 30, 3.4× from step 45 (a 15 % easing), healthy
    again from `until`."""
    return 4.0 if rank == 1 and 30 <= step < 45 else 3.4 if rank == 1 and 45 <= step < until else 1.0


def test_a_straggler_that_eases_but_stays_slow_still_gets_s2() -> None:
    """A drop of a 4× straggler's compute to 3.4× is a validated change of factor < 1. It was
    taken as the slowdown's end: the ladder came to rest at S1, and the job ran the rest of its
    steps 3.4× slow with no rung taken (a full suite's run of the S2 scenario, a 4.30× straggler
    eased ×0.87 on a loaded host)."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(rebalance=6.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=1, extra=micro_batches)
    from huorn.operator import monitoring

    state = monitoring.JobPolicies(("uid", 1), pol, None)
    gang.run(60, eases)
    assert [d.action for d in pol.decisions] == ["observe", "eased"], pol.decisions
    assert "is still ×3.4" in pol.decisions[1].reason, pol.decisions[1].reason
    assert pol.ladder.finding is not None and 3.2 < pol.ladder.finding.factor < 3.6  # what is left of it
    # the operator logs the easing and keeps S1 in `mitigation`: it changes nothing in force
    monitoring.record_ladder(graph, state)
    assert graph.vertex("trainer").params["mitigation"]["action"] == "observe"
    assert any("(eased)" in m.reason for m in graph.log), [m.reason for m in graph.log]
    gang.run(160, eases)
    assert [d.action for d in pol.decisions] == ["observe", "eased", "rebalance-microbatches"], pol.decisions


def test_a_straggler_that_eased_comes_to_rest_when_it_is_healthy_again() -> None:
    """The easing keeps the incident open at what is left of the slowdown (4× × 0.85); the return
    to the healthy level ends it (the ladder's price of S2 is not paid in between)."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(rebalance=60.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=1, extra=micro_batches)
    gang.run(160, lambda rank, pod, step: eases(rank, pod, step, until=90))
    assert [d.action for d in pol.decisions] == ["observe", "eased", "recovered"], pol.decisions
    assert pol.ladder.level is None and pol.ladder.finding is None


def test_an_easing_seen_again_at_a_shifted_onset_is_not_taken_twice() -> None:
    """The policy skips findings it has seen by their onset, but an onset can move by a few steps
    once the detector's window slides; each sighting of the same easing compounded it again, and
    enough of them would have ended the incident of a worker that is still 3.4× slow."""
    lad = ladder.MitigationLadder(MitigationLevel.RESTART)
    lad.on_fail_slow(failslow.SlowFinding("trainer-1", "compute", 30, 40, 4.0), (1,))
    eased = lad.on_recovery(failslow.SlowFinding("trainer-1", "compute", 45, 55, 0.85))
    assert eased is not None and eased.action == "eased"
    assert lad.on_recovery(failslow.SlowFinding("trainer-1", "compute", 47, 57, 0.86)) is None
    assert lad.finding is not None and lad.finding.factor == pytest.approx(3.4)
    # a full recovery soon after is a change of its own
    over = lad.on_recovery(failslow.SlowFinding("trainer-1", "compute", 52, 60, 0.3))
    assert over is not None and over.action == "recovered" and lad.level is None and lad.changes == []


def test_two_halvings_in_a_row_are_two_changes_and_end_the_incident() -> None:
    """4× from step 30, 2× from 50, healthy from 65: both drops are ×0.5 within 20 steps of each
    other, which the repeat check alone took for one easing seen twice, and the incident of a
    healthy worker never ended. The detector still reports the first when the second comes."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(rebalance=60.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=1, extra=micro_batches)
    gang.run(110, lambda rank, pod, step: (4.0 if 30 <= step < 50 else 2.0 if 50 <= step < 65 else 1.0)
             if rank == 1 else 1.0)
    assert [d.action for d in pol.decisions] == ["observe", "eased", "recovered"], pol.decisions
    assert pol.ladder.level is None


def see_saw(rank: int, pod: str, step: int) -> float:
    """trainer-1 computes 4× slower from step 30, 2× from 50, 4× again from 70, 2× from 90."""
    if rank != 1 or step < 30:
        return 1.0
    return 4.0 if step < 50 or 70 <= step < 90 else 2.0


def test_a_straggler_that_worsens_again_after_an_easing_is_not_taken_for_recovered() -> None:
    """The rise after an easing was ignored (it neither starts an incident nor supersedes its
    own), so 4× → 2× → 4× → 2× read as 4× eased to 2× and then to 1×: the incident ended while
    the worker still ran twice as slow, and the ladder sat at rest."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(rebalance=600.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=1, extra=micro_batches)
    from huorn.operator import monitoring

    state = monitoring.JobPolicies(("uid", 1), pol, None)
    gang.run(130, see_saw)
    assert [d.action for d in pol.decisions] == ["observe", "eased", "worsened", "eased"], pol.decisions
    assert "is now ×4" in pol.decisions[2].reason, pol.decisions[2].reason
    assert pol.ladder.level is MitigationLevel.OBSERVE
    assert pol.ladder.finding is not None and 1.8 < pol.ladder.finding.factor < 2.2  # still 2× slow
    monitoring.record_ladder(graph, state)  # a log-only note, as an easing is
    assert graph.vertex("trainer").params["mitigation"]["action"] == "observe"
    assert any("(worsened)" in m.reason for m in graph.log), [m.reason for m in graph.log]


def test_the_slowdown_seen_again_at_a_moved_onset_is_not_a_rise() -> None:
    """The detector's window moves an onset by a few steps: the slowdown itself, seen again so,
    must not compound (4× × 4×), while a second rise it still reports beside the first does."""
    lad = ladder.MitigationLadder(MitigationLevel.RESTART)
    lad.on_fail_slow(failslow.SlowFinding("trainer-1", "compute", 30, 40, 4.0), (1,))
    assert lad.on_worsening(failslow.SlowFinding("trainer-1", "compute", 33, 43, 4.1)) is None
    assert lad.on_worsening(failslow.SlowFinding("trainer-0", "compute", 60, 70, 2.0)) is None  # elsewhere
    eased = lad.on_recovery(failslow.SlowFinding("trainer-1", "compute", 50, 60, 0.5))
    assert eased is not None and eased.action == "eased"
    first_again = failslow.SlowFinding("trainer-1", "compute", 34, 61, 4.0)
    assert lad.on_worsening(first_again) is None
    worse = lad.on_worsening(failslow.SlowFinding("trainer-1", "compute", 70, 80, 2.0), reported=(50, 70))
    assert worse is not None and worse.action == "worsened"
    assert lad.finding is not None and lad.finding.factor == pytest.approx(4.0)
    assert lad.on_worsening(failslow.SlowFinding("trainer-1", "compute", 72, 82, 2.0)) is None  # seen again
    assert lad.finding.factor == pytest.approx(4.0)


def test_a_new_straggler_takes_the_place_of_a_milder_one_observed_at_s1() -> None:
    """trainer-1 stays 1.3× slow from step 30, too mild for its loss to have paid for S4 by step
    150, when trainer-0 slows 3×. The new finding was dropped while the ladder sat at S1, and S4,
    paid for by trainer-0's loss, replaced trainer-1."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(restart=2.5))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=1)

    def factor(rank: int, pod: str, step: int) -> float:
        if rank == 1 and step >= 30:
            return 1.3
        return 3.0 if rank == 0 and step >= 150 else 1.0

    gang.run(220, factor)
    assert gang.replaced == ["trainer-0"], pol.decisions


def slow_one_then_the_other(rank: int, pod: str, step: int) -> float:
    """trainer-1 computes 2× slower from step 50 until S4 replaces it, trainer-0 from step 170."""
    return 2.0 if (pod == "trainer-1" and step >= 50) or (rank == 0 and step >= 170) else 1.0


def test_after_s4_nothing_is_decided_until_a_new_slowdown_begins() -> None:
    """S4 drops the replaced pod's history, and the survivor's waits for it (which the per-step
    minimum of communication time over ranks used to exclude) then set that minimum: the old
    slowdown came back as a job-wide communication finding from its old onset, and climbed to an
    S4 that named no pod."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(restart=2.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=4)
    gang.run(250, slow_one_then_the_other)
    assert gang.replaced == ["trainer-1", "trainer-0"], pol.decisions
    assert [(d.level, d.replaced) for d in pol.decisions] == [
        (MitigationLevel.OBSERVE, ()), (MitigationLevel.RESTART, ("trainer-1",)),
        (MitigationLevel.OBSERVE, ()), (MitigationLevel.RESTART, ("trainer-0",))], pol.decisions


def test_a_policy_rebuilt_after_s4_does_not_find_the_old_slowdown_in_the_replayed_history() -> None:
    """An operator restarted after S4 builds a new policy, which replays the 256 steps the
    telemetry still holds; only the graph tells it that S4 already ended the slowdown in them."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(restart=2.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=4)
    gang.run(250, slow_one_then_the_other, replacements=1)
    assert gang.replaced == ["trainer-1"], pol.decisions
    gang.pol = rebuilt = policy.RemediationPolicy(Remediation(hang_timeout="30s"),
                                                  ladder.LadderCosts(restart=2.0))
    assert not rebuilt.resume(graph.vertex("trainer").params)
    gang.run(250, slow_one_then_the_other)
    assert gang.replaced == ["trainer-1", "trainer-0"], rebuilt.decisions
    assert [(d.level, d.replaced) for d in rebuilt.decisions] == [
        (MitigationLevel.OBSERVE, ()), (MitigationLevel.RESTART, ("trainer-0",))], rebuilt.decisions


def _every_rank_twice_as_slow_from_step_50(rank: int, pod: str, step: int) -> float:
    return 2.0 if step >= 50 else 1.0


def _after_a_job_wide_s4() -> tuple[Any, ladder.LadderCosts, policy.RemediationPolicy, Gang, Any, Any]:
    """A two-pod job slowed as a whole from step 50, run with the operator's records until the
    ladder takes its S4 (which, job-wide, replaces no pod)."""
    from huorn.operator import monitoring

    graph = build_graph()
    costs = ladder.LadderCosts(restart=2.0)
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), costs)
    state = monitoring.JobPolicies(("uid", 1), pol, None)
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=5)
    every = _every_rank_twice_as_slow_from_step_50
    while not pol.decisions or pol.decisions[-1].level is not MitigationLevel.RESTART:
        gang.run(gang.step + 1, every)
        monitoring.record_ladder(graph, state)
    return graph, costs, pol, gang, every, state


def test_a_policy_rebuilt_after_a_job_wide_s4_does_not_take_it_again() -> None:
    """A job-wide S4 replaces no pod; the operator records it in the trainer's `mitigation`
    parameter, and that is where a rebuilt policy learns of it. Before, the replay found the
    same job-wide slowdown and climbed to another S4 after every operator restart."""
    _, costs, pol, gang, every, _ = _after_a_job_wide_s4()
    assert pol.decisions[-1].replaced == () and gang.replaced == []
    gang.pol = rebuilt = policy.RemediationPolicy(Remediation(hang_timeout="30s"), costs)
    gang.run(gang.step + 40, every)
    assert rebuilt.decisions == []


def test_a_job_wide_s4_outlives_the_records_the_operator_writes_after_it() -> None:
    """After a job-wide S4 the whole job stops outside collectives (a checkpoint longer than
    hangTimeout): the policy records that, and the operator used to write it over the trainer's
    `mitigation` parameter, the only place the S4's step lived. A rebuilt policy then took the
    old slowdown's S1 → S4 again. No-op records go into the log only, and every later rung keeps
    the S4's step."""
    from huorn.operator import monitoring

    graph, costs, pol, gang, every, state = _after_a_job_wide_s4()
    at = pol.decisions[-1].plan["atStep"]
    snaps = {f"{pod}/{r}": {"job": "q", "rank": r, "world_size": 2, "replica": pod, "heartbeat": 0.0,
                            "steps": gang.served[r][-256:],
                            "collective": {"entered": 7, "completed": 7, "in_flight": [], "changed": 1000.0}}
             for r, pod in gang.pods.items()}
    for t in range(1000, 1040):
        for snap in snaps.values():
            snap["heartbeat"] = float(t)
        pol.decide(graph, Seen(float(t), snaps))
    recorded = monitoring.record_ladder(graph, state)
    assert pol.decisions[-1].action == "stalled-outside-collectives"
    assert recorded and all(m.detail.get("key") == monitoring.MITIGATION_PARAM for m in recorded)
    assert graph.vertex("trainer").params["mitigation"]["plan"]["atStep"] == at
    assert policy.last_restart_step(graph) == at
    gang.pol = rebuilt = policy.RemediationPolicy(Remediation(hang_timeout="30s"), costs)
    gang.run(gang.step + 40, every)
    assert rebuilt.decisions == []


def test_a_hang_on_another_pod_keeps_a_ddp_stragglers_s2_counts() -> None:
    """Four DDP pods; trainer-1 is 2× slow per micro-batch from step 40 and S2 moves work off
    it; at step 110 trainer-2 hangs outside the next all-reduce, and S4 replaces it. The ladder
    kept the counts only if it knew the straggler's ranks, which the policy gives no DDP
    finding, so S4 put them back to even and left the straggler there for good."""
    graph = build_graph(replicas=4)
    mgrs = managers.build_default_managers()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="3s"),
                                   ladder.LadderCosts(rebalance=0.5, restart=1000.0))
    rng = np.random.default_rng(3)
    pods = {r: f"trainer-{r}" for r in range(4)}
    served: dict[int, list[dict]] = {r: [] for r in pods}
    counts, seq, replaced = [4] * 4, 0, []
    for step in range(120):
        hung = step >= 110
        if not hung:
            seq += 3
            per_mb = [0.02 * np.exp(rng.normal(0, 0.02)) * (2.0 if r == 1 and step >= 40 else 1.0)
                      for r in pods]
            computes = [per_mb[r] * counts[r] for r in pods]
            for r in pods:
                served[r].append({"step": step, "step_seconds": max(computes) + 0.02,
                                  "compute_seconds": computes[r], "microbatch_seconds": per_mb[r],
                                  "comm_seconds": max(computes) - computes[r] + 0.02})
        snaps = {}
        for r, pod in pods.items():
            entered = seq - 1 if hung and r == 2 else seq  # trainer-2 never enters the next one
            completed = entered if r == 2 or not hung else seq - 1
            snaps[pod] = {"rank": r, "world_size": 4, "replica": pod, "heartbeat": float(step),
                          "steps": served[r][-256:],
                          "parameters": {"micro_batches": {"total": 16, "mine": counts[r]}},
                          "collective": {"entered": entered, "completed": completed, "in_flight": []}}
        for event in pol.decide(graph, Seen(float(step), snaps)):
            for mutation in mgrs.dispatch(graph, event):
                if mutation.action == "set-param" and mutation.detail["key"] == "microbatches":
                    counts = list(mutation.detail["new"])
                if mutation.action == "replace":
                    replaced.append(mutation.detail["old"])
    assert replaced == ["trainer-2"], pol.decisions
    assert counts != [4] * 4 and counts[1] == min(counts), pol.decisions
    assert graph.vertex("trainer").params["microbatches"] == counts
    assert pol.ladder.level is MitigationLevel.REBALANCE and pol.ladder.counts_in_force == counts


def test_a_survivors_slowdown_that_begins_in_the_steps_re_run_after_s4_is_decided() -> None:
    """trainer-1 is 2× slow from step 50 and S4 replaces it at step 100; the gang resumes from
    its checkpoint 30 steps back, and trainer-0 slows 3× two steps into the re-run. Its onset
    (72) precedes the S4's step, and the cutoff meant for the old slowdown ignored it for good;
    it now applies only to findings on the replaced pod and job-wide ones."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"), ladder.LadderCosts(restart=2.0))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=4, rewind=30)
    resumed: dict[str, int] = {}

    def factor(rank: int, pod: str, step: int) -> float:
        if pod == "trainer-1" and step >= 50:
            return 2.0
        if gang.replaced and rank == 0:
            resumed.setdefault("at", step)
            return 3.0 if step >= resumed["at"] + 2 else 1.0
        return 1.0

    gang.run(400, factor)
    assert resumed["at"] < 100
    assert gang.replaced == ["trainer-1", "trainer-0"], pol.decisions


def test_steps_past_a_workers_newest_are_forgotten_when_the_gang_goes_back_to_a_checkpoint() -> None:
    """A rank that restarts from a checkpoint serves its steps from there again. Its history kept
    the old records of the steps after it, so each re-run step's time sat beside the old times
    of the next ones, which read as a change at the step being re-run (a fresh 3× straggler
    after an S4 was taken for recovered ten steps later, its ladder at rest)."""
    graph = build_graph()
    pol = policy.RemediationPolicy(Remediation(hang_timeout="30s"))
    gang = Gang(graph, pol, {0: "trainer-0", 1: "trainer-1"}, seed=2)
    gang.run(100, lambda rank, pod, step: 1.0)
    assert all(max(h) == 99 for h in pol.history.values())
    for r in gang.served:  # the gang went back to step 70 and ran it again
        gang.served[r] = [x for x in gang.served[r] if x["step"] < 70]
    gang.step = 70
    gang.run(75, lambda rank, pod, step: 3.0 if rank == 0 else 1.0)
    assert sorted(max(h) for h in pol.history.values()) == [74, 74]
