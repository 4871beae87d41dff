"""A stage's forward and backward replayed as CUDA graphs, one graph pair per in-flight slot.

Why: on one H200 each half of the benchmark decoder (4 layers, width 2048, 16 micro-batches
of 2 × 1,024 tokens) was bound by the host launching its kernels, not by the GPU. Eager, the
host needed 187 ms (stage 0) and 196 ms (stage 1) for a step's forwards and backwards, and the
GPU finished with it; replayed as graphs the same work took 108 and 140 ms (GPU time), with the
host done after 22 and 26 ms (`benchmarks/pipeline_gpu_probe.py`). A pipeline of host-bound
stages runs at the host's pace, whatever the schedule: on 2×H200 graphed 1F1B steps took
150 ms against 196 ms for torch's Schedule1F1B (docs/benchmarks.md).

`torch.cuda.make_graphed_callables` turns a module into an autograd function whose forward and
backward replay captured graphs. Its static buffers (inputs, saved activations, outputs,
gradients) are reused on every replay, so one graphed callable can hold only one micro-batch
between its forward and its backward. A schedule keeps up to `count_in_flight` micro-batches
between the two on a stage (2 on stage 0 of a 2-stage 1F1B, k × stages in kFkB, M in GPipe),
so each in-flight slot gets its own graphed callable with its own memory pool: a micro-batch
takes a free slot at its forward and gives it back after its backward, in any order the table
asks. The memory is the price: every slot keeps one micro-batch's activations and one set of
parameter gradients for good, whichever table runs, so the number of slots is capped, and a
slot is only captured while the device keeps twice the largest slot's footprint free; a table
that needs more slots than that runs eagerly.

What aliasing the static buffers means for the caller (the executor does all three):
- a micro-batch's loss must be copied before its slot runs again;
- a received tensor's `.grad` after the backward *is* the slot's static buffer (autograd's
  gradient accumulation steals it), so it must be copied before it is sent;
- parameters must already hold a `.grad` before the first graphed backward of a step, so that
  gradient accumulation adds into it instead of adopting (and later overwriting) a slot's
  buffer; `ensure_grads` gives them persistent zeroed buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from huorn.models import moe as model_moe

LossFn = Callable[[tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]


class GraphUnavailable(RuntimeError):
    """The stage cannot run as CUDA graphs (why is in the message); it runs eagerly instead."""


class _SlotModule(nn.Module):
    """The stage (plus the loss on the last stage) as one callable with tensor outputs only.
    A fresh wrapper per slot: `make_graphed_callables` replaces the forward of the module it is
    given, and each slot needs its own graphs over the same parameters."""

    def __init__(self, stage: nn.Module, loss_fn: LossFn | None) -> None:
        super().__init__()
        self.stage, self.loss_fn = stage, loss_fn

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.loss_fn is None:
            outputs = self.stage(*tensors)
            return (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        *inputs, target = tensors
        outputs = self.stage(*inputs)
        outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
        return (self.loss_fn(outputs, target),)


class GraphedStage:
    """The slots of one stage. `prepare(n)` captures slots up to n (call it between steps, with
    no communication in flight); `forward(inputs)` runs a micro-batch's forward in a free slot
    and returns its outputs and slot; `release(slot)` after that micro-batch's backward."""

    def __init__(self, module: nn.Module, loss_fn: LossFn | None, samples: Sequence[torch.Tensor],
                 max_slots: int) -> None:
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        devices = {t.device for t in samples} | {p.device for p in module.parameters()}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise GraphUnavailable(f"CUDA graphs need the stage and its inputs on one CUDA device, got "
                                   f"{sorted(map(str, devices))}")
        self.module, self.loss_fn, self.max_slots = module, loss_fn, max_slots
        # the sample tensors become the graphs' static inputs, which every replay overwrites:
        # each slot gets private copies, never a caller's tensors
        self._samples = [(t.detach().clone().requires_grad_(t.requires_grad)) for t in samples]
        self._slots: list[Callable[..., tuple[torch.Tensor, ...]]] = []
        self._free: list[int] = []
        self._grads: dict[nn.Parameter, torch.Tensor] = {}
        self.slot_bytes = 0  # the most device memory one slot's capture took (its pool, warm-up included)

    @property
    def slots(self) -> int:
        return len(self._slots)

    def prepare(self, needed: int) -> bool:
        """Capture slots until `needed` exist. False (that table runs eagerly) when `needed` is
        over the cap or the device has not room for another slot."""
        if needed > self.max_slots:
            return False
        while len(self._slots) < needed:
            if self.slot_bytes and torch.cuda.mem_get_info()[0] < 2 * self.slot_bytes:
                return False
            reserved = torch.cuda.memory_reserved()
            self._slots.append(self._capture())
            self._free.append(len(self._slots) - 1)
            self.slot_bytes = max(self.slot_bytes, torch.cuda.memory_reserved() - reserved)
        return True

    def _capture(self) -> Callable[..., tuple[torch.Tensor, ...]]:
        """One slot's graphs, or GraphUnavailable: an op that cannot be captured (a host sync, a
        data-dependent shape), or a capture invalidated by work outside it.

        NB: the capture fails with cudaErrorStreamCaptureInvalidated if an autograd graph from
        an eager step on another stream is still alive: its parameters' AccumulateGrad nodes
        keep that stream, and the captured backward would have to wait on it. The saved-tensor
        meter used to leak exactly such a graph (memory.SavedTensorMeter), and every first
        capture on 2×H200 failed until that was fixed."""
        samples = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in self._samples)
        wrapper = _SlotModule(self.module, self.loss_fn)
        stream = torch.cuda.current_stream()
        try:
            with _thread_local_capture():
                return torch.cuda.make_graphed_callables(wrapper, samples)
        except RuntimeError as error:
            torch.cuda.set_stream(stream)  # a capture that raises at its end leaves its side stream current
            raise GraphUnavailable(f"capturing the stage failed: {str(error).splitlines()[0]}") from error

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], int]:
        if not self._free:
            raise RuntimeError(f"all {len(self._slots)} graph slots hold a micro-batch; prepare() the "
                               "schedule's in-flight count before running it")
        slot = self._free.pop()
        return self._slots[slot](*inputs), slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def ensure_grads(self) -> None:
        """Parameters without a .grad get a persistent buffer, zeroed: see the module notes."""
        missing = [p for p in self.module.parameters() if p.requires_grad and p.grad is None]
        if not missing:
            return
        buffers = []
        for p in missing:
            buffer = self._grads.get(p)
            if buffer is None:
                buffer = self._grads[p] = torch.empty_like(p)
            buffers.append(buffer)
        torch._foreach_zero_(buffers)
        for p, buffer in zip(missing, buffers, strict=True):
            p.grad = buffer


