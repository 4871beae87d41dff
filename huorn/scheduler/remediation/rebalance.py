"""S2 and S3 plans: rebalance micro-batches across data-parallel ranks, re-split pipeline stages.

S2 (FALCON) minimises Σ(N_i·t_i − mean)² with N_i ≥ 1 and Σ N_i = total. The square is not
linear, and what the job actually waits for is the slowest rank, so we solve the linear
program that matters first (minimise the makespan max_i N_i·t_i) and then, among the makespan-
optimal plans, minimise Σ|N_i·t_i − mean|: the L1 form of FALCON's objective, which breaks ties
towards the most even plan. Both stages are exact integer programs (scipy.optimize.milp/HiGHS).

A pipeline replica is a rank with a fixed cost on top: its step is N·t plus the fill and drain
of its pipeline (one micro-batch through its other stages), which do not shrink with N. Left
out, S2 predicted 0.054 s for a replica at one micro-batch that measured 0.122 s. So each rank
may carry `fixed` seconds a step, and both programs take N_i·t_i + fixed_i as its time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from scipy import optimize


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    counts: tuple[int, ...]  # micro-batches per data-parallel rank
    makespan: float  # predicted step time: max_i counts_i · t_i + fixed_i
    before: float  # the same with the even split the job ran with


def _check(times: Sequence[float], total: int) -> np.ndarray:
    t = np.asarray(times, dtype=float)
    if t.ndim != 1 or len(t) == 0 or not np.all(np.isfinite(t)) or np.any(t <= 0):
        raise ValueError("per-rank micro-batch times must be a non-empty list of positive numbers")
    if total < len(t):
        raise ValueError(f"total micro-batches ({total}) must be >= the number of ranks ({len(t)}): "
                         "each rank needs at least one")
    return t


def even_split(total: int, ranks: int) -> list[int]:
    """What the job does without S2: equal shares, the remainder to the first ranks."""
    return [total // ranks + (1 if i < total % ranks else 0) for i in range(ranks)]


def unit_seconds(counts: Sequence[int], times: Sequence[float],
                 fixed: Sequence[float] | None = None) -> list[float]:
    """Each rank's predicted seconds a step under `counts`: N_i·t_i + fixed_i."""
    extra = fixed if fixed is not None else [0.0] * len(times)
    return [float(c * t + f) for c, t, f in zip(counts, times, extra, strict=True)]


def step_seconds(counts: Sequence[int], times: Sequence[float],
                 fixed: Sequence[float] | None = None) -> float:
    """The predicted step time of `counts`: the slowest rank's N_i·t_i + fixed_i."""
    return max(unit_seconds(counts, times, fixed))


def stage_seconds(layers: Sequence[int], layer_costs: Sequence[float],
                  stage_speeds: Sequence[float]) -> list[float]:
    """Each pipeline stage's time per micro-batch (in layer-cost units) when it holds `layers[s]`
    consecutive layers."""
    starts = [sum(layers[:s]) for s in range(len(layers))]
    return [float(sum(layer_costs[a:a + n])) / speed
            for a, n, speed in zip(starts, layers, stage_speeds, strict=True)]


def worst_case_ratio(new: Sequence[float], old: Sequence[float], delta: float) -> float:
    """The largest max(new)/max(old) when each unit's true seconds may lie anywhere within ±delta
    (relative) of the measured ones, the same unit scaled alike under both plans.

    Why this and not a margin on the ratio: a unit's speed scales its seconds alike under both
    plans, so when one unit stays the slowest under both within the noise, their ratio is exact
    and the noise must not hide it ([5, 3] against [4, 4] on equal ranks is 1.25× whatever their
    speed, for any delta < 1/9). Only a change of the slowest unit needs the noise overcome.
    The maximum has a closed form: for the unit j that is slowest under `new`, its seconds are
    at their highest (the ratio never falls as they grow) and every other unit's at their lowest
    (they appear only in the denominator)."""
    if len(new) != len(old) or not new:
        raise ValueError(f"plans must price the same units: {len(new)} against {len(old)}")
    if not 0.0 <= delta < 1.0:
        raise ValueError(f"delta={delta}: a relative error must lie in [0, 1)")
    up, down = 1.0 + delta, 1.0 - delta
    worst = 0.0
    for j, seconds in enumerate(new):
        others = max((b * down for k, b in enumerate(old) if k != j), default=0.0)
        worst = max(worst, seconds * up / max(old[j] * up, others, 1e-12))
    return worst


