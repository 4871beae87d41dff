"""Goodput = throughput × statistical efficiency, and the batch size and learning rate that go with it.

More replicas only help if the bigger batch they process still makes progress per sample. The
gradient noise scale φ (McCandlish et al.; Pollux calls it the preconditioned noise scale, and the
runtime reports it) says how far a batch can grow before it stops paying: with the job's initial
batch M0, one sample at batch M is worth

    E(M) = (φ + M0) / (φ + M)

of a sample at M0 (Pollux, OSDI 2021, eq. 5). Goodput counts M0-equivalent samples per second.

Learning rate follows the AdaScale gain rule (Johnson et al., ICML 2020). With per-sample gradient
variance σ² and squared gradient norm μ², φ = σ²/μ², and a step at scale S = M/M0 is worth

    r = (σ²/M0 + μ²) / (σ²/M + μ²) = S · E(M)

steps at M0, so the learning rate is multiplied by r (never by more than S, the linear rule). The
step count to a target then shrinks by r, which is exactly what goodput accounts for; so batch size
and learning rate always move together and a resize never silently changes the optimisation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchChoice:
    global_batch: float
    local_batch: float
    throughput: float  # samples per second
    efficiency: float  # E(M), in (0, 1] for M ≥ M0
    goodput: float  # M0-equivalent samples per second
    lr_scale: float  # AdaScale gain r: multiply the base learning rate by this


def efficiency(noise_scale: float | np.ndarray, base_batch: float, batch: float | np.ndarray) -> np.ndarray:
    """Pollux statistical efficiency of batch `batch` relative to `base_batch`."""
    if np.any(np.asarray(noise_scale) < 0):
        raise ValueError(f"noise_scale must be ≥ 0, got {noise_scale}")
    if base_batch <= 0:
        raise ValueError(f"base_batch must be > 0, got {base_batch}")
    return (np.asarray(noise_scale) + base_batch) / (np.asarray(noise_scale) + np.asarray(batch))


def adascale_gain(noise_scale: float, base_batch: float, batch: float) -> float:
    """AdaScale's r: how many M0-steps one step at `batch` is worth; the learning-rate multiplier."""
    return float(batch / base_batch * efficiency(noise_scale, base_batch, batch))


def candidate_local_batches(base_batch: float, replicas: int, max_local_batch: float) -> np.ndarray:
    """Local batches worth trying: the base batch split over replicas, then doublings up to memory.

    The global batch never drops below M0 (that would change the optimisation the user tuned),
    and a local batch above `max_local_batch` does not fit in memory.
    """
    low = max(1.0, base_batch / replicas)
    if low > max_local_batch:
        return np.array([], dtype=float)
    grid = low * 2.0 ** np.arange(0, 12)
    return np.unique(np.concatenate([grid[grid <= max_local_batch], [max_local_batch]]))


def choose_batch(
    throughput_of: Callable[[np.ndarray], np.ndarray],
    noise_scale: float,
    base_batch: float,
    replicas: int,
    max_local_batch: float,
) -> BatchChoice | None:
    """The batch (and learning-rate scale) that maximises goodput at `replicas`.

    `throughput_of(local_batches)` returns samples per second for each candidate local batch at
    this replica count, so one vectorised model call prices them all. None: even the smallest
    allowed local batch does not fit in memory.
    """
    local = candidate_local_batches(base_batch, replicas, max_local_batch)
    if local.size == 0:
        return None
    thr = np.asarray(throughput_of(local), dtype=float)
    global_batch = local * replicas
    eff = efficiency(noise_scale, base_batch, global_batch)
    good = thr * eff
    i = int(np.argmax(good))
    m = float(global_batch[i])
    return BatchChoice(m, float(local[i]), float(thr[i]), float(eff[i]), float(good[i]),
                       adascale_gain(noise_scale, base_batch, m))
