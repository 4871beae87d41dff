"""CUDA-graphed stages (huorn.runtime.pipeline.graphs): the checks that decide, before any
capture, whether a stage may replay graphs. The replay itself needs a GPU
(tests/test_pipeline_gpu.py); on CPU the executor falls back to eager
(tests/test_pipeline_correctness.py)."""

from __future__ import annotations

import pytest
import torch

from huorn import models
from huorn.runtime.pipeline import graphs, schedules, split


def stage_of(cfg: models.ModelConfig, index: int) -> split.DecoderStage:
    return split.split_decoder(models.build_model(cfg), 2)[index]


def test_a_dense_stage_has_no_blocker_and_an_moe_stage_names_its_layer() -> None:
    dense = models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8)
    assert graphs.graph_blocker(stage_of(dense, 0)) is None
    moe = models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8,
                              moe=models.config.MoEConfig(experts=4))
    reason = graphs.graph_blocker(stage_of(moe, 1))
    assert reason is not None and "mixture of experts" in reason and "blocks.0" in reason


def test_graphed_stage_refuses_a_cpu_stage_naming_the_devices() -> None:
    cfg = models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8)
    with pytest.raises(graphs.GraphUnavailable, match=r"one CUDA device.*cpu"):
        graphs.GraphedStage(stage_of(cfg, 0), None, [torch.zeros(2, 8, dtype=torch.long)], max_slots=4)


def test_max_slots_must_be_positive() -> None:
    cfg = models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8)
    with pytest.raises(ValueError, match="max_slots"):
        graphs.GraphedStage(stage_of(cfg, 0), None, [torch.zeros(2, 8, dtype=torch.long)], max_slots=0)


@pytest.mark.parametrize(("name", "k", "slots"), [("1f1b", 1, 2), ("kfkb", 2, 4), ("gpipe", 1, 8)])
def test_slots_needed_are_the_tables_in_flight_micro_batches(name: str, k: int, slots: int) -> None:
    """Each in-flight micro-batch needs its own graphs, so the slot count is the memory model's
    in-flight count: GPipe with 8 micro-batches needs 8 on every stage, over the default cap."""
    table = schedules.build_schedule(name, 2, 8, k)
    assert schedules.count_in_flight(table)[0] == slots
    assert schedules.count_in_flight(table)[1] <= slots
