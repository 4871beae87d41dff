"""The trainer as a process: loss goes down, SIGTERM leaves a loadable checkpoint within the grace
period and a restart resumes from it, bad configs exit 2; plus the pure batch/lr/noise rules."""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import runtime_harness as harness
from hypothesis import given
from hypothesis import strategies as st

from huorn import models
from huorn.api import training
from huorn.runtime import batching, checkpoint, noise_scale, train
from huorn.runtime import config as run_config

GRACE_PERIOD_S = 30.0  # Kubernetes' default terminationGracePeriodSeconds


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return harness.shared_data_dir()


@pytest.mark.slow
def test_loss_goes_down_on_the_shipped_corpora(tmp_path: Path, data_dir: Path) -> None:
    config = harness.write_config(tmp_path, data_dir, harness.build_spec(steps=40, interval_steps=20),
                                  validationInterval=10)
    process = harness.start_trainer(config, tmp_path / "train.log")
    assert process.wait(timeout=240) == 0, (tmp_path / "train.log").read_text()[-3000:]
    events = harness.read_events(tmp_path / "run")
    steps = harness.steps_of(events)
    assert [s["step"] for s in steps] == list(range(1, 41))
    assert steps[0]["loss"] == pytest.approx(math.log(256), abs=0.5)  # untrained: uniform over bytes
    validation = [s["validation_loss"] for s in steps if "validation_loss" in s]
    assert len(validation) == 4 and validation[-1] < validation[0] < steps[0]["loss"]
    assert np.mean([s["loss"] for s in steps[-5:]]) < steps[0]["loss"] - 1.5
    assert [e["reason"] for e in events if e["event"] == "checkpoint"] == ["periodic", "final"]
    assert events[-1] == {**events[-1], "event": "done", "step": 40}
    # A world of one reads its noise scale from its 6 micro-batches, two halves of 3 (it read none before).
    noise = [s["gradient_noise_scale"] for s in steps[10:]]
    assert all(n is not None and math.isfinite(n) and n > 0 for n in noise), noise
    assert {s["gradient_noise_reading"] for s in steps} == {"halves"}  # host memory has room for the copy

    # Continual pre-training from those weights starts where this run ended, not from scratch.
    task = {"kind": "cpt", "initCheckpoint": str(tmp_path / "ckpt")}
    (tmp_path / "cpt").mkdir()
    cpt_spec = harness.build_spec(steps=2, interval_steps=None, task=task)
    cpt = harness.write_config(tmp_path / "cpt", data_dir, cpt_spec)
    assert harness.start_trainer(cpt, tmp_path / "cpt.log").wait(timeout=240) == 0
    first = harness.steps_of(harness.read_events(tmp_path / "cpt" / "run"))[0]
    assert first["loss"] < steps[0]["loss"] - 1.0


@pytest.mark.slow
def test_sigterm_checkpoints_within_the_grace_period_and_a_restart_resumes(tmp_path: Path,
                                                                          data_dir: Path) -> None:
    spec = harness.build_spec(steps=10_000, interval_steps=None)
    config = harness.write_config(tmp_path, data_dir, spec, faults=[{"kind": "slow-compute", "ms": 50}])
    process = harness.start_trainer(config, tmp_path / "train.log")
    harness.wait_for(lambda: len(harness.steps_of(harness.read_events(tmp_path / "run"))) >= 3, 180,
                     "three steps")
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=GRACE_PERIOD_S) == 0
    assert time.monotonic() - signalled < GRACE_PERIOD_S
    events = harness.read_events(tmp_path / "run")
    last_step = harness.steps_of(events)[-1]["step"]
    assert events[-1]["event"] == "checkpoint" and events[-1]["reason"] == "sigterm"
    assert events[-1]["step"] == last_step
    latest = checkpoint.find_latest(tmp_path / "ckpt")
    assert latest is not None and checkpoint.read_meta(latest)["step"] == last_step
    model_spec = training.ModelSpec.model_validate(spec["model"])
    model = models.build_model(run_config.build_model_config(model_spec))
    assert checkpoint.load_checkpoint(latest, model, None)["step"] == last_step

    resumed = harness.write_config(tmp_path, data_dir, spec, stepLimit=last_step + 3)
    process = harness.start_trainer(resumed, tmp_path / "train.log")
    assert process.wait(timeout=240) == 0
    attempts = harness.split_attempts(harness.read_events(tmp_path / "run"))
    assert attempts[-1]["start"]["resumed_from"] == last_step
    assert [s["step"] for s in attempts[-1]["steps"]] == [last_step + 1, last_step + 2, last_step + 3]


