"""S2 for a pipelined job, the control-plane half: a pipeline replica's seconds per micro-batch
are its slowest stage's, so a slow replica (or one slow stage in it) gets counts that favour the
other replicas, while a stage that is slow in every replica leaves S2 nothing to do and the
ladder passes on to S3. Without processes: telemetry snapshots shaped like the pipeline
trainer's /telemetry, 2 stages × 2 replicas (rank = replica × 2 + stage)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import yaml

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import compiler, managers, model
from huorn.scheduler.remediation import failslow, ladder, policy, rebalance

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"
SLOW = failslow.SlowFinding("trainer-1", "compute", 40, 50, 3.0)
COSTS = ladder.LadderCosts(rebalance=1.0, resplit=2.0, restart=1000.0)
TOTAL = 8


def build_graph() -> model.Graph:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["model"]["layers"] = 4
    manifest["spec"]["parallelism"] = {"pipelineStages": 2, "schedule": "1f1b"}
    return compiler.compile(manifest)


def snapshot(rank: int, per_microbatch: float, mine: int = TOTAL // 2, split: tuple[int, ...] = (2, 2),
             runtime_figure: bool = True) -> dict:
    """One rank of 2 stages × 2 replicas; compute is its micro-batches' F+B plus a fixed 0.05 s."""
    return {"rank": rank, "world_size": 4, "replica": f"trainer-{rank // 2}",
            "parameters": {"pipeline": {"stages": 2, "replicas": 2, "stage_layers": list(split)},
                           "micro_batches": {"total": TOTAL, "mine": mine}},
            "steps": [{"step": s, "step_seconds": 1.0, "compute_seconds": mine * per_microbatch + 0.05,
                       "comm_seconds": 0.1,
                       **({"microbatch_seconds": per_microbatch} if runtime_figure else {})}
                      for s in range(policy.SHAPE_WINDOW)]}


def shape_of(per_rank: list[float], **kwargs: object) -> ladder.JobShape:
    shape = policy.build_pipeline_shape({str(r): snapshot(r, t, **kwargs) for r, t in enumerate(per_rank)})
    assert shape is not None
    return shape


def climb(shape: ladder.JobShape, cap: MitigationLevel = MitigationLevel.RESPLIT) -> list[ladder.Decision]:
    """The ladder's decisions from a validated fail-slow until it stops moving (or S3)."""
    lad = ladder.MitigationLadder(cap, COSTS, shape)
    decisions = [lad.on_fail_slow(SLOW, [])]
    for _ in range(50):
        decision = lad.on_step(2.0, 1.0)
        if decision is not None:
            decisions.append(decision)
            if decision.level is MitigationLevel.RESPLIT:
                break
    return decisions


def test_a_replica_is_as_fast_as_its_slowest_stage() -> None:
    # replica 1's stage 0 (rank 2) takes 0.3 s per micro-batch, everything else 0.1 s
    shape = shape_of([0.1, 0.1, 0.3, 0.1])
    assert shape.microbatch_seconds == pytest.approx([0.1, 0.3]) and shape.total_microbatches == TOTAL
    # and a fixed part a step: one micro-batch through its other stage (fill and drain)
    assert shape.fixed_seconds == pytest.approx([0.1, 0.1])
    assert shape.stage_speeds is not None and shape.layer_costs == [1.0] * 4  # S3's half is unchanged
    # older runtimes publish no microbatch_seconds: compute over the replica's micro-batches
    fallback = shape_of([0.1, 0.1, 0.3, 0.1], runtime_figure=False)
    assert fallback.microbatch_seconds == pytest.approx([0.1125, 0.3125])


