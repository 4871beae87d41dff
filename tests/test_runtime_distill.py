"""DDK distillation in the trainer: the KL term, the domain reweighting rule, the teacher's
checks, and real runs (gloo, two ranks) whose data mix follows the student's gap to the teacher
and survives a SIGTERM and a resume unchanged."""

from __future__ import annotations

import math
import signal
import subprocess
import warnings
from pathlib import Path

import pytest
import runtime_harness as harness
import torch
import torch.nn.functional as F

from huorn import models
from huorn.api import training
from huorn.runtime import checkpoint, distill
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler

ALPHA = 0.5


@pytest.fixture(scope="module")
def data_dir() -> Path:
    return harness.shared_data_dir()


def test_kl_is_the_student_to_teacher_divergence_of_the_softened_distributions_times_t_squared() -> None:
    """Times T², as Hinton et al. scale it: softening shrinks the gradient by about 1/T², and
    unscaled a temperature of 4 cut the distillation signal 36-fold."""
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11), torch.randn(2, 5, 11)
    for temperature in (1.0, 2.0, 4.0):
        log_s = F.log_softmax(student / temperature, -1)
        log_t = F.log_softmax(teacher / temperature, -1)
        # torch's kl_div(input, target) is KL(target ‖ input): the reference of KL(student ‖ teacher)
        reference = temperature ** 2 * F.kl_div(log_t, log_s, log_target=True, reduction="sum") / 10
        assert float(distill.kl_divergence(student, teacher, temperature)) == pytest.approx(float(reference),
                                                                                           rel=1e-5)
    norms = []
    for temperature in (1.0, 4.0):
        s = student.clone().requires_grad_(True)
        distill.kl_divergence(s, teacher, temperature).backward()
        norms.append(float(s.grad.norm()))
    assert 0.5 < norms[1] / norms[0] < 2.0, norms  # the signal keeps its size as T changes
    assert float(distill.kl_divergence(student, student, 1.0)) == pytest.approx(0.0, abs=1e-6)


def test_the_first_weights_are_a_softmax_of_the_ratios_then_each_update_smooths() -> None:
    ratios = [1.2, 1.0, 1.5]
    first = distill.initial_weights(ratios)
    exps = [math.exp(r) for r in ratios]
    assert first == pytest.approx([e / sum(exps) for e in exps])
    second = distill.update_weights(first, ratios, ALPHA)
    psi = [w * e for w, e in zip(first, exps, strict=True)]
    assert second == pytest.approx([ALPHA * p / sum(psi) + (1 - ALPHA) / 3 for p in psi])
    assert sum(second) == pytest.approx(1.0)
    # The source with the largest gap gains; none falls below the smoothing floor.
    assert max(range(3), key=second.__getitem__) == 2
    weights = first
    for _ in range(50):
        weights = distill.update_weights(weights, ratios, ALPHA)
        assert min(weights) >= (1 - ALPHA) / 3 - 1e-12


def test_reweighting_is_due_at_the_start_then_every_k_steps_and_never_twice() -> None:
    ddk = distill.DomainReweighting(every=4, alpha=ALPHA)
    assert ddk.due(0) and ddk.due(3)  # no weights yet: due wherever the run starts
    ddk.advance(0, [1.0, 2.0])
    assert [s for s in range(13) if ddk.due(s)] == [4, 8, 12]
    ddk.advance(4, [1.0, 1.0])
    assert not ddk.due(4)  # a regroup back to step 4 keeps the weights it has
    again = distill.DomainReweighting(every=4, alpha=ALPHA)
    again.restore(ddk.state())
    assert (again.weights, again.step) == (ddk.weights, 4)


def test_mixture_draws_follow_new_probabilities_and_one_source_alone(data_dir: Path) -> None:
    mixture = sampler.build_mixture([("general", 1.0, None), ("math", 1.0, None)], 0, 32, data_dir)
    only_math = mixture.with_probabilities([0.0, 1.0])
    tokens, _ = only_math.micro_batch(3, 0, 4)
    alone, _ = mixture.only(1).micro_batch(3, 0, 4)
    assert torch.equal(tokens, alone)
    with pytest.raises(ValueError, match="2 probabilities"):
        mixture.with_probabilities([1.0])


