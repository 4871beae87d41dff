"""A world of one's small-batch gradient norm, for the gradient noise scale (noise_scale.py).

Two or more ranks read B_noise from each rank's gradient against the reduced one. A world of one
has no second rank, but it accumulates micro-batches, and their partial sums are gradients of
smaller batches. Two ways to read them, measured against two ranks on the same model
(docs/benchmarks.md, "Gradient noise scale"):

- **Two halves** (an even number of micro-batches, and room for one copy of the gradients): the
  first half's gradient is copied when it is complete, and the second half's is the step's
  gradient less that copy. The pair is exactly what two ranks of half the batch each would hold,
  so the reading is theirs: tr(Σ) comes from the halves' difference, free of G.
- **First micro-batch** (otherwise): the gradient after the first micro-batch, against the step.
  No copy, but a noisier reading: G does not cancel out of one part against the whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

Gradients = Sequence[torch.Tensor | None]


def squared_norm(grads: Gradients) -> float:
    present = [g for g in grads if g is not None]
    return float(torch.nn.utils.get_total_norm(present)) ** 2 if present else 0.0


def gradient_bytes(parameters: Iterable[torch.nn.Parameter]) -> int:
    """The bytes of the gradients of every parameter that trains, whether or not it has one yet."""
    return sum(p.numel() * p.element_size() for p in parameters if p.requires_grad)


class SoloReading:
    """One step's reading. The trainer's accumulated gradient after d of M micro-batches is
    (1/M)·Σ_{i≤d} g_i, each g_i a micro-batch's mean gradient; `copy_fits` says whether a copy of
    the gradients fits (of every parameter that trains: a mixture of experts' expert that the
    first micro-batch did not reach has no gradient yet, but has one by the half)."""

    def __init__(self, micro_batches: int, micro_batch: int, copy_fits: bool) -> None:
        if micro_batches < 2:
            raise ValueError(f"a solo reading needs two or more micro-batches, got {micro_batches}")
        self.micro_batches, self.micro_batch = micro_batches, micro_batch
        self.half = micro_batches // 2 if micro_batches % 2 == 0 and copy_fits else 0
        self.first_sq: float | None = None
        self.copy: list[torch.Tensor | None] | None = None

    @property
    def mode(self) -> str:
        return "halves" if self.half else "first micro-batch"

    def after_backward(self, done: int, grads: Gradients) -> None:
        """Called after each micro-batch's backward pass with the accumulated gradients."""
        if done == 1 and not self.half:
            self.first_sq = squared_norm(grads) * self.micro_batches**2
        if self.half and done == self.half:
            self.copy = [None if g is None else g.detach().clone() for g in grads]

    def reading(self, grads: Gradients) -> tuple[float, float] | None:
        """(mean squared norm of the small batches, their size in sequences) once the step's
        gradient is complete, or None where nothing was read."""
        if self.copy is None:
            return None if self.first_sq is None else (self.first_sq, float(self.micro_batch))
        # both halves hold M/2 micro-batches, so each half's mean is 2× its share of the total
        first = squared_norm(self.copy) * 4
        for kept, total in zip(self.copy, grads, strict=True):
            if kept is not None and total is not None:
                kept.sub_(total)  # −(second half's share); its sign does not change its norm
        second = squared_norm([total if kept is None else kept
                               for kept, total in zip(self.copy, grads, strict=True)]) * 4
        self.copy = None
        return (first + second) / 2, float(self.half * self.micro_batch)