def rebalance_microbatches(times: Sequence[float], total: int,
                           fixed: Sequence[float] | None = None) -> MicroBatchPlan:
    """Integer micro-batch counts for ranks that take `times[i]` seconds per micro-batch and
    `fixed[i]` seconds a step whatever their count (a pipeline's fill and drain; default 0)."""
    t = _check(times, total)
    n = len(t)
    o = np.zeros(n) if fixed is None else np.asarray(fixed, dtype=float)
    if o.shape != t.shape or not np.all(np.isfinite(o)) or np.any(o < 0):
        raise ValueError("fixed seconds must be one non-negative number per rank")
    integer = np.ones(n + 1)
    integer[-1] = 0
    bounds = optimize.Bounds(np.r_[np.ones(n), 0.0], np.r_[np.full(n, total), np.inf])
    # Stage 1, variables (N_1..N_n, z): minimise z subject to N_i·t_i + o_i − z ≤ 0, Σ N_i = total.
    rows = np.hstack([np.diag(t), -np.ones((n, 1))])
    constraints = [
        optimize.LinearConstraint(rows, -np.inf, -o),
        optimize.LinearConstraint(np.r_[np.ones(n), 0.0][None, :], total, total),
    ]
    objective = np.r_[np.zeros(n), 1.0]
    # NB: HiGHS stops within a 1e-4 relative gap by default, which let it keep counts (2, 7) at
    # 4.00002 s for times (2.00001, 0.5) when (1, 8) gives 4.0 s; the plan is meant to be exact.
    first = optimize.milp(objective, integrality=integer, bounds=bounds, constraints=constraints,
                          options={"mip_rel_gap": 0.0})
    if not first.success:
        raise RuntimeError(f"micro-batch rebalance found no plan: {first.message}")
    makespan = float(first.x[-1])
    # Stage 2, variables (N, d): minimise Σ d_i with d_i ≥ |N_i·t_i + o_i − mean|, makespan kept.
    mean_row = np.tile(t / n, (n, 1))  # mean = Σ_j (N_j·t_j + o_j) / n, linear in N
    dev = np.diag(t) - mean_row
    shift = o - o.mean()  # the constant part of N_i·t_i + o_i − mean
    eye = np.eye(n)
    constraints = [
        optimize.LinearConstraint(np.hstack([dev, -eye]), -np.inf, -shift),
        optimize.LinearConstraint(np.hstack([-dev, -eye]), -np.inf, shift),
        optimize.LinearConstraint(np.hstack([np.diag(t), np.zeros((n, n))]), -np.inf,
                                  makespan * (1 + 1e-9) - o),
        optimize.LinearConstraint(np.r_[np.ones(n), np.zeros(n)][None, :], total, total),
    ]
    second = optimize.milp(
        np.r_[np.zeros(n), np.ones(n)], integrality=np.r_[np.ones(n), np.zeros(n)],
        bounds=optimize.Bounds(np.r_[np.ones(n), np.zeros(n)], np.r_[np.full(n, total), np.full(n, np.inf)]),
        constraints=constraints, options={"mip_rel_gap": 0.0},
    )
    x = second.x[:n] if second.success else first.x[:n]
    counts = tuple(int(np.rint(v)) for v in x)
    return MicroBatchPlan(counts, step_seconds(counts, t.tolist(), o.tolist()),
                          step_seconds(even_split(total, n), t.tolist(), o.tolist()))


@dataclasses.dataclass(frozen=True)
class StagePlan:
    boundaries: tuple[int, ...]  # first layer of each stage; stage s runs layers [b_s, b_{s+1})
    makespan: float  # slowest stage's time per micro-batch
    before: float  # the same for an even split of the layers


def _stage_time(layer_costs: np.ndarray, lo: int, hi: int, speed: float) -> float:
    return float(layer_costs[lo:hi].sum()) / speed


def _even_boundaries(layers: int, stages: int) -> list[int]:
    sizes = even_split(layers, stages)
    return [int(v) for v in np.cumsum([0, *sizes[:-1]])]


def resplit_stages(layer_costs: Sequence[float], stage_speeds: Sequence[float]) -> StagePlan:
    """S3: contiguous layers per pipeline stage so that the slowest stage is as fast as possible.

    `stage_speeds[s]` is the relative speed of the rank(s) holding stage s (1.0 healthy, 0.5 a
    rank at half speed). Exact dynamic programme over split points, O(stages · layers²).
    """
    costs = np.asarray(layer_costs, dtype=float)
    speeds = np.asarray(stage_speeds, dtype=float)
    stages, layers = len(speeds), len(costs)
    if stages == 0 or layers < stages:
        raise ValueError(f"need at least one layer per stage: {layers} layers for {stages} stages")
    if np.any(costs <= 0) or np.any(speeds <= 0):
        raise ValueError("layer costs and stage speeds must be positive")
    best = np.full((stages + 1, layers + 1), np.inf)
    choice = np.zeros((stages + 1, layers + 1), dtype=int)
    best[0, 0] = 0.0
    for s in range(1, stages + 1):
        for end in range(s, layers - (stages - s) + 1):
            for start in range(s - 1, end):
                value = max(best[s - 1, start], _stage_time(costs, start, end, speeds[s - 1]))
                if value < best[s, end]:
                    best[s, end], choice[s, end] = value, start
    bounds, end = [], layers
    for s in range(stages, 0, -1):
        end = int(choice[s, end])
        bounds.append(end)
    boundaries = tuple(reversed(bounds))
    even = _even_boundaries(layers, stages)
    even_ends = [*even[1:], layers]
    before = max(_stage_time(costs, a, b, sp) for a, b, sp in zip(even, even_ends, speeds, strict=True))
    return StagePlan(boundaries, float(best[stages, layers]), float(before))