def test_a_slow_replica_gets_fewer_micro_batches() -> None:
    decisions = climb(shape_of([0.1, 0.1, 0.3, 0.1]))
    s2 = decisions[1]
    assert s2.level is MitigationLevel.REBALANCE and s2.action == "rebalance-microbatches"
    counts = s2.plan["microbatches"]
    # N·t + fill: [6, 2] takes 0.6 + 0.1 s on replica 0 and 0.6 + 0.1 s on replica 1
    assert len(counts) == 2 and sum(counts) == TOTAL and counts == [6, 2]
    assert s2.plan["predictedStepSeconds"] == pytest.approx(0.7)
    assert s2.plan["stepSecondsBefore"] == pytest.approx(1.3)  # [4, 4]: 1.2 + 0.1 s on replica 1
    # the decision reaches the trainer vertex as one count per pipeline replica
    g = build_graph()
    remediation = policy.RemediationPolicy(Remediation.model_validate({"maxMitigation": "resplit"}))
    events = remediation._events_for(g, s2, ())
    assert [e.data["key"] for e in events] == ["microbatches"]
    mutations = managers.build_default_managers().dispatch(g, events[0])
    assert mutations[0].detail["new"] == [6, 2]
    assert mutations[0].reason.startswith("remediation S2 (rebalance-microbatches)")


def test_a_stage_slow_in_every_replica_is_left_to_s3() -> None:
    decisions = climb(shape_of([0.3, 0.1, 0.3, 0.1]))
    assert [d.action for d in decisions] == ["observe", "skip-rebalance-microbatches", "resplit-stages"]
    assert "even split is already the best plan" in decisions[1].reason and not decisions[1].plan
    layers = decisions[2].plan["stageLayers"]
    assert layers[0] < 2 and sum(layers) == 4  # layers move off the slow stage 0, in both replicas


def test_the_pipeline_gang_is_never_read_as_data_parallel_ranks() -> None:
    snaps = {str(r): snapshot(r, t) for r, t in enumerate([0.1, 0.1, 0.3, 0.1])}
    assert policy.build_shape(snaps) is None  # four "ranks" would be a plan of the wrong length


def test_s2_waits_for_every_rank_while_s3_needs_every_stage() -> None:
    snaps = {str(r): snapshot(r, t) for r, t in enumerate([0.1, 0.1, 0.3])}  # rank 3 not seen yet
    shape = policy.build_pipeline_shape(snaps)
    assert shape is not None and shape.stage_speeds is not None
    assert shape.microbatch_seconds is None
    lad = ladder.MitigationLadder(MitigationLevel.RESPLIT, COSTS, shape)
    assert not lad.applicable(MitigationLevel.REBALANCE)


