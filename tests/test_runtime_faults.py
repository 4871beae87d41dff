"""Fault injection's slow-compute forms: once a step, per micro-batch, and per layer (a slower
device whose cost moves with the layers a pipeline stage holds, which S3 can win back)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from huorn import models
from huorn.runtime import config as run_config
from huorn.runtime import faults
from huorn.runtime.pipeline import split


def injector(tmp_path: Path, rank: int, **fault: object) -> faults.FaultInjector:
    spec = run_config.Fault.model_validate({"kind": "slow-compute", "ms": 40, **fault})
    return faults.FaultInjector([spec], tmp_path, rank=rank, replica=None)


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def test_per_layer_delay_follows_the_layers_a_stage_holds(tmp_path: Path) -> None:
    torch.manual_seed(0)
    decoder = models.build_model(models.ModelConfig(layers=4, width=16, heads=2, vocabulary=32, context=8))
    slow = injector(tmp_path, 0, perLayer=True)
    for layer in decoder.layers:  # as huorn.runtime.train.Trainer registers them
        layer.register_forward_pre_hook(lambda *_: slow.before_layer())
    one, three = split.split_decoder(decoder, 2, [1, 3])
    tokens = torch.randint(0, 32, (2, 8))
    with torch.no_grad():
        out = one(tokens)
        hidden = out if isinstance(out, tuple) else (out,)
        assert 0.04 <= timed(lambda: one(tokens)) < 0.04 + 0.08  # one layer: one delay
        assert timed(lambda: three(*hidden)) >= 3 * 0.04  # three layers: three delays
    assert timed(slow.before_compute) < 0.02  # and nothing once per step


def test_per_layer_delay_hits_only_its_rank_and_steps(tmp_path: Path) -> None:
    other = injector(tmp_path, rank=0, perLayer=True, fromStep=5)
    other.rank = 1
    assert timed(other.before_layer) < 0.02
    other.rank, other.step = 0, 4
    assert timed(other.before_layer) < 0.02
    other.step = 5
    assert timed(other.before_layer) >= 0.04


@pytest.mark.parametrize(("fault", "message"), [
    ({"perLayer": True, "perMicroBatch": True}, "exclude each other"),
    ({"kind": "slow-comm", "perLayer": True}, "slow-compute only"),
])
def test_contradictory_fault_forms_are_refused(fault: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        run_config.Fault.model_validate({"kind": "slow-compute", "ms": 10, **fault})
