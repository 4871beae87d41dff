"""S2/S3 compare plans beyond the measured noise, not by a fixed margin: a plan is faster only if
it is faster for every speed within the shape's uncertainty of the measured ones. On a loaded
host a fixed 10 % let noise between near-equal ranks pay re-plan after re-plan; a margin scaled
to the noise would have kept a recovered rank at [5, 3], 25 % slower than even."""

from __future__ import annotations

import random

import pytest
import remediation_support
from hypothesis import given, settings
from hypothesis import strategies as st
from remediation_support import Seen

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import Remediation
from huorn.scheduler.remediation import ladder, policy, rebalance

SLOW = remediation_support.SLOW
GRAPH, noisy_gang = remediation_support.GRAPH, remediation_support.noisy_gang


def test_the_same_slowest_unit_makes_the_ratio_exact_whatever_the_noise() -> None:
    old = rebalance.unit_seconds([5, 3], [1.0, 1.0])
    new = rebalance.unit_seconds([4, 4], [1.0, 1.0])
    for delta in (0.0, 0.1, 0.2):
        assert rebalance.worst_case_ratio(new, old, delta) == pytest.approx(
            max(0.8, 4 * (1 + delta) / (5 * (1 - delta))))
    # 5 against 4 on the same rank stays 0.8 for any delta < 1/9
    assert rebalance.worst_case_ratio(new, old, 0.1) < 1.0
    # when the slowest unit moves, the noise counts on both sides: [3, 5] against [4, 4] on
    # ranks 22 % apart looks 2.5 % faster, and is not faster once each rank may be 5 % off
    even = rebalance.unit_seconds([4, 4], [1.0, 0.78])
    moved = rebalance.unit_seconds([3, 5], [1.0, 0.78])
    assert max(moved) / max(even) < 1.0
    assert rebalance.worst_case_ratio(moved, even, 0.05) > 1.0
    assert rebalance.worst_case_ratio(moved, even, 0.0) == pytest.approx(max(moved) / max(even))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=2, max_size=5), st.floats(0.0, 0.4),
       st.integers(0, 10_000))
def test_no_speeds_within_delta_give_a_worse_ratio_and_the_bound_is_reached(
        times: list[float], delta: float, seed: int) -> None:
    rng = random.Random(seed)
    n = len(times)
    old = [rng.randint(1, 6) * t for t in times]
    new = [rng.randint(1, 6) * t for t in times]
    bound = rebalance.worst_case_ratio(new, old, delta)
    for _ in range(50):
        factors = [rng.uniform(1 - delta, 1 + delta) for _ in range(n)]
        ratio = max(a * f for a, f in zip(new, factors, strict=True)) / \
            max(b * f for b, f in zip(old, factors, strict=True))
        assert ratio <= bound * (1 + 1e-9)
    # the closed form's own worst case: one unit at its slowest, the others at their fastest
    reached = max(
        max(a * (1 + delta if k == j else 1 - delta) for k, a in enumerate(new))
        / max(b * (1 + delta if k == j else 1 - delta) for k, b in enumerate(old))
        for j in range(n))
    assert reached == pytest.approx(bound)


@pytest.mark.parametrize("delta", [-0.1, 1.0])
def test_a_delta_outside_zero_to_one_is_refused(delta: float) -> None:
    with pytest.raises(ValueError, match="delta"):
        rebalance.worst_case_ratio([1.0], [1.0], delta)


on_s2 = remediation_support.climb_to_s2


def run_steps(lad: ladder.MitigationLadder, shapes: list[list[float]], noise: float,
              steps: int = 400) -> list[ladder.Decision]:
    decisions = []
    for step in range(steps):
        lad.shape = ladder.JobShape(microbatch_seconds=shapes[step % len(shapes)], total_microbatches=8,
                                    noise=noise)
        decision = lad.on_step(1.2, 1.0)
        if decision is not None:
            decisions.append(decision)
    return decisions


def test_a_recovered_rank_at_five_three_goes_back_to_even_through_heavy_noise() -> None:
    lad = on_s2([0.1, 0.16], noise=0.0)
    assert lad.applied is not None and lad.applied["microbatches"] == [5, 3]
    # rank 1 recovered; the measured speeds now differ by up to 15 % from tick to tick, and the
    # policy measures 20 % uncertainty: capped at MAX_DELTA, 5 micro-batches against 4 still count
    decisions = run_steps(lad, [[0.1, 0.1], [0.11, 0.1], [0.1, 0.115]], noise=0.2)
    assert lad.delta() == ladder.MitigationLadder.MAX_DELTA
    assert [d.action for d in decisions] == ["restore-even"], decisions
    assert decisions[0].plan["microbatches"] == [4, 4] and lad.level is None


def test_noise_between_near_equal_ranks_does_not_flap_the_counts() -> None:
    """Healthy ranks whose 5-step medians swing 45 % apart, either way, from tick to tick (the
    real job that flapped showed swings of 15-20 % and outliers beyond): with the uncertainty
    the policy measures on such windows the ladder keeps the even split."""
    swings = [[2.0, 2.9], [2.9, 2.0]]
    lad = on_s2([2.0, 8.0], noise=0.0)
    restored = run_steps(lad, [[2.0, 2.0]], noise=0.0, steps=40)
    assert [d.action for d in restored] == ["restore-even"]
    lad.on_fail_slow(SLOW, [1])  # a blip found again: S2 is passed (even is best), then priced
    quiet = run_steps(lad, swings, noise=0.12)
    assert all(d.action.startswith("skip-") for d in quiet), quiet
    assert lad.applied is not None and lad.applied["microbatches"] == [4, 4]


