"""DDK distillation (NeurIPS 2024): a student learns from a teacher's next-token distributions,
and the data mix moves toward the sources where the student lags the teacher most.

Uniform or hand-set mixes waste tokens on what the student already does as well as the teacher
and starve what it does worst; DDK measures the gap per source on held-out data and reweights.
With per-source validation losses ℓ_S,i (student) and ℓ_T,i (teacher), ratio_i = ℓ_S,i / ℓ_T,i:

- the first weights are softmax(ratio) over the sources;
- every K steps: ψ_i = r_i · exp(ratio_i), then r ← α·ψ/Σψ + (1 − α)/N, so no source ever
  drops below (1 − α)/N (the smoothing keeps a source from starving once it has caught up).

The loss is CE + γ·T²·KL(student ‖ teacher) at temperature T. The teacher is any Huorn checkpoint
(its huorn.json names its architecture), frozen, with the student's vocabulary.

The weights are part of the training state: checkpoints and the in-place state hand-over carry
them, so a resumed or resized run draws the same batches as one that never stopped.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from huorn import models
from huorn.api import training
from huorn.runtime import checkpoint, init_weights
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler

FIELD = "spec.task.teacher.checkpoint"


@dataclass(frozen=True)
class Teacher:
    model: torch.nn.Module
    path: Path
    spec: training.ModelSpec


def load_teacher(location: str, student: training.ModelSpec, device: torch.device) -> Teacher:
    """The frozen teacher. Call it before the process group forms: DCP then reads the checkpoint
    in this process alone, so an in-place replica joining a running gang needs nobody else."""
    path, spec = init_weights.saved_model(location, FIELD, "teacher")
    if spec.vocabulary != student.vocabulary:
        raise ValueError(f"{FIELD}: the teacher's vocabulary ({spec.vocabulary}) differs from "
                         f"spec.model.vocabulary ({student.vocabulary}); distillation compares next-token "
                         "distributions, so set the student's vocabulary to the teacher's")
    if spec.context < student.context:
        raise ValueError(f"{FIELD}: the teacher was built for a context of {spec.context} tokens, below "
                         f"spec.model.context ({student.context}); lower the student's context")
    model = models.build_model(run_config.build_model_config(spec)).to(device)
    with warnings.catch_warnings():  # one process, no group: what DCP warns about is the point
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoint.load_checkpoint(path, model, None)
    model.eval()
    model.requires_grad_(False)
    return Teacher(model, path, spec)


def kl_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                  temperature: float) -> torch.Tensor:
    """Mean over tokens of KL(student ‖ teacher) between the softened distributions, times T², in
    fp32 (bf16 log-probabilities lose the small differences that carry the signal). Softening by T
    shrinks the KL's gradient by about 1/T² (Hinton et al.): unscaled, a teacher.temperature of 4
    cut the distillation signal 36-fold and γ no longer meant what it says at T = 1."""
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    return temperature ** 2 * (student.exp() * (student - teacher)).sum(-1).mean()


def mean_loss(model: torch.nn.Module, mixture: sampler.Mixture, batches: int, sequences: int,
              device: torch.device | None = None, part: str = "val") -> float:
    """Mean cross-entropy over `batches` fixed validation batches (the model in eval mode), of
    the held-out part the evaluation reads ("val") or of the one that steers training ("steer":
    DDK's and D-CPT's measurements, so that no choice is made on the evaluation's windows)."""
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for index in range(batches):
            tokens, targets = mixture.validation_batch(index, sequences, part)
            if device is not None:
                tokens, targets = tokens.to(device), targets.to(device)
            total += float(model(tokens, targets)[1])
    model.train(was_training)
    return total / batches


def source_losses(model: torch.nn.Module, mixture: sampler.Mixture, batches: int, sequences: int,
                  device: torch.device | None = None, part: str = "val") -> list[float]:
    """Each source's own validation loss (of held-out `part`, as `mean_loss`), in the mixture's
    source order."""
    return [mean_loss(model, mixture.only(i), batches, sequences, device, part)
            for i in range(len(mixture.sources))]


def initial_weights(ratios: list[float]) -> list[float]:
    top = max(ratios)
    exps = [math.exp(r - top) for r in ratios]
    return [e / sum(exps) for e in exps]


def update_weights(weights: list[float], ratios: list[float], alpha: float) -> list[float]:
    psi = [w * math.exp(r) for w, r in zip(weights, ratios, strict=True)]
    n = len(weights)
    return [alpha * p / sum(psi) + (1 - alpha) / n for p in psi]


@dataclass
class DomainReweighting:
    """DDK's weights and when they were last computed (the step they apply from)."""

    every: int  # K
    alpha: float
    weights: list[float] = field(default_factory=list)
    step: int = -1  # the step the weights were computed at; -1: never

    def due(self, step: int) -> bool:
        return step != self.step and (not self.weights or step % self.every == 0)

    def advance(self, step: int, ratios: list[float]) -> list[float]:
        self.weights = (update_weights(self.weights, ratios, self.alpha) if self.weights
                        else initial_weights(ratios))
        self.step = step
        return self.weights

    def state(self) -> dict:
        return {"weights": list(self.weights), "step": self.step}

    def restore(self, state: dict | None) -> None:
        if state:
            self.weights, self.step = [float(w) for w in state["weights"]], int(state["step"])
