"""Re-planning under S2 and S3: the applied plan is priced against the best plan for the speeds
measured now, every step; once the predicted saving pays for the rung's cost (ski-rental), the
ladder re-plans, and when the even split is best again the fail-slow is over and the ladder
starts afresh. Before, a rank that recovered sat idle behind counts fitted to its slowdown."""

from __future__ import annotations

from pathlib import Path

import job_support
import pytest
import remediation_support

from huorn.api.common import MitigationLevel
from huorn.backends.local import report
from huorn.scheduler.remediation import ladder

# Measures wall-clock behaviour of real processes: runs alone (scripts/test's serial part).
pytestmark = pytest.mark.serial

SLOW, COSTS = remediation_support.SLOW, remediation_support.LADDER_COSTS
on_s2 = remediation_support.climb_to_s2


def steps_until_decision(lad: ladder.MitigationLadder, limit: int = 100
                         ) -> tuple[int, ladder.Decision | None]:
    for step in range(1, limit + 1):
        decision = lad.on_step(1.2, 1.0)
        if decision is not None:
            return step, decision
    return limit, None


def test_a_recovered_rank_gets_the_even_split_back_and_the_ladder_resets() -> None:
    lad = on_s2([0.1, 0.7])
    assert lad.applied is not None and lad.applied["microbatches"] == [7, 1]
    lad.shape = ladder.JobShape(microbatch_seconds=[0.1, 0.1], total_microbatches=8)  # rank 1 healthy again
    step, decision = steps_until_decision(lad)
    assert decision is not None and decision.action == "restore-even"
    assert decision.level is MitigationLevel.REBALANCE and decision.plan["microbatches"] == [4, 4]
    # [7, 1] now costs 0.7 s a step and [4, 4] 0.4 s: 0.3 s saved a step pays the 1 s re-plan
    # after 4 priced steps, which start once the new plan's telemetry settled
    assert step == ladder.MitigationLadder.SETTLE_STEPS + 4
    assert "the fail-slow is over" in decision.reason and "[7, 1] now predict 0.700s" in decision.reason
    assert lad.level is None and lad.finding is None and lad.applied is None
    assert lad.on_step(5.0, 1.0) is None  # nothing climbs without a new finding


def test_a_slowdown_that_eases_is_re_planned_not_reset() -> None:
    lad = on_s2([0.1, 0.7])
    lad.shape = ladder.JobShape(microbatch_seconds=[0.1, 0.3], total_microbatches=8)
    _, decision = steps_until_decision(lad)
    assert decision is not None and decision.action == "replan-microbatches"
    assert decision.plan["microbatches"] == [6, 2]
    assert lad.level is MitigationLevel.REBALANCE and lad.applied["microbatches"] == [6, 2]
    assert steps_until_decision(lad, 40) == (40, None)  # the new plan is the best: it stays


def test_unchanged_speeds_never_re_plan_and_noise_does_not_add_up() -> None:
    lad = on_s2([0.1, 0.7])
    assert steps_until_decision(lad, 60) == (60, None)
    # the best plan flips away for a step and back: the saving restarts from zero each time
    for _ in range(ladder.MitigationLadder.SETTLE_STEPS):
        lad.on_step(1.0, 1.0)
    for _ in range(20):
        lad.shape = ladder.JobShape(microbatch_seconds=[0.1, 0.1], total_microbatches=8)
        assert lad.on_step(1.0, 1.0) is None or pytest.fail("0.3 s once is under the 1 s cost")
        lad.shape = ladder.JobShape(microbatch_seconds=[0.1, 0.7], total_microbatches=8)
        assert lad.on_step(1.0, 1.0) is None


