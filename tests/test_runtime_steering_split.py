"""The held-out tokens that steer training (DDK's reweighting, D-CPT's probes) and those the
evaluation reads are disjoint: one split served both, so the weights were chosen on the very
windows the validation loss and the evaluator then reported."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import runtime_harness as harness
import torch

from huorn.runtime import config as run_config
from huorn.runtime import mixture_plan
from huorn.runtime.data import sampler


def _positions(length: int) -> sampler.Source:
    """A source whose every token is its own position, so a window says where it was drawn."""
    return sampler.Source("pos", 1.0, np.arange(length, dtype=np.int64), np.arange(length, dtype=np.int64))


def test_steering_windows_never_touch_a_token_the_evaluation_reads() -> None:
    mixture = sampler.Mixture([_positions(10_000)], seed=3, context=64)
    evaluation = torch.cat([mixture.validation_batch(i, 16)[0] for i in range(20)])
    steering = torch.cat([mixture.validation_batch(i, 16, "steer")[0] for i in range(20)])
    cut = int(10_000 * sampler._EVALUATION_SHARE)
    assert int(evaluation.max()) < cut <= int(steering.min())
    # each part is still a fixed draw: the same batches on every call
    assert torch.equal(steering[:16], mixture.validation_batch(0, 16, "steer")[0])
    with pytest.raises(ValueError, match="part"):
        mixture.validation_batch(0, 16, "train")


def test_a_steering_part_shorter_than_a_window_is_refused_naming_the_fix() -> None:
    mixture = sampler.Mixture([_positions(300)], seed=0, context=64)  # 240 evaluate, 60 steer
    mixture.validation_batch(0, 2)
    with pytest.raises(ValueError, match=r"'pos'.*steer DDK and D-CPT.*model\.context"):
        mixture.validation_batch(0, 2, "steer")


@pytest.mark.usefixtures("single_thread")
def test_d_cpt_probes_measure_only_the_steering_part(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = harness.build_spec(steps=4, interval_steps=None)
    spec["data"]["mixture"] = "auto"
    spec["data"]["plan"] = {"domain": "math", "probeSteps": 4, "probeEvaluations": 2,
                            "probeRatios": [0.2, 0.5, 0.8, 0.35]}
    cfg = run_config.load_run_config(harness.write_config(tmp_path, harness.shared_data_dir(), spec))
    parts: list[str] = []
    draw = sampler.Mixture.validation_batch

    def recorded(self: sampler.Mixture, index: int, sequences: int, part: str = "val") -> tuple:
        parts.append(part)
        return draw(self, index, sequences, part)

    monkeypatch.setattr(sampler.Mixture, "validation_batch", recorded)
    points = mixture_plan.run_probe(cfg, 0.5, torch.device("cpu"))
    assert len(points) == 2 and parts and set(parts) == {"steer"}
