"""Gradient noise scale from gradient norms measured at two batch sizes (McCandlish et al. 2018,
appendix A; the statistic Pollux turns into statistical efficiency).

Data parallelism gives both sizes for free: each rank's gradient before the all-reduce is a
small-batch estimate (B_small sequences), the reduced gradient a big-batch one (B_big). With
E|G_B|² = |G|² + tr(Σ)/B, two equations give unbiased estimates

    |G|²  = (B_big·|G_big|² − B_small·|G_small|²) / (B_big − B_small)
    S     = (|G_small|² − |G_big|²) / (1/B_small − 1/B_big)

and B_noise = S / |G|². Each estimate is very noisy, so (as the paper advises) the numerator and
denominator are smoothed separately with an exponential moving average before dividing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def estimate_components(small_sq: float, big_sq: float, b_small: float, b_big: float) -> tuple[float, float]:
    """Unbiased (|G|², tr Σ) from squared norms at two batch sizes; needs b_big > b_small > 0."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got b_small={b_small}, b_big={b_big}")
    true_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1.0 / b_small - 1.0 / b_big)
    return true_sq, trace


@dataclass
class NoiseScale:
    """EMA-smoothed B_noise; `value` is None until both smoothed parts are positive."""

    decay: float = 0.9
    true_sq: float | None = None
    trace: float | None = None

    def update(self, small_sq: float, big_sq: float, b_small: float, b_big: float) -> float | None:
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)) or b_small >= b_big:
            return self.value
        true_sq, trace = estimate_components(small_sq, big_sq, b_small, b_big)
        if self.true_sq is None or self.trace is None:
            self.true_sq, self.trace = true_sq, trace
        else:
            self.true_sq = self.decay * self.true_sq + (1 - self.decay) * true_sq
            self.trace = self.decay * self.trace + (1 - self.decay) * trace
        return self.value

    @property
    def value(self) -> float | None:
        if self.true_sq is None or self.trace is None or self.true_sq <= 0 or self.trace <= 0:
            return None
        return self.trace / self.true_sq