def test_a_recovered_pipeline_stage_gets_the_even_layer_split_back() -> None:
    shape = ladder.JobShape(layer_costs=[1.0] * 8, stage_speeds=[0.2, 1.0], layer_seconds=0.05)
    lad = ladder.MitigationLadder(MitigationLevel.RESPLIT, COSTS, shape)
    lad.on_fail_slow(SLOW, [0])
    climbed = [d for d in (lad.on_step(2.0, 1.0) for _ in range(5)) if d is not None]
    assert [d.level for d in climbed] == [MitigationLevel.RESPLIT]
    assert climbed[0].plan["stageLayers"] == [1, 7]
    lad.shape = ladder.JobShape(layer_costs=[1.0] * 8, stage_speeds=[1.0, 1.0], layer_seconds=0.05)
    _, decision = steps_until_decision(lad)
    # [1, 7] at equal speeds: 7 × 0.05 = 0.35 s a step against 0.2 s for [4, 4]
    assert decision is not None and decision.action == "restore-even"
    assert decision.plan["stageLayers"] == [4, 4] and "0.350s" in decision.reason
    assert lad.level is None


def test_an_s2_that_would_change_nothing_is_skipped_not_applied() -> None:
    lad = ladder.MitigationLadder(MitigationLevel.RESTART, COSTS,
                                  ladder.JobShape(microbatch_seconds=[0.1, 0.105], total_microbatches=8))
    lad.on_fail_slow(SLOW, [1])
    decision = lad.on_step(2.0, 1.0)
    assert decision is not None and decision.action == "skip-rebalance-microbatches"
    assert decision.plan == {} and "would change nothing" in decision.reason
    # the loss climbs on, and the even split is what is in force, priced like an applied plan
    assert lad.level is MitigationLevel.REBALANCE and lad.applied is not None
    assert lad.applied["microbatches"] == [4, 4]


def test_a_straggler_after_a_passed_s2_still_gets_its_plan() -> None:
    """A start-up blip passed S2 (the even split was best); rank 1 then slows for real. The ladder,
    no longer at S1, takes no new finding, so the even split in force must be priced and re-planned
    like any applied plan: before, the straggler was never rebalanced."""
    lad = ladder.MitigationLadder(MitigationLevel.REBALANCE, COSTS,
                                  ladder.JobShape(microbatch_seconds=[0.1, 0.1], total_microbatches=8))
    lad.on_fail_slow(SLOW, [1])
    assert lad.on_step(2.0, 1.0).action == "skip-rebalance-microbatches"  # type: ignore[union-attr]
    lad.shape = ladder.JobShape(microbatch_seconds=[0.1, 0.4], total_microbatches=8)
    step, decision = steps_until_decision(lad)
    assert decision is not None and decision.action == "rebalance-microbatches"
    assert decision.plan["microbatches"][1] < 4 and sum(decision.plan["microbatches"]) == 8
    # [4, 4] now costs 1.6 s a step against [7, 1]'s 0.7: the 1 s re-plan is paid on the second
    # priced step, which start once the even split's telemetry settled
    assert step == ladder.MitigationLadder.SETTLE_STEPS + 2
    assert lad.applied is not None and lad.applied["microbatches"] == decision.plan["microbatches"]


def test_a_pipeline_shape_without_seconds_is_not_re_planned() -> None:
    shape = ladder.JobShape(layer_costs=[1.0] * 8, stage_speeds=[0.2, 1.0])
    lad = ladder.MitigationLadder(MitigationLevel.RESPLIT, COSTS, shape)
    lad.on_fail_slow(SLOW, [0])
    for _ in range(5):
        lad.on_step(2.0, 1.0)
    lad.shape = ladder.JobShape(layer_costs=[1.0] * 8, stage_speeds=[1.0, 1.0])
    assert steps_until_decision(lad, 50) == (50, None)