def test_after_s2_the_counts_in_force_do_not_change_the_replica_speeds() -> None:
    """Under [6, 2] the slow replica's compute shrinks; its seconds per micro-batch do not, so
    the applied plan prices the same and is not re-planned away."""
    shape = shape_of([0.1, 0.1, 0.3, 0.1])
    after = policy.build_pipeline_shape({str(r): snapshot(r, t, mine=(6, 2)[r // 2])
                                         for r, t in enumerate([0.1, 0.1, 0.3, 0.1])})
    assert after is not None and after.microbatch_seconds == pytest.approx(shape.microbatch_seconds)


def s2_then_s3() -> ladder.MitigationLadder:
    lad = ladder.MitigationLadder(MitigationLevel.RESPLIT, ladder.LadderCosts(rebalance=1.0, resplit=3.0),
                                  shape_of([0.1, 0.1, 0.3, 0.1]))
    lad.on_fail_slow(SLOW, [])
    made = []
    while len(made) < 2:
        decision = lad.on_step(2.0, 1.0)
        if decision is not None:
            made.append(decision)
    assert [d.action for d in made] == ["rebalance-microbatches", "resplit-stages"]
    assert lad.counts_in_force == [6, 2]
    return lad


def next_decision(lad: ladder.MitigationLadder) -> ladder.Decision:
    for _ in range(100):
        decision = lad.on_step(1.2, 1.0)
        if decision is not None:
            return decision
    raise AssertionError("no decision in 100 steps")


def test_when_s3_ends_its_way_back_down_restores_s2_counts_too() -> None:
    """S2 then S3 on one pipelined job; when the slowdown is over, S3's restore-even carries the
    even micro-batch counts as well, so no replica stays idle behind S2's counts."""
    lad = s2_then_s3()
    lad.shape = shape_of([0.1, 0.1, 0.1, 0.1])  # healthy again
    decision = next_decision(lad)
    assert decision.action == "restore-even"
    assert decision.plan["stageLayers"] == [2, 2] and decision.plan["microbatches"] == [4, 4]
    assert lad.level is None and lad.counts_in_force is None
    g = build_graph()
    remediation = policy.RemediationPolicy(Remediation.model_validate({"maxMitigation": "resplit"}))
    events = remediation._events_for(g, decision, ())
    assert [(e.data["key"], e.data["value"]) for e in events] == [
        ("stageLayers", [2, 2]), ("microbatches", [4, 4])]


def test_when_s3_ends_but_a_replica_is_still_slow_s2_holds_again() -> None:
    """Replica 1 slow in both its stages: the stages look balanced (S3's even split is best), but
    S2's counts still pay, so they stay, and the ladder is back on S2 (tracking them), not reset."""
    lad = s2_then_s3()
    lad.shape = shape_of([0.1, 0.1, 0.3, 0.3])
    decision = next_decision(lad)
    assert decision.action == "restore-even" and decision.plan["stageLayers"] == [2, 2]
    assert "microbatches" not in decision.plan and "S2's counts [6, 2] stay" in decision.reason
    assert lad.level is MitigationLevel.REBALANCE and lad.applied == {"microbatches": [6, 2]}
    g = build_graph()
    remediation = policy.RemediationPolicy(Remediation.model_validate({"maxMitigation": "resplit"}))
    assert [e.data["key"] for e in remediation._events_for(g, decision, ())] == ["stageLayers"]
    lad.shape = shape_of([0.1, 0.1, 0.1, 0.1])  # and once the replica recovers, S2 is undone
    decision = next_decision(lad)
    assert decision.action == "restore-even" and decision.plan["microbatches"] == [4, 4]
    assert lad.level is None


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_with_a_fixed_part_per_replica_is_the_brute_force_optimum(seed: int) -> None:
    """Both integer programs with each replica's fill and drain added: the makespan is the
    smallest of all plans, and among the plans that reach it the L1 spread is the smallest."""
    rng = random.Random(seed)
    n, total = rng.randint(2, 3), rng.randint(4, 9)
    times = [rng.uniform(0.05, 0.5) for _ in range(n)]
    fixed = [rng.uniform(0.0, 0.6) for _ in range(n)]
    plan = rebalance.rebalance_microbatches(times, total, fixed)
    plans = [c for c in itertools.product(range(1, total + 1), repeat=n) if sum(c) == total]
    best = min(rebalance.step_seconds(c, times, fixed) for c in plans)
    assert plan.makespan == pytest.approx(best, rel=1e-6)
    assert sum(plan.counts) == total and min(plan.counts) >= 1

    def spread(counts: tuple[int, ...]) -> float:
        loads = [c * t + f for c, t, f in zip(counts, times, fixed, strict=True)]
        return sum(abs(x - sum(loads) / n) for x in loads)

    tied = [c for c in plans if rebalance.step_seconds(c, times, fixed) <= best * (1 + 1e-9)]
    assert spread(plan.counts) == pytest.approx(min(spread(c) for c in tied), rel=1e-6, abs=1e-9)


def test_a_fixed_part_can_change_the_plan() -> None:
    """Replica 1 is 3× slower per micro-batch and its fill and drain add 0.25 s a step whatever
    its count: at 2 micro-batches it would take 0.85 s, so it gets one fewer than without."""
    without = rebalance.rebalance_microbatches([0.1, 0.3], 8)
    assert without.counts == (6, 2) and without.makespan == pytest.approx(0.6)
    with_fill = rebalance.rebalance_microbatches([0.1, 0.3], 8, [0.0, 0.25])
    assert with_fill.counts == (7, 1) and with_fill.makespan == pytest.approx(0.7)
    with pytest.raises(ValueError, match="fixed seconds"):
        rebalance.rebalance_microbatches([0.1, 0.3], 8, [0.1])
