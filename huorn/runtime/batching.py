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
- `goodput`: the allocator chooses the global batch M (at least globalBatch = M0, whole
  micro-batches) with the replicas, and the control plane hands it to the running gang through
  the run directory's `batch.json` (huorn.runtime.batch_control), applied at a step boundary.
  The learning rate follows the square-root rule as above, lr(M) = lr·sqrt(M/M0), and progress
  follows AdaScale: a step at M counts as r = (M/M0)·(φ+M0)/(φ+M) steps of M0 (φ the gradient
  noise scale the trainer measures; r = 1 before it has one), so a budget in steps is one in
  tokens of M0 (training.token_budget) that each step advances by r·M0·context, and the
  learning-rate schedule runs on that count. Until the first batch.json the trainer runs M0.

A budget in `tokens` (Budget) ends the run once the tokens trained reach it and schedules the
learning rate by those tokens, because the global batch, and so a step's tokens, may change
during the run: with the world under `scale-with-replicas`, and at a restart on an edited
globalBatch. A step count fixed from the spec's globalBatch trained a gang at W × minReplicas
replicas W times the budget, and warmed up and decayed W times faster per token.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

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


def plan_batch(optimization: training.Optimization, min_replicas: int, world_size: int,
               chosen: int | None = None) -> BatchPlan:
    """`world_size` in replicas (replicas_in), as `min_replicas` is; `chosen`: the allocator's
    global batch under batchRule goodput (ignored under the other rules, and None: M0)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    micro = optimization.micro_batch
    base_micro_batches = optimization.global_batch // micro
    if optimization.batch_rule == training.BatchRule.GOODPUT and chosen is not None:
        micro_batches = max(base_micro_batches, int(chosen) // micro)
        peak = optimization.learning_rate * math.sqrt(micro_batches / base_micro_batches)
        return BatchPlan(micro_batches * micro, micro, micro_batches, peak)
    if optimization.batch_rule == training.BatchRule.SCALE_WITH_REPLICAS:
        micro_batches = max(1, round(base_micro_batches * world_size / max(min_replicas, 1)))
        scale = micro_batches / base_micro_batches
        peak = optimization.learning_rate * math.sqrt(scale)
        return BatchPlan(micro_batches * micro, micro, micro_batches, peak)
    return BatchPlan(optimization.global_batch, micro, base_micro_batches, optimization.learning_rate)


def progress_tokens(optimization: training.Optimization, context: int, global_batch: int,
                    noise_scale: float | None) -> int:
    """The tokens one step at `global_batch` adds to the run's count (Budget, `tokens`): its
    own under fixed-global and scale-with-replicas, and for a budget given in tokens; under
    goodput with a budget in steps, AdaScale's r steps of the spec's globalBatch M0,
    r = (M/M0)·(φ+M0)/(φ+M), so a larger batch counts for the progress it makes, not for the
    samples it reads (r = 1 without a noise scale yet: never more than M0's)."""
    base = optimization.global_batch
    if (optimization.batch_rule != training.BatchRule.GOODPUT or optimization.steps is None
            or global_batch <= base):
        return global_batch * context  # a budget the user gave in tokens counts tokens read
    gain = 1.0
    if noise_scale is not None and math.isfinite(noise_scale) and noise_scale > 0:
        gain = global_batch / base * (noise_scale + base) / (noise_scale + global_batch)
    return round(gain * base * context)


def learning_rate(step: float, total_steps: float, peak: float, warmup_steps: int,
                  schedule: training.LrSchedule) -> float:
    """Linear warm-up to `peak`, then constant, cosine or linear decay to 10% of peak at the end.
    `step` and `total_steps` may be fractional: Budget passes tokens in steps of the spec's batch."""
    if warmup_steps and step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if schedule == training.LrSchedule.CONSTANT or total_steps <= warmup_steps:
        return peak
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = 0.1 * peak
    if schedule == training.LrSchedule.LINEAR:
        return peak - (peak - floor) * progress
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Budget:
    """When a run ends and where its learning-rate schedule stands, from the steps and the
    tokens trained so far (both survive checkpoints and resizes; the trainer keeps them with
    its state).

    In steps: the run ends after `steps` and the schedule counts steps, whatever the batch. In
    tokens: the run ends at the first step boundary with at least `tokens` trained (so it
    overshoots by less than one step's tokens), and the schedule counts tokens in units of
    `step_tokens`, the spec's globalBatch × context at the run's first start. warmupSteps then
    means that many steps at that globalBatch, and the learning rate at a given token count is the same at
    any world size (up to the batch rule's peak, lr·sqrt(B(W)/B) under scale-with-replicas).

    The unit is fixed at the run's first start and kept with the state (`meta`, `resumed`):
    a user may edit globalBatch, and a unit re-read at a restart would move the run's place in
    its warm-up (warmupSteps 100 at B=64, resumed at step 80 on B=256: 80·64/256 = 20 steps in,
    the rate from 0.81 to 0.21 of peak)."""

    META_KEY: ClassVar[str] = "schedule_step_tokens"

    steps: int | None  # the run ends after this many optimizer steps
    tokens: int | None  # or once this many tokens are trained (exactly one of the two is set)
    # tokens of one step at the spec's globalBatch when the run first started: the schedule's
    # unit in tokens, kept in checkpoint meta and in the in-place hand-over (resumed, META_KEY)
    step_tokens: int

    @classmethod
    def of(cls, spec: training.TrainingJobSpec, step_limit: int | None = None) -> Budget:
        """`step_limit` (the run config's stepLimit) overrides the spec's steps or tokens."""
        tokens = training.token_budget(spec) if step_limit is None else None
        steps = step_limit if step_limit is not None else (
            None if tokens is not None else training.declared_steps(spec))
        return cls(steps, tokens, spec.optimization.global_batch * spec.model.context)

    def meta(self) -> dict[str, int]:
        """What a checkpoint's meta (and the in-place hand-over) keeps of the budget."""
        return {self.META_KEY: self.step_tokens}

    def resumed(self, meta: Mapping[str, object]) -> Budget:
        """This budget with the schedule's unit the run's first start fixed, read from `meta`
        (a checkpoint's, or the state handed over in place). Meta written before the unit was
        kept has none: the unit stays the spec's globalBatch × context, as it was then."""
        stored = meta.get(self.META_KEY)
        if stored is None:
            return self
        if isinstance(stored, bool) or not isinstance(stored, int) or stored <= 0:
            raise ValueError(f"checkpoint meta {self.META_KEY} must be a positive integer (tokens of "
                             f"one step at the run's first globalBatch), got {stored!r}: the "
                             "checkpoint's huorn.json was damaged; restore it, or remove the key to "
                             "schedule in steps of the spec's globalBatch × context")
        return dataclasses.replace(self, step_tokens=stored)

    def reached(self, step: int, tokens: int) -> bool:
        """Whether a run `step` steps and `tokens` tokens in has trained all it should."""
        if self.tokens is not None:
            return tokens >= self.tokens
        assert self.steps is not None
        return step >= self.steps

    def learning_rate(self, step: int, tokens: int, peak: float,
                      optimization: training.Optimization) -> float:
        """The rate of the step that starts `step` steps and `tokens` tokens in; `peak`: the
        batch rule's for the gang's size (plan_batch)."""
        warmup, schedule = optimization.warmup_steps, optimization.schedule
        if self.tokens is None:
            assert self.steps is not None
            return learning_rate(step, self.steps, peak, warmup, schedule)
        return learning_rate(tokens / self.step_tokens, self.tokens / self.step_tokens, peak, warmup,
                             schedule)
