"""Activation memory of a pipeline stage: predicted from the schedule table, measured from
the tensors autograd actually saves.

Prediction: a stage holds one set of saved activations per micro-batch whose forward has run
and whose backward has not, so its peak is `count_in_flight(stage) × bytes per micro-batch`.
kFkB multiplies the 1F1B in-flight count by k, which is the whole memory cost of a larger k.
Bytes per micro-batch are measured on one micro-batch; where they depend on the data (MoE
routing) the measurement takes the worst case (`measure_microbatch_bytes`), because the
planner holds the prediction against a memory limit.

Measurement: `SavedTensorMeter` hooks autograd's saved-tensor packing, so it counts exactly
what the backward pass will need (not parameters, not receive buffers), and a weak finalizer
subtracts each tensor when autograd frees the graph after backward. It works the same on CPU
and GPU, where `torch.cuda.max_memory_allocated` would also count workspace and caches."""

from __future__ import annotations

import contextlib
import os
import weakref
from collections.abc import Callable, Iterable, Sequence

import psutil
import torch
from torch import nn

from huorn.runtime.pipeline import schedules

# Memory a budget leaves to everything the model does not count: allocator fragmentation,
# receive buffers posted ahead, a temporary larger than the measured step's (a tenth).
HEADROOM_FRACTION = 0.1


def predict_peak_bytes(schedule: schedules.Schedule, bytes_per_microbatch: Sequence[int]) -> tuple[int, ...]:
    """Peak saved-activation bytes per stage for this table."""
    if len(bytes_per_microbatch) != schedule.stages:
        raise ValueError(f"bytes_per_microbatch: need one entry per stage ({schedule.stages}), "
                         f"got {len(bytes_per_microbatch)}")
    in_flight = schedules.count_in_flight(schedule)
    return tuple(n * b for n, b in zip(in_flight, bytes_per_microbatch, strict=True))


class _Saved:
    """What autograd stores in place of a saved tensor; its death is the tensor's release."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedTensorMeter:
    """Live and peak bytes of tensors saved for backward, parameters excluded.

    Storages are counted once however many ops save them (a residual stream saved by two
    layers costs its bytes once), which is what the allocator would hold."""

    def __init__(self, parameters: Iterable[nn.Parameter] = ()) -> None:
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.live_bytes = 0
        self.peak_bytes = 0

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def _pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self._parameter_storages or storage.nbytes() == 0:
            return tensor
        entry = self._live.get(pointer)
        if entry is None:
            self._live[pointer] = [storage.nbytes(), 1]
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        else:
            entry[1] += 1
        # NB: the holder keeps a *detached* view. A saved output still carries its grad_fn, the
        # node that saves it: holding it as is closes a cycle through C++ (node -> holder ->
        # tensor -> node) that Python's collector cannot see, so every metered step leaked its
        # autograd graph, activations included. Unpacking gets the grad_fn back from autograd's
        # own record. The leaked graph also kept the parameters' AccumulateGrad nodes alive on the
        # stream of the eager step, which made the first CUDA-graph capture fail (docs/pipeline.md).
        holder = _Saved(tensor.detach())
        weakref.finalize(holder, self._release, pointer)
        return holder

    def _release(self, pointer: int) -> None:
        entry = self._live.get(pointer)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live_bytes -= entry[0]
            del self._live[pointer]

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed  # type: ignore[return-value]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context manager to wrap forward passes whose saved tensors should be counted."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def measure_microbatch_bytes(module: nn.Module, inputs: Sequence[torch.Tensor],
                             loss: Callable[[tuple[torch.Tensor, ...]], torch.Tensor] | None = None) -> int:
    """Saved-activation bytes of one forward of `module` on `inputs` (freed again afterwards),
    including what `loss` saves on the last stage.

    The memory model's per-micro-batch size, measured once per stage rather than derived from
    the architecture, so it stays right for any stage module the executor is given. A module
    whose saved bytes depend on the data (MoE routing) may expose `pipeline_memory_bound()`, a
    context manager under which one forward saves the most any input of these shapes would
    (`split.DecoderStage`): the prediction is then an upper bound, which a memory limit needs."""
    meter = SavedTensorMeter(module.parameters())
    prepared = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    bound = getattr(module, "pipeline_memory_bound", None)
    with bound() if bound is not None else contextlib.nullcontext(), meter.hooks():
        outputs = module(*prepared)
        if loss is not None:
            outputs = loss(outputs if isinstance(outputs, tuple) else (outputs,))
    measured = meter.peak_bytes
    del outputs
    return measured


def activation_budget(saved_peak_bytes: int, device: torch.device, pod_memory_bytes: float | None = None,
                      local_ranks: int | None = None) -> int:
    """Bytes of saved activations this rank has room for at a step's peak: the memory limit the
    planner holds each stage's predicted peak against. Call it after a step, with the saved
    peak that step measured.

    On CUDA: what torch can hold (driver-free memory plus its own cache, less HEADROOM_FRACTION
    of the device) minus what is not saved activations at the run's peak (peak allocated minus
    the saved peak: weights, gradients, optimizer state, temporaries; all alike for every k).
    On CPU: this rank's share of the host's available memory (activations are freed after the
    step, so available counts them back) and, with `pod_memory_bytes` (the replica's pod limit,
    `resources.memory`, which the host's figures do not show), the share of the pod not yet in
    this process's resident set, each less HEADROOM_FRACTION. The host's ranks share it:
    `local_ranks`, else torchrun's LOCAL_WORLD_SIZE."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        usable = free + torch.cuda.memory_reserved(device) - HEADROOM_FRACTION * total
        other = torch.cuda.max_memory_allocated(device) - saved_peak_bytes
        # The next call's peak is then its own window's: the process's peak ever held what a
        # larger k's activations (or D-CPT's probes, or a first step's copies) once took, and
        # after a step down to k=1 the budget stayed that much smaller, ruling out the k it ran.
        torch.cuda.reset_peak_memory_stats(device)
        return max(0, int(usable - other))
    ranks = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {ranks}")
    usable = (1.0 - HEADROOM_FRACTION) * _host_available_bytes() / ranks
    if pod_memory_bytes is not None:
        resident = psutil.Process().memory_info().rss
        usable = min(usable, (1.0 - HEADROOM_FRACTION) * pod_memory_bytes / ranks - resident)
    return max(0, int(usable))


def _host_available_bytes() -> int:
    return int(psutil.virtual_memory().available)