def graph_blocker(module: nn.Module) -> str | None:
    """Why this stage cannot be captured, or None. Checked before trying: an MoE layer routes
    tokens with a data-dependent nonzero (a host sync and dynamic shapes)."""
    for name, sub in module.named_modules():
        if isinstance(sub, model_moe.MoE):
            return f"{name or 'the stage'} is a mixture of experts (data-dependent routing)"
    if any(b.requires_grad for b in module.buffers()):
        return "a buffer requires grad"
    return None


class _ThreadLocalGraph(torch.cuda.graph):
    """torch.cuda.graph capturing in "thread_local" mode (see `_thread_local_capture`)."""

    def __init__(self, cuda_graph: torch.cuda.CUDAGraph, pool: object = None, stream: object = None,
                 capture_error_mode: str = "thread_local", **options: object) -> None:
        super().__init__(cuda_graph, pool=pool, stream=stream,  # type: ignore[arg-type]
                         capture_error_mode="thread_local", **options)


@contextlib.contextmanager
def _thread_local_capture() -> Iterator[None]:
    """Make `make_graphed_callables` capture in CUDA's thread-local mode.

    NB: it captures in "global" mode and has no argument to change that. In global mode a
    CUDA call that is unsafe during capture, made by *any* thread of the process, invalidates
    the capture, and a process with NCCL communicators has such threads (the process group's
    watchdog queries events; NCCL's proxy threads). Nothing but the capturing thread (and the
    autograd engine's, which launches into the capture stream) touches the capture stream,
    which is what thread-local mode requires. (The captures that failed on 2×H200 failed for
    another reason, see `_capture`; whether global mode would also fail was not measured.)
    `make_graphed_callables` looks `torch.cuda.graph` up when it runs, so it
    is swapped for the duration of one call, on the thread that makes it."""
    original = torch.cuda.graph
    torch.cuda.graph = _ThreadLocalGraph  # type: ignore[misc]
    try:
        yield
    finally:
        torch.cuda.graph = original  # type: ignore[misc]