def test_bad_config_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("jobName: x\nrunDir: /tmp/x\nspec:\n  virtualCluster: vc\n  optimization:\n"
                    "    steps: 5\n    globalBatch: 10\n    microBatch: 4\n")
    assert train.main(["--config", str(path)]) == 2
    error = capsys.readouterr().err
    assert "globalBatch" in error and "microBatch" in error
    assert train.main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read run config" in capsys.readouterr().err


def test_run_config_round_trips_and_resolves_defaults(tmp_path: Path) -> None:
    path = harness.write_config(tmp_path, tmp_path, harness.build_spec(steps=7))
    config = run_config.load_run_config(path)
    assert config.total_steps() == 7 and config.telemetry_port == 0
    assert config.checkpoint_root == tmp_path / "ckpt"
    assert config.checkpoint_interval_s() is None  # intervalSteps governs
    timed = harness.build_spec(steps=7, interval_steps=None)
    timed["checkpoint"]["interval"] = "1m30s"
    assert run_config.RunConfig.model_validate({"jobName": "t", "spec": timed, "runDir": "/r"}
                                               ).checkpoint_interval_s() == 90
    assert run_config.load_run_config(run_config.write_run_config(config, tmp_path / "again.json")) == config
    tokens = harness.build_spec(steps=None, tokens=12 * 32 * 5 + 1)
    del tokens["optimization"]["steps"]
    assert run_config.RunConfig.model_validate(
        {"jobName": "t", "spec": tokens, "runDir": "/r"}).total_steps() == 6
    distill = harness.build_spec(task={"kind": "distill", "teacher": {"checkpoint": "/t"}})
    teacher = run_config.RunConfig.model_validate({"jobName": "t", "spec": distill, "runDir": "/r"}).spec.task
    assert teacher.teacher is not None and teacher.teacher.reweight_steps == 1000  # DDK's K
    with pytest.raises(ValueError, match="telemetryPort"):
        (tmp_path / "p.json").write_text('{"jobName": "t", "runDir": "/r", "telemetryPort": 70000, '
                                         '"spec": {"virtualCluster": "v", "optimization": {"steps": 1}}}')
        run_config.load_run_config(tmp_path / "p.json")


def test_fixed_global_batch_keeps_batch_and_lr_across_world_sizes() -> None:
    opt = training.Optimization(global_batch=24, micro_batch=2, learning_rate=1e-3, steps=10)
    plans = [batching.plan_batch(opt, 2, world) for world in (1, 2, 3, 5)]
    assert {(p.global_batch, p.micro_batches, p.learning_rate) for p in plans} == {(24, 12, 1e-3)}


def test_scale_with_replicas_grows_batch_and_lr_by_the_square_root_rule() -> None:
    opt = training.Optimization(global_batch=16, micro_batch=2, learning_rate=1e-3, steps=10,
                                batch_rule="scale-with-replicas")
    base, doubled = batching.plan_batch(opt, 2, 2), batching.plan_batch(opt, 2, 4)
    assert (base.global_batch, base.learning_rate) == (16, 1e-3)
    assert doubled.global_batch == 32 and doubled.learning_rate == pytest.approx(1e-3 * math.sqrt(2))
    assert doubled.micro_batches // 4 == base.micro_batches // 2  # the same work per replica
    # replicas, not ranks: 2 pods of 8 GPUs (16 ranks) at minReplicas 2 are the base plan
    at_minimum = batching.plan_batch(opt, 2, batching.replicas_in(16, 8))
    assert (at_minimum.global_batch, at_minimum.learning_rate) == (16, 1e-3)
    assert batching.replicas_in(6, 2) == 3 and batching.replicas_in(1, 1) == 1


@given(step=st.integers(0, 999), schedule=st.sampled_from(list(training.LrSchedule)))
def test_learning_rate_warms_up_then_stays_within_ten_to_hundred_percent(step: int, schedule: str) -> None:
    lr = batching.learning_rate(step, 1000, 1.0, 50, training.LrSchedule(schedule))
    if step < 50:
        assert lr == pytest.approx((step + 1) / 50)
    else:
        assert 0.1 - 1e-9 <= lr <= 1.0 + 1e-9
    final = batching.learning_rate(999, 1000, 1.0, 50, training.LrSchedule.COSINE)
    assert final == pytest.approx(0.1, abs=1e-4)


def test_noise_scale_components_need_two_batch_sizes() -> None:
    """The estimator itself, read by ranks and by a world of one, is tested in
    test_runtime_solo_noise.py against a known gradient noise."""
    with pytest.raises(ValueError, match="b_small < b_big"):
        noise_scale.estimate_components(1.0, 1.0, 8, 8)
