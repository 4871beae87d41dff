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
    """Return the number of calls per iteration.

    The autocorrelation is taken in its squared-difference form, D(p) = mean((x_{i+p} − x_i)²) /
    var(x) = 2(1 − ρ(p)) for a stationary signal, which unlike the sliding-sum estimate has no
    bias from the ends of the window. D is zero at the true period and at its multiples, so the
    smallest lag within noise (2× the minimum) of the minimum wins; a nearly repeating
    sub-pattern (sizes 4, 16, 4, 17) is not mistaken for the period.
    """
    x = np.asarray(signal, dtype=float)
    if x.ndim != 1 or len(x) < 4:
        raise ValueError("signal: need at least 4 collective calls to find a period")
    max_period = min(max_period or len(x) // 3, len(x) // 2)  # long lags have too few pairs
    var = float(x.var())
    if var == 0:
        return 1  # every call looks the same: each call is one iteration
    diff = np.array([np.mean((x[lag:] - x[:-lag]) ** 2) / var for lag in range(1, max_period + 1)])
    if float(diff.min()) >= 1.0:
        raise ValueError("signal: no repeating pattern of collective calls was found")
    return int(np.flatnonzero(diff <= 2.0 * float(diff.min()) + 1e-9)[0]) + 1


def split_iterations(start_times: Sequence[float], period: int, phase: int = 0) -> np.ndarray:
    """Return iteration durations: the time between the starts of calls phase, phase+period, ..."""
    if period < 1:
        raise ValueError(f"period={period}: must be >= 1 call per iteration")
    starts = np.asarray(start_times, dtype=float)[phase::period]
    return np.diff(starts)


def iteration_times(start_times: Sequence[float], signal: Sequence[float]) -> np.ndarray:
    """Iteration durations from a raw collective log (start time and size of each call)."""
    return split_iterations(start_times, estimate_period(signal))
