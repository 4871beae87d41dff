"""A budget in `optimization.tokens`: the run ends once the tokens trained reach it, and the
learning rate follows those tokens, whatever the global batch did meanwhile (batchRule
scale-with-replicas grows it with the world; an edited globalBatch changes it at a restart).

The loops below replay the trainer's per-step bookkeeping (huorn.runtime.train.Trainer.advance:
the batch rule's plan for the gang's size, Budget.learning_rate before the step, the step's
global batch × context added after it, Budget.reached to stop), and one short real run checks
that the trainer does the same across a checkpoint."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import runtime_harness as harness

from huorn.api import training
from huorn.runtime import batching, checkpoint, train

CONTEXT = 128
BATCH = 16  # the spec's globalBatch, at minReplicas 1
TOKENS = BATCH * CONTEXT * 100  # 100 steps at the spec's batch


def _spec(tokens: int | None = TOKENS, rule: str = "scale-with-replicas",
          **optimization: object) -> training.TrainingJobSpec:
    return training.TrainingJobSpec.model_validate({
        "virtualCluster": "local",
        "elasticity": {"minReplicas": 1, "maxReplicas": 4},
        "model": {"layers": 2, "width": 32, "heads": 2, "context": CONTEXT},
        "optimization": {"globalBatch": BATCH, "microBatch": 4, "tokens": tokens, "batchRule": rule,
                         "learningRate": 1e-3, "warmupSteps": 10, **optimization},
    })


@dataclass(frozen=True)
class Step:
    tokens_before: int
    global_batch: int
    lr: float
    peak: float  # the batch rule's peak for the gang's size


def _train(spec: training.TrainingJobSpec, world_at: Callable[[int], int]) -> list[Step]:
    """The trainer's loop, world size `world_at(step)` (replicas) at each step."""
    budget = batching.Budget.of(spec)
    step, tokens, steps = 0, 0, []
    while not budget.reached(step, tokens):
        plan = batching.plan_batch(spec.optimization, spec.elasticity.min_replicas, world_at(step))
        lr = budget.learning_rate(step, tokens, plan.learning_rate, spec.optimization)
        steps.append(Step(tokens, plan.global_batch, lr, plan.learning_rate))
        step, tokens = step + 1, tokens + plan.global_batch * spec.model.context
        assert step < 10_000, "the run never ends"
    return steps


