"""Remediation S3 in the runtime: an explicit per-stage layer split (`stageLayers`), and a resume
across a split change, checked against a world-of-one, non-pipelined reference of the same seed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import runtime_harness as harness
import torch
from test_runtime_pipeline_job import losses, run_job

from huorn import models
from huorn.runtime import config as run_config
from huorn.runtime.pipeline import split

pytestmark = pytest.mark.timeout(600)
STEPS = 6


def build_spec(**parallelism: object) -> dict:
    spec = harness.build_spec(steps=STEPS, interval_steps=3, global_batch=8, micro_batch=2, max_replicas=4)
    spec["model"] = {**spec["model"], "layers": 4}
    if parallelism:
        spec["parallelism"] = parallelism
    return spec


def build_decoder() -> models.Decoder:
    torch.manual_seed(0)
    return models.Decoder(models.ModelConfig(layers=4, width=32, heads=2, vocabulary=64, context=16))


def test_split_decoder_honours_an_explicit_layer_split() -> None:
    decoder = build_decoder()
    stages = split.split_decoder(decoder, 2, [3, 1])
    assert [(s.start, s.end) for s in stages] == [(0, 3), (3, 4)]
    assert [len(s.blocks) for s in stages] == [3, 1]
    assert stages[0].first and not stages[0].last and stages[1].last
    assert [(s.start, s.end) for s in split.split_decoder(decoder, 2)] == [(0, 2), (2, 4)]


@pytest.mark.parametrize(("layers", "message"), [
    ([2, 1, 1], "has 3 entries but parallelism.pipelineStages is 2"),
    ([4, 0], "every stage needs at least one layer"),
    ([2, 3], "sums to 5 but spec.model.layers is 4"),
])
def test_a_bad_layer_split_is_refused_naming_the_field(layers: list[int], message: str) -> None:
    with pytest.raises(ValueError, match="stageLayers") as error:
        split.split_decoder(build_decoder(), 2, layers)
    assert message in str(error.value)


def test_run_config_refuses_a_split_that_does_not_fit_the_model(tmp_path: Path) -> None:
    base = {"jobName": "t", "spec": build_spec(pipelineStages=2), "runDir": str(tmp_path)}
    assert run_config.RunConfig.model_validate({**base, "stageLayers": [3, 1]}).stage_layers == [3, 1]
    with pytest.raises(ValueError, match=r"stageLayers \[2, 1\] must have one entry per pipeline stage"):
        run_config.RunConfig.model_validate({**base, "stageLayers": [2, 1]})


@pytest.mark.slow
def test_resume_across_a_split_change_continues_the_reference_losses(tmp_path: Path) -> None:
    """Train [2, 2], checkpoint at step 3, restart at [3, 1]: the checkpoint's tensors carry the
    undivided decoder's names, so the new stages load their new layers and the losses go on
    exactly as the single-process run's."""
    data_dir = harness.shared_data_dir()
    reference = losses(run_job(tmp_path / "ref", data_dir, build_spec(), nproc=1))
    assert sorted(reference) == list(range(1, STEPS + 1))  # else the loss check below is partial
    job = tmp_path / "job"
    first = run_job(job, data_dir, build_spec(pipelineStages=2, schedule="1f1b"), nproc=2, stageLayers=[2, 2])
    assert {tuple(e["stage_layers"]) for e in harness.steps_of(first)} == {(2, 2)}
    root = job / "ckpt"
    shutil.rmtree(root / "step-00000006")
    (root / "latest").write_text("step-00000003\n")
    (job / "run" / "steps.jsonl").unlink()
    resumed = run_job(job, data_dir, build_spec(pipelineStages=2, schedule="1f1b"), nproc=2,
                      stageLayers=[3, 1])
    assert next(e for e in resumed if e["event"] == "start")["resumed_from"] == 3
    steps = harness.steps_of(resumed)
    assert {tuple(e["stage_layers"]) for e in steps} == {(3, 1)}
    got = {**{s: v for s, v in losses(first).items() if s <= 3}, **losses(resumed)}
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, loss in reference.items():
        assert got[step] == pytest.approx(loss, rel=1e-4, abs=1e-5), step

