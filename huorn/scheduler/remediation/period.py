"""The iteration period of a job, recovered from its stream of collective calls (FALCON).

A training step issues the same sequence of collectives every iteration (the same all-reduce
buckets, the same pipeline sends), so the per-call signal (message size, or op type) is periodic
and its autocorrelation peaks at the number of calls per iteration. Knowing the period lets the
detector cut a raw collective log into iterations without any cooperation from the framework:
the iteration time is the distance between the starts of every period-th call.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def estimate_period(signal: Sequence[float], max_period: int | None = None) -> int:
    """Return the number of calls per iteration: the smallest lag whose autocorrelation is
    (within 5%) the highest, so that multiples of the true period do not win by noise."""
    x = np.asarray(signal, dtype=float)
    if x.ndim != 1 or len(x) < 4:
        raise ValueError("signal: need at least 4 collective calls to find a period")
    max_period = max_period or len(x) // 2
    max_period = min(max_period, len(x) // 2)
    x = x - x.mean()
    denom = float(np.dot(x, x))
    if denom == 0:
        return 1  # every call looks the same: each call is one iteration
    acf = np.array([np.dot(x[:-lag], x[lag:]) / denom * len(x) / (len(x) - lag)
                    for lag in range(1, max_period + 1)])
    best = float(acf.max())
    if best <= 0:
        raise ValueError("signal: no repeating pattern of collective calls was found")
    return int(np.flatnonzero(acf >= best - 0.05 * abs(best))[0]) + 1


def split_iterations(start_times: Sequence[float], period: int, phase: int = 0) -> np.ndarray:
    """Return iteration durations: the time between the starts of calls phase, phase+period, ..."""
    if period < 1:
        raise ValueError(f"period={period}: must be >= 1 call per iteration")
    starts = np.asarray(start_times, dtype=float)[phase::period]
    return np.diff(starts)


def iteration_times(start_times: Sequence[float], signal: Sequence[float]) -> np.ndarray:
    """Iteration durations from a raw collective log (start time and size of each call)."""
    return split_iterations(start_times, estimate_period(signal))