@pytest.mark.parametrize("tokens", [TOKENS, TOKENS + 1, TOKENS - 1, BATCH * CONTEXT * 3 // 2])
def test_a_one_to_two_replica_resize_trains_the_budget_and_less_than_a_step_more(tokens: int) -> None:
    spec = _spec(tokens)
    steps = _train(spec, lambda step: 1 if step < 30 else 2)
    trained = [s.global_batch * CONTEXT for s in steps]
    assert tokens <= sum(trained) < tokens + trained[-1]
    if tokens >= TOKENS - 1:
        assert {s.global_batch for s in steps} == {BATCH, 2 * BATCH}  # the resize happened mid-run
        # 30 steps of 16, then what is left at 32 a step (the spec's 100 steps trained 2× the budget)
        assert len(steps) == 30 + math.ceil((tokens - 30 * BATCH * CONTEXT) / (2 * BATCH * CONTEXT))


def test_at_any_fixed_world_the_run_trains_the_budget() -> None:
    for world in (1, 2, 4):
        steps = _train(_spec(), lambda _step, world=world: world)
        assert sum(s.global_batch for s in steps) * CONTEXT == TOKENS  # 100 / world steps of 16·world
        assert len(steps) == 100 // world


def test_the_learning_rate_at_a_token_count_is_the_same_at_any_world_size() -> None:
    """The schedule (warm-up, decay) by tokens; the peak is the batch rule's, √(B(W)/B)·lr."""
    spec = _spec()
    runs = {"world 1": _train(spec, lambda _: 1), "world 2": _train(spec, lambda _: 2),
            "world 4": _train(spec, lambda _: 4),
            "1 → 2 at step 30": _train(spec, lambda step: 1 if step < 30 else 2),
            "2 → 1 at step 7": _train(spec, lambda step: 2 if step < 7 else 1)}
    reference = {s.tokens_before: s.lr / s.peak for s in runs["world 1"]}
    for name, steps in runs.items():
        for s in steps:
            assert s.lr / s.peak == pytest.approx(reference[s.tokens_before], rel=1e-12), (name, s)
    world2 = {s.tokens_before: s for s in runs["world 2"]}
    for s in runs["world 1"]:
        if s.tokens_before in world2:
            assert world2[s.tokens_before].lr == pytest.approx(math.sqrt(2) * s.lr, rel=1e-12)
    # warm-up spans warmupSteps steps of the spec's batch: 10 at world 1, 5 at world 2
    assert [round(s.lr / s.peak, 6) for s in runs["world 2"][:6]] == [0.1, 0.3, 0.5, 0.7, 0.9, 1.0]
    # and the decay ends at the budget in tokens, not in steps: the last step is near the floor
    assert runs["world 4"][-1].lr / runs["world 4"][-1].peak < 0.11


def test_at_the_specs_batch_a_token_budget_schedules_as_the_same_budget_in_steps() -> None:
    """At the spec's globalBatch (fixed-global, or scale-with-replicas at minReplicas) nothing
    changes: the run ends at tokens / (globalBatch × context) steps with the step schedule's rates."""
    by_tokens = _spec(rule="fixed-global")
    by_steps = batching.Budget.of(_spec(rule="fixed-global", steps=100, tokens=None))
    assert by_steps.steps == training.declared_steps(by_tokens) == 100
    steps = _train(by_tokens, lambda step: 1 + step % 3)
    assert len(steps) == 100
    for i, s in enumerate(steps):
        assert s.lr == pytest.approx(by_steps.learning_rate(i, 0, 1e-3, by_tokens.optimization), rel=1e-12)


def test_step_limit_overrides_the_token_budget() -> None:
    budget = batching.Budget.of(_spec(), step_limit=3)
    assert (budget.steps, budget.tokens) == (3, None)
    assert budget.reached(3, 0) and not budget.reached(2, 10 * TOKENS)
    assert training.token_budget(_spec(steps=5)) is None  # steps win when both are set


def test_a_checkpoint_from_before_tokens_were_recorded_counts_its_steps_at_its_batch() -> None:
    spec = _spec()
    assert train.tokens_in({"step": 7, "global_batch": 32, "tokens": 999}, spec) == 999
    assert train.tokens_in({"step": 7, "global_batch": 32}, spec) == 7 * 32 * CONTEXT
    assert train.tokens_in({"step": 7}, spec) == 7 * BATCH * CONTEXT


def _goodput_spec(global_batch: int) -> training.TrainingJobSpec:
    """The reviewer's run: warmupSteps 100 at globalBatch 64, a budget of 1000 such steps; the
    scheduler (batchRule goodput) or a user may rewrite globalBatch between starts."""
    return _spec(BATCH_64_TOKENS * 1000, rule="goodput", globalBatch=global_batch, microBatch=8,
                 warmupSteps=100)


BATCH_64_TOKENS = 64 * CONTEXT  # one step's tokens at the first start's globalBatch


def test_a_warm_up_resumed_on_an_edited_batch_keeps_its_place_from_the_checkpoint_meta() -> None:
    """Started at B=64, checkpointed at step 80, restarted on B=256: the budget built from the
    edited spec and the checkpoint's meta gives the rate of the unedited run at every token
    count (warm-up and decay). Before, the unit was re-read from the spec at the restart: 80·64/256
    = 20 steps into the warm-up, the rate fell from 0.81 to 0.21 of peak."""
    first = batching.Budget.of(_goodput_spec(64))
    meta = {"step": 80, "global_batch": 64, "tokens": 80 * BATCH_64_TOKENS, **first.meta()}
    assert json.loads(json.dumps(meta)) == meta  # what huorn.json keeps
    edited = _goodput_spec(256)
    resumed = batching.Budget.of(edited).resumed(meta)
    tokens = train.tokens_in(meta, edited)
    assert resumed.learning_rate(80, tokens, 1.0, edited.optimization) == pytest.approx(0.81, rel=1e-12)
    for trained in [tokens + i * 256 * CONTEXT for i in range(0, 260, 7)]:  # to the budget's end
        assert resumed.learning_rate(80, trained, 1.0, edited.optimization) == pytest.approx(
            first.learning_rate(80, trained, 1.0, edited.optimization), rel=1e-12), trained
    # and the run ends at the same tokens
    assert resumed.tokens == first.tokens


def test_checkpoint_meta_from_before_the_unit_was_kept_schedules_by_the_specs_batch() -> None:
    """A checkpoint written before the unit was stored has no value: the budget stays the one of
    the spec at hand (the behaviour before), here 20 steps of 256 into the warm-up."""
    edited = _goodput_spec(256)
    old_meta = {"step": 80, "global_batch": 64, "tokens": 80 * BATCH_64_TOKENS}
    resumed = batching.Budget.of(edited).resumed(old_meta)
    assert resumed == batching.Budget.of(edited)
    assert resumed.step_tokens == 256 * CONTEXT
    assert resumed.learning_rate(80, 80 * BATCH_64_TOKENS, 1.0, edited.optimization) == \
        pytest.approx(0.21, rel=1e-12)


@pytest.mark.parametrize("stored", [0, -128, "8192", 1.5, True])
def test_a_damaged_schedule_unit_in_checkpoint_meta_is_refused_by_name(stored: object) -> None:
    with pytest.raises(ValueError, match=batching.Budget.META_KEY):
        batching.Budget.of(_goodput_spec(256)).resumed({batching.Budget.META_KEY: stored})


def test_a_token_budget_resumed_on_a_doubled_batch_stops_at_its_tokens(tmp_path: Path) -> None:
    """A real trainer (one process, CPU): 3 steps at globalBatch 4, checkpoint, then a restart on
    globalBatch 8 (what a resize under scale-with-replicas, or an edited spec, does). The tokens
    trained before the restart come back from the checkpoint, so the second run trains the rest of
    the budget, not the steps the new batch would take from zero (before: ceil(1024 / 256) = 4,
    one step after the resume, 640 tokens of 1024)."""
    data_dir = harness.shared_data_dir()
    context = 32  # harness.build_spec's
    budget = 4 * context * 8  # 8 steps at the first batch
    first = harness.build_spec(steps=None, interval_steps=None, global_batch=4, micro_batch=2,
                               tokens=budget)
    del first["optimization"]["steps"]
    config = harness.write_config(tmp_path, data_dir, first, stepLimit=3)
    assert harness.start_trainer(config, tmp_path / "train.log").wait(timeout=120) == 0, \
        (tmp_path / "train.log").read_text()[-3000:]
    second = json.loads(json.dumps(first))
    second["optimization"]["globalBatch"] = 8
    config = harness.write_config(tmp_path, data_dir, second)
    assert harness.start_trainer(config, tmp_path / "train.log").wait(timeout=120) == 0, \
        (tmp_path / "train.log").read_text()[-3000:]

    attempts = harness.split_attempts(harness.read_events(tmp_path / "run"))
    assert [a["start"]["global_batch"] for a in attempts] == [4, 8]
    trained = [a["start"]["global_batch"] * context * len(a["steps"]) for a in attempts]
    assert trained[0] == 3 * 4 * context
    assert budget <= sum(trained) < budget + 8 * context
    assert [s["tokens"] for a in attempts for s in a["steps"]] == [128, 256, 384, 640, 896, 1152]
    latest = checkpoint.find_latest(tmp_path / "ckpt")
    assert latest is not None and checkpoint.read_meta(latest)["tokens"] == 1152
    # the schedule's unit the first start fixed (globalBatch 4 × context) is kept in the meta
    assert checkpoint.read_meta(latest)[batching.Budget.META_KEY] == 4 * context
    # the rate of the first step after the restart is the schedule's at the 384 tokens trained,
    # in units of the first start's globalBatch × context: 3 steps, the warm-up's end (before,
    # the new globalBatch's: 1.5 of warmupSteps' 3, 0.83 of the rate)
    spec = training.TrainingJobSpec.model_validate(second)
    expected = batching.learning_rate(384 / (4 * context), budget / (4 * context), 0.003, 3,
                                      spec.optimization.schedule)
    assert attempts[1]["steps"][0]["lr"] == pytest.approx(expected, rel=1e-9)
    unedited = batching.Budget.of(training.TrainingJobSpec.model_validate(first))
    assert [s["lr"] for s in attempts[1]["steps"]] == pytest.approx(
        [unedited.learning_rate(0, s["tokens"] - 8 * context, 0.003, spec.optimization)
         for s in attempts[1]["steps"]], rel=1e-9)


# One member of a world of two (gloo, no torchrun), as an in-place resize from one replica to two
# forms it: rank 0 holds the gang's state at step 5 after 5 steps of 16 and 5 of 32 sequences;
# rank 1 joins holding nothing. Rank 0's run first started at globalBatch 4 (its schedule's unit
# 4 × context); the joiner's spec says another globalBatch (goodput, or an edit).
_MEMBER = """
import dataclasses, json, os, sys
from pathlib import Path
from huorn.runtime import config, train

trainer = train.Trainer(config.load_run_config(Path(sys.argv[1])))
if trainer.rank == 0:
    trainer.has_state, held, trainer.tokens = True, 10, (5 * 16 + 5 * 32) * 32
    trainer.budget = dataclasses.replace(trainer.budget, step_tokens=4 * 32)
else:
    held = 0
step = trainer.share_state(held)
print(json.dumps({"step": step, "tokens": trainer.tokens, "unit": trainer.budget.step_tokens}),
      flush=True)
os._exit(0)
"""


def test_a_replica_joining_in_place_takes_the_tokens_trained_with_the_state(tmp_path: Path) -> None:
    """Before, the state handed over in place carried the step alone; the joiner's own count
    then restarted from its start value and the two ranks disagreed on when the budget ends. The
    schedule's unit comes with it: before, the joiner took its own spec's, and the two ranks set
    different learning rates at the same step."""
    spec = harness.build_spec(steps=None, tokens=10**6)
    del spec["optimization"]["steps"]
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec, collectiveTimeoutS=30)
    outputs = harness.run_members(_MEMBER, config)
    results = []
    for out, err in outputs:
        lines = out.strip().splitlines()
        assert lines, err[-2000:]
        results.append(json.loads(lines[-1]))
    assert spec["optimization"]["globalBatch"] != 4
    assert results == [{"step": 10, "tokens": 240 * 32, "unit": 4 * 32}] * 2