@pytest.mark.alone  # two ranks that fill the machine: a neighbour's load reads as fail-slow
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_s2_is_undone_on_a_real_job_once_the_slow_rank_recovers(tmp_path: Path) -> None:
    """Local backend, real trainers: rank 1 computes 4× slower from step 25 to 55 (past the
    start-up's slower first steps on a loaded host, and scaled to its own compute so that the
    slowdown keeps its size on any host: tests/test_remediation_s2_local.py). The ladder takes S2,
    then, once telemetry shows rank 1 healthy again, restores the even counts (possibly through
    a re-plan on the way, as the speeds settle), which the
    trainers apply from a step boundary on, with no step lost or repeated."""
    # NB: 300 steps leave room for the way back ([7, 1] → maybe [5, 3] → [4, 4]) to be decided AND
    # applied before the job ends, also when a loaded machine makes the monitor lag the steps (at
    # 200, once, a restore decided through a re-plan came too late to be applied)
    steps_total, slow_from, slow_until = 300, 25, 55
    manifest = job_support.tiny_job(replicas=2, steps=steps_total, micro_batch=1,
                                    remediation={"hangTimeout": "60s", "maxMitigation": "rebalance"})
    run = remediation_support.run_with_faults(
        manifest, [{"kind": "slow-compute", "factor": 4.0, "perMicroBatch": True, "fromStep": slow_from,
                    "untilStep": slow_until, "replica": "trainer-1"}],
        # 0.05 s: at 0.02 s every few ms of noise between two tiny ranks on a loaded host paid a
        # re-plan, the counts flapped ([3, 5], [5, 3], [1, 7]) and even never came back (once in a
        # full run); at 0.2 s a recovered rank left at [5, 3] (2 ms a step over even) could not pay
        # the way back within the job (once, alone)
        ladder.LadderCosts(rebalance=0.05), tmp_path / "run", steps_total)
    assert run.finished, run.actions[-3000:]
    # the decisions that changed the counts (after the restore, noise at this tiny rung cost may
    # climb to S2 again, which then changes nothing and is recorded as skipped)
    s2 = [d for d in run.remediation.decisions
          if d.level is MitigationLevel.REBALANCE and "microbatches" in d.plan]
    # on the way back the noisy speeds may pass through a re-plan ([6, 2]) before [4, 4]
    actions = [d.action for d in s2]
    # every decision in the message: an empty s2 may be no finding at all, or a rung passed early
    assert actions and actions[0] == "rebalance-microbatches" and "restore-even" in actions, \
        run.remediation.decisions
    restore = actions.index("restore-even")
    assert set(actions[1:restore]) <= {"replan-microbatches"}, s2
    # S2 answered the fault by giving rank 1 fewer micro-batches. A start-up blip on rank 0 may be
    # answered first (CI, 2026-12-05: [3, 5] before the fault, then re-planned), so not necessarily
    # by the first decision, but before the restore.
    assert any(d.plan["microbatches"][1] < 4 for d in s2[:restore]), s2
    assert s2[restore].plan["microbatches"] == [4, 4]
    records = report.read_records(run.run_dir)
    plans = [r for r in records if r.get("event") == "microbatch-plan"]
    # the trainers applied the plans in the order decided (a decision in the job's last steps
    # may come too late to be applied)
    assert len(plans) > restore, (plans, s2)
    assert [p["counts"] for p in plans] == [d.plan["microbatches"] for d in s2][:len(plans)]
    assert plans[restore]["from_step"] > slow_until
    steps = {r["step"]: r for r in records if r.get("event") == "step"}
    summary = report.summarise_steps(list(steps.values()))
    assert summary.last == steps_total and not summary.missing and summary.repeated == 0, summary
    restored_from = plans[restore]["from_step"]
    until = plans[restore + 1]["from_step"] if len(plans) > restore + 1 else steps_total + 1
    assert restored_from < until <= steps_total + 1  # some step ran on the restored plan
    assert all(steps[s].get("microbatches") == [4, 4] for s in steps if restored_from <= s < until)
    # NB: no step-time assertion: on this shared 2-core box a tiny model's steps vary more
    # than the 12 ms that [7, 1] costs a recovered rank; benchmarks/ would be the place
