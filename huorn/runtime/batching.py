"""Batch size, micro-batch split and learning rate as functions of the world size and step.

Two rules, chosen by spec.optimization.batchRule:

- `fixed-global` (default): the global batch B stays the same whatever the world size; the
  B/m micro-batches of a step are dealt round-robin to the ranks, so gradient accumulation per
  rank is ceil(B/m / W) or one less. Loss, gradients and the data read are those of the
  uninterrupted run, and so is the learning rate.
- `scale-with-replicas`: each rank keeps the per-replica batch it had at minReplicas, so the
  global batch grows with the world: B(W) = B·W/minReplicas (rounded to whole micro-batches).
  The learning rate follows the square-root rule, lr(W) = lr·sqrt(B(W)/B), which keeps the
  variance of the update per sample constant for Adam-type optimisers (Malladi et al. 2022;
  Krizhevsky 2014 for SGD). The data of step s then has more micro-batches, still a pure
  function of (seed, s, index).
- `goodput` is decided by the scheduler, which writes a new globalBatch/learningRate into the
  spec; the trainer treats it as `fixed-global` for the values it is given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from huorn.api import training


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per forward pass
    micro_batches: int  # micro-batches per optimizer step (all ranks together)
    learning_rate: float  # peak learning rate for this world size


def replicas_in(world_size: int, ranks_per_replica: int) -> int:
    """Replicas (what elasticity.minReplicas counts: pods, or local agents) in a gang of
    `world_size` ranks. Under torchrun a replica runs LOCAL_WORLD_SIZE ranks (one per GPU, or one
    per pipeline stage); counted as ranks, a gang of 2 pods of 8 GPUs at minReplicas 2 took 8×
    its global batch and √8× its learning rate."""
    return max(1, world_size // max(1, ranks_per_replica))


def plan_batch(optimization: training.Optimization, min_replicas: int, world_size: int) -> BatchPlan:
    """`world_size` in replicas (replicas_in), as `min_replicas` is."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    micro = optimization.micro_batch
    base_micro_batches = optimization.global_batch // micro
    if optimization.batch_rule == training.BatchRule.SCALE_WITH_REPLICAS:
        micro_batches = max(1, round(base_micro_batches * world_size / max(min_replicas, 1)))
        scale = micro_batches / base_micro_batches
        peak = optimization.learning_rate * math.sqrt(scale)
        return BatchPlan(micro_batches * micro, micro, micro_batches, peak)
    return BatchPlan(optimization.global_batch, micro, base_micro_batches, optimization.learning_rate)


def learning_rate(step: int, total_steps: int, peak: float, warmup_steps: int,
                  schedule: training.LrSchedule) -> float:
    """Linear warm-up to `peak`, then constant, cosine or linear decay to 10% of peak at the end."""
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == training.LrSchedule.CONSTANT or total_steps <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = 0.1 * peak
    if schedule == training.LrSchedule.LINEAR:
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
