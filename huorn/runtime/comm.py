"""Every collective the trainer issues goes through here, so each one gets a sequence number,
a duration and a chance to be slowed or hung by fault injection.

DDP's gradient all-reduce is wrapped with a communication hook. The hook SUMs instead of DDP's
default average: the loss of each micro-batch is already divided by the number of micro-batches
in the whole global batch, so the sum is the exact global-batch mean even when ranks compute
unequal numbers of micro-batches (which happens whenever the world size does not divide them).
The hook also records squared gradient norms before and after the reduction, the two inputs of
the gradient noise scale.

A pipeline stage's traffic (receives from its neighbours, waiting for its sends to deliver, the
data-parallel gradient all-reduce) bypasses these wrappers, on paths the executor owns; it counts
through a `StepLedger` instead, with the neighbour it waits for named.
"""

# NB: no `from __future__ import annotations` here: DDP inspects the hook's annotations at
# registration and refuses a bucket annotated with the string "dist.GradBucket".
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from huorn.runtime import faults, telemetry


@dataclass
class GradientNorms:
    """Squared norms summed over DDP buckets during one step's synchronising backward pass."""

    local_sq: float = 0.0
    global_sq: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, local_sq: float = 0.0, global_sq: float = 0.0) -> None:
        with self._lock:
            self.local_sq += local_sq
            self.global_sq += global_sq

    def take(self) -> tuple[float, float]:
        with self._lock:
            values = (self.local_sq, self.global_sq)
            self.local_sq = self.global_sq = 0.0
        return values


@dataclass
class HookState:
    telemetry: telemetry.Telemetry
    injector: faults.FaultInjector
    norms: GradientNorms = field(default_factory=GradientNorms)


def allreduce_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: tracked, fault-injectable SUM all-reduce of one gradient bucket."""
    buffer = bucket.buffer()
    seq = state.telemetry.enter_collective("allreduce")
    state.norms.add(local_sq=float(buffer.float().pow(2).sum()))
    state.injector.inside_collective()
    future = dist.all_reduce(buffer, op=dist.ReduceOp.SUM, async_op=True).get_future()

    def finish(done: torch.futures.Future) -> torch.Tensor:
        reduced = done.value()[0]
        state.norms.add(global_sq=float(reduced.float().pow(2).sum()))
        state.telemetry.complete_collective(seq)
        return reduced

    return future.then(finish)


def all_reduce(tensor: torch.Tensor, state: HookState, op: str = "allreduce",
               reduce_op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Tracked explicit all-reduce (in place); a no-op without a process group."""
    if not dist.is_initialized():
        return tensor
    seq = state.telemetry.enter_collective(op)
    state.injector.inside_collective()
    dist.all_reduce(tensor, op=reduce_op)
    state.telemetry.complete_collective(seq)
    return tensor


def barrier(state: HookState) -> None:
    """Tracked barrier. NB: gloo's barrier is an all-reduce underneath; counting it keeps every
    rank's sequence numbers aligned, which the hang detectors rely on."""
    if not dist.is_initialized():
        return
    seq = state.telemetry.enter_collective("barrier")
    state.injector.inside_collective()
    dist.barrier()
    state.telemetry.complete_collective(seq)


def broadcast_object(value: object, state: HookState, src: int = 0) -> object:
    """Tracked broadcast of a picklable object from `src`."""
    if not dist.is_initialized():
        return value
    seq = state.telemetry.enter_collective("broadcast")
    state.injector.inside_collective()
    box = [value]
    dist.broadcast_object_list(box, src=src)
    state.telemetry.complete_collective(seq)
    return box[0]


def broadcast_tensor(tensor: torch.Tensor, src: int, device: torch.device) -> None:
    """Broadcast `tensor` in place from `src`, through `device` when it lives elsewhere: NCCL
    moves only GPU tensors, and an optimizer keeps some state (AdamW's `step`) on the CPU."""
    if tensor.device == device:
        dist.broadcast(tensor, src=src)
        return
    staged = tensor.to(device)
    dist.broadcast(staged, src=src)
    tensor.copy_(staged)


class StepLedger:
    """Telemetry accounting for a pipeline stage's blocking operations.

    Each operation (`run`) enters a collective sequence number before it blocks and completes it
    after, naming the `peer` it waits for when there is one, so a stage stuck on a hung
    neighbour shows `entered > completed` and `waiting_on` in `/telemetry`. Its wait is not
    added to the step's communication seconds: the executor measures those itself (receive,
    send and reduce waits apart, which the fail-slow detector needs).

    NB: the hang detector compares sequence numbers across ranks, but stages do not issue the
    same operations (a middle stage receives from both sides, an end stage from one; S2 gives
    replicas unequal tables). So every stage counts at most `allotment` operations in a phase
    (`begin`) and pads to it when the phase ends (`end`): at phase boundaries every rank's
    numbers agree, as in a DDP gang. Without telemetry (benchmarks, tests) it counts nothing."""

    def __init__(self, tel: telemetry.Telemetry | None) -> None:
        self.telemetry = tel
        self._allotment = 0
        self._used = 0

    def begin(self, allotment: int) -> None:
        self._allotment, self._used = allotment, 0

    def run(self, op: str, peer: int | None, action: Callable[[], object]) -> None:
        """Call `action` (a blocking wait) as one counted operation."""
        tel = self.telemetry
        if tel is None:
            action()
            return
        if self._used >= self._allotment:
            raise RuntimeError(f"{op}: operation {self._used + 1} of a phase allotted {self._allotment}; "
                               "the ranks' collective sequence numbers would drift apart")
        self._used += 1
        seq = tel.enter_collective(op, peer)
        try:
            action()
        finally:
            tel.complete_collective(seq, count_seconds=False)

    def once(self, op: str, peer: int | None, action: Callable[[], object]) -> None:
        """A phase of one operation that every rank runs (a collective)."""
        self.begin(1)
        self.run(op, peer, action)
        self.end()

    def end(self) -> None:
        """Pad this phase's count to its allotment."""
        if self.telemetry is not None:
            self.telemetry.skip_collectives(self._allotment - self._used)
        self._allotment = self._used = 0


def init_process_group(backend: str, timeout_s: float) -> tuple[int, int, int]:
    """Join the gang described by torchrun's environment, or form a world of one without it (an
    in-memory store), so DDP, the hook and DCP take the same path in both cases.
    Returns (rank, world_size, local_rank)."""
    timeout = timedelta(seconds=timeout_s)
    if "RANK" not in os.environ:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timeout)
    else:
        dist.init_process_group(backend=backend, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0"))