def _teacher_run(tmp: Path, data_dir: Path) -> Path:
    """A short pretraining whose checkpoint is the teacher, here rather than in a trainer process:
    what distillation reads is only the checkpoint, and a process costs a torch start-up."""
    spec = harness.build_spec()
    model_spec = training.ModelSpec.model_validate(spec["model"])
    mixture = sampler.build_mixture([(s["name"], s["weight"], None) for s in spec["data"]["sources"]],
                                    spec["data"]["seed"], model_spec.context, data_dir)
    torch.manual_seed(spec["data"]["seed"])
    model = models.build_model(run_config.build_model_config(model_spec))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.003, betas=(0.9, 0.95))
    micro_batches = spec["optimization"]["globalBatch"] // spec["optimization"]["microBatch"]
    for step in range(30):
        for index in range(micro_batches):
            tokens, targets = mixture.micro_batch(step, index, spec["optimization"]["microBatch"])
            (model(tokens, targets)[1] / micro_batches).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    with warnings.catch_warnings():  # one process, no group, as a trainer alone saves
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoint.save_checkpoint(tmp / "ckpt", 30, model, optimizer, {"model": model_spec.to_wire()},
                                   rank=0, barrier=lambda: None)
    return tmp / "ckpt"


def _student_spec(teacher: Path, steps: int, every: int, **spec: object) -> dict:
    task = {"kind": "distill", "teacher": {"checkpoint": str(teacher), "reweightSteps": every}}
    built = harness.build_spec(steps=steps, interval_steps=None, task=task, **spec)
    built["data"]["mixture"] = "auto"
    return built


def _save_model(root: Path, spec: training.ModelSpec) -> None:
    model = models.build_model(run_config.build_model_config(spec))
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint.save_checkpoint(root, 1, model, optimizer, {"model": spec.to_wire()}, rank=0,
                               barrier=lambda: None)


def test_the_teacher_must_exist_and_share_the_vocabulary_and_context(tmp_path: Path) -> None:
    student = training.ModelSpec.model_validate({"layers": 2, "width": 32, "heads": 2, "context": 32})
    _save_model(tmp_path / "same", student)
    teacher = distill.load_teacher(str(tmp_path / "same"), student, torch.device("cpu"))
    assert not teacher.model.training and not any(p.requires_grad for p in teacher.model.parameters())
    bigger = student.model_copy(update={"vocabulary": 512})
    _save_model(tmp_path / "wide", bigger)
    with pytest.raises(ValueError, match=r"vocabulary \(512\) differs from spec\.model\.vocabulary"):
        distill.load_teacher(str(tmp_path / "wide"), student, torch.device("cpu"))
    _save_model(tmp_path / "short", student.model_copy(update={"context": 16}))
    with pytest.raises(ValueError, match=r"context of 16 tokens, below spec\.model\.context \(32\)"):
        distill.load_teacher(str(tmp_path / "short"), student, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"spec\.task\.teacher\.checkpoint: .*holds no complete"):
        distill.load_teacher(str(tmp_path / "none"), student, torch.device("cpu"))


def test_the_trainer_holds_the_api_rules_on_distillation(tmp_path: Path, data_dir: Path) -> None:
    """The run config embeds the API's TrainingJobSpec, so a local run refuses what the CRD does."""
    spec = _student_spec(tmp_path, steps=4, every=2)
    spec["parallelism"] = {"pipelineStages": 2}
    with pytest.raises(ValueError, match=r"pipelineStages: must be 1 when task\.kind is distill"):
        harness.write_config(tmp_path, data_dir, spec)
    auto = harness.build_spec(steps=4)
    auto["data"]["mixture"] = "auto"
    with pytest.raises(ValueError, match=r"data\.mixture: can be auto only with a method"):
        harness.write_config(tmp_path, data_dir, auto)