def test_without_measured_noise_the_same_swings_re_plan() -> None:
    """The failure the uncertainty prevents: [5, 3] and [3, 5] look 16 % faster than even on
    alternate ticks, which the fixed 10 % margin (and MIN_DELTA alone) let through."""
    lad = on_s2([2.0, 8.0], noise=0.0)
    run_steps(lad, [[2.0, 2.0]], noise=0.0, steps=40)
    lad.on_fail_slow(SLOW, [1])
    noisy = run_steps(lad, [[2.0, 2.9], [2.9, 2.0]], noise=0.0)
    counts = [d.plan["microbatches"] for d in noisy if "microbatches" in d.plan]
    assert [5, 3] in counts and [3, 5] in counts, noisy


def test_the_policy_measures_each_ranks_uncertainty() -> None:
    steady = {"rank": 0, "world_size": 2, "parameters": {"micro_batches": {"total": 8, "mine": 4}},
              "steps": [{"compute_seconds": 0.4, "comm_seconds": 0.0} for _ in range(policy.SHAPE_WINDOW)]}
    noisy = {**steady, "rank": 1,
             "steps": [{"compute_seconds": c, "comm_seconds": 0.0} for c in (0.3, 0.4, 0.5, 0.4, 0.45)]}
    shape = policy.build_shape({"a": steady, "b": noisy})
    assert shape is not None and shape.microbatch_seconds == pytest.approx([0.1, 0.1])
    # MAD 0.05 of a median 0.4 → σ ≈ 0.185 relative; the median of 5: 1.2533 σ / √5 ≈ 0.104
    assert shape.noise == pytest.approx(1.2533 * 1.4826 * 0.05 / 0.4 / 5 ** 0.5)
    assert policy.build_shape({"a": steady, "b": {**steady, "rank": 1}}).noise == 0.0  # type: ignore[union-attr]


def ticks_until_restored(monkeypatch: pytest.MonkeyPatch, window: int, seed: int) -> int | None:
    """A recovered rank 1 left at [5, 3], measured 7 % slower than rank 0 through 18 % jitter a
    step (a 5-step median's uncertainty ~0.1, as on the loaded host where the real test flaked),
    with a rung of 4 s (40 steps of the 0.1 s [4, 4] saves): the step at which the policy restores
    the even split, fed one tick every 5 steps, pooling at most `window` steps."""
    monkeypatch.setattr(policy, "EVIDENCE_WINDOW", window)
    remediation = policy.RemediationPolicy(Remediation.model_validate({"maxMitigation": "rebalance"}))
    remediation.ladder = remediation_support.climb_to_s2([0.1, 0.16])
    remediation.ladder.costs = ladder.LadderCosts(rebalance=4.0)
    assert remediation.ladder.applied is not None and remediation.ladder.applied["microbatches"] == [5, 3]
    remediation._last_step = SLOW.onset_iteration
    for last in range(SLOW.onset_iteration + 5, 400, 5):
        snaps = noisy_gang(last, [5, 3], [0.1, 0.107], jitter=0.18, seed=seed)
        remediation.decide(GRAPH, Seen(time=0.0, telemetry=snaps))
        if any(d.action == "restore-even" for d in remediation.decisions):
            return last
    return None


@pytest.mark.parametrize("seed", range(4))
def test_pooled_evidence_brings_a_recovered_rank_back_to_even_sooner(
        monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """The real-job flake (test_remediation_replan.py): judged one 5-step window at a time, only
    the windows whose noise happened to be small counted, and the even split came back late;
    pooled over the steps since the plan settled, most ticks count."""
    pooled = ticks_until_restored(monkeypatch, policy.EVIDENCE_WINDOW, seed)
    window_by_window = ticks_until_restored(monkeypatch, policy.SHAPE_WINDOW, seed)
    # 8 steps to settle, 40 of saving at the least: ~50 steps after the plan, 100 at most
    assert pooled is not None and pooled <= SLOW.onset_iteration + 120, pooled
    assert window_by_window is None or window_by_window > pooled, (pooled, window_by_window)


def test_the_window_grows_with_the_steps_on_the_plan_and_stops_at_its_cap() -> None:
    lad = remediation_support.climb_to_s2([0.1, 0.16])
    assert lad.settled_steps() == 0
    for _ in range(ladder.MitigationLadder.SETTLE_STEPS + 12):
        lad.on_step(1.0, 1.0)
    assert lad.settled_steps() == 12
    snaps = noisy_gang(100, [5, 3], [0.1, 0.1], jitter=0.18, seed=0)
    narrow, wide = policy.build_shape(snaps, policy.SHAPE_WINDOW), policy.build_shape(snaps, 20)
    assert narrow is not None and wide is not None
    # 20 steps' median is 2x as certain as 5 steps' (within what the drawn jitter allows)
    assert wide.noise < 0.8 * narrow.noise, (wide.noise, narrow.noise)