@pytest.mark.slow
@pytest.mark.usefixtures("single_thread")  # the teacher trains in this process
def test_a_distilled_run_moves_its_mix_toward_its_gaps_and_resumes_with_the_same_mix(
        tmp_path: Path, data_dir: Path) -> None:
    (tmp_path / "teacher").mkdir()
    teacher = _teacher_run(tmp_path / "teacher", data_dir)

    # Two ranks under torchrun (real gloo), uninterrupted.
    whole = tmp_path / "whole"
    whole.mkdir()
    config = harness.write_config(whole, data_dir, _student_spec(teacher, steps=10, every=4))
    log = whole / "train.log"
    with open(log, "wb") as out:
        code = subprocess.run(harness.trainer_command(config, 2), cwd=harness.REPO, env=harness.child_env(),
                              stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode
    assert code == 0, log.read_text()[-3000:]
    events = harness.read_events(whole / "run")
    ddk = [e for e in events if e["event"] == "ddk"]
    assert [e["step"] for e in ddk] == [0, 4, 8]
    for event in ddk:
        ratios = [s / t for s, t in zip(event["student_losses"], event["teacher_losses"], strict=True)]
        assert event["ratios"] == pytest.approx(ratios)
        assert sum(event["weights"]) == pytest.approx(1.0)
    assert ddk[0]["weights"] == pytest.approx(distill.initial_weights(ddk[0]["ratios"]))
    expected = distill.update_weights(ddk[0]["weights"], ddk[1]["ratios"], ALPHA)
    assert ddk[1]["weights"] == pytest.approx(expected)
    # An untrained student lags the trained teacher everywhere, and the teacher is fixed.
    assert all(r > 1.0 for r in ddk[0]["ratios"])
    assert ddk[1]["teacher_losses"] == ddk[0]["teacher_losses"]
    assert ddk[0]["sources"] == ["general", "code", "math"]
    # measured on the held-out part that steers, never on the windows the evaluation reports
    cfg = run_config.load_run_config(config)
    mixture = sampler.build_mixture([(s.name, s.weight, s.path) for s in cfg.spec.data.sources],
                                    cfg.spec.data.seed, cfg.spec.model.context, cfg.data_dir)
    fixed = distill.load_teacher(str(teacher), cfg.spec.model, torch.device("cpu")).model
    sequences = cfg.spec.optimization.micro_batch
    steering = distill.source_losses(fixed, mixture, cfg.validation_batches, sequences, part="steer")
    evaluation = distill.source_losses(fixed, mixture, cfg.validation_batches, sequences)
    assert ddk[0]["teacher_losses"] == pytest.approx(steering, rel=1e-4)
    assert ddk[0]["teacher_losses"] != pytest.approx(evaluation, rel=1e-4)
    steps = harness.steps_of(events)
    assert steps[-1]["loss"] < steps[0]["loss"]

    # One rank, stopped by SIGTERM after the step-4 update, then resumed: the same mix at step 8.
    cut = tmp_path / "cut"
    cut.mkdir()
    spec = _student_spec(teacher, steps=10, every=4)
    slow = harness.write_config(cut, data_dir, spec, faults=[{"kind": "slow-compute", "ms": 400}])
    process = harness.start_trainer(slow, cut / "train.log")
    harness.wait_for(lambda: any(s["step"] >= 5 for s in harness.steps_of(harness.read_events(cut / "run"))),
                     240, "step 5")
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    stopped = harness.steps_of(harness.read_events(cut / "run"))[-1]["step"]
    assert 5 <= stopped < 8, "the stop must fall between two updates"
    resumed = harness.write_config(cut, data_dir, spec)
    assert harness.start_trainer(resumed, cut / "train.log").wait(timeout=300) == 0
    # Not recomputed at the resume (that would add an update at the resumed step), but carried by
    # the checkpoint; and the same as the two-rank run's, up to float summation order.
    alone = [e for e in harness.read_events(cut / "run") if e["event"] == "ddk"]
    assert [e["step"] for e in alone] == [0, 4, 8]
    for mine, theirs in zip(alone, ddk, strict=True):
        assert mine["weights"] == pytest.approx(theirs["weights"], abs=1e-4)


def test_run_config_accepts_a_distill_spec(tmp_path: Path, data_dir: Path) -> None:
    config = run_config.load_run_config(harness.write_config(tmp_path, data_dir,
                                                             _student_spec(tmp_path, steps=4, every=2)))
    assert config.spec.task.teacher is not None and config.spec.task.teacher.reweight_steps == 2
