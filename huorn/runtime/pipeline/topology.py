"""Where a rank sits in DP × PP and the process groups it talks through.

Ranks are laid out replica-major: rank = replica · stages + stage, so the stages of one
pipeline are neighbours (on one host they share the fastest links) and the data-parallel
peers of a stage are `stages` apart.

Each pipeline edge gets two groups, one per direction. With NCCL, point-to-point calls on
one communicator run in order on one stream, so activations going up and gradients coming
down on the same communicator could wait on each other; a communicator per direction keeps
both flowing, and gloo is happy either way.

NB: NCCL creates a group's communicator on its first call, and that creation blocks until
both ranks make it. Left to the first real message it deadlocks: stage 0 would block creating
the gradient communicator while posting its receives, before sending the activation that
stage 1 needs before it ever sends a gradient. So `build_groups` exchanges one number on every
group right away, in creation order, which is a chain (each rank meets its lower neighbour
before its upper one) and so cannot wait in a cycle."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class PipelineTopology:
    stages: int
    replicas: int
    rank: int

    def __post_init__(self) -> None:
        if self.stages < 1 or self.replicas < 1:
            raise ValueError(f"stages and replicas must be >= 1, got {self.stages} and {self.replicas}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size} "
                             f"(= replicas {self.replicas} × stages {self.stages})")

    @property
    def world_size(self) -> int:
        return self.stages * self.replicas

    @property
    def stage(self) -> int:
        return self.rank % self.stages

    @property
    def replica(self) -> int:
        return self.rank // self.stages

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def global_rank(self, replica: int, stage: int) -> int:
        return replica * self.stages + stage


@dataclass
class PipelineGroups:
    """The groups this rank uses (None where it has no such neighbour)."""

    to_next: dist.ProcessGroup | None = None  # activations to stage + 1
    from_previous: dist.ProcessGroup | None = None  # activations from stage − 1
    to_previous: dist.ProcessGroup | None = None  # gradients to stage − 1
    from_next: dist.ProcessGroup | None = None  # gradients from stage + 1
    pipeline: dist.ProcessGroup | None = None  # all stages of this replica: lockstep exchanges
    data_parallel: dist.ProcessGroup | None = None


def build_groups(topology: PipelineTopology, *, p2p_max_ctas: int | None = None,
                 p2p_high_priority: bool = False,
                 timeout: datetime.timedelta | None = None) -> PipelineGroups:
    """Create every group in the same order on every rank (dist.new_group is collective).

    `timeout` bounds each of the groups' operations, as the trainer's collectiveTimeoutS bounds
    the default group's: torch gives a new group its backend's default instead (30 minutes on
    gloo, 10 on NCCL), and every send, receive and data-parallel all-reduce of a pipeline runs on
    these groups, so a hung stage held its neighbours that long where a DDP job failed in 120 s.

    On NCCL, `p2p_max_ctas` caps the thread blocks of the pipeline edges' communicators and
    `p2p_high_priority` puts their streams ahead of compute. NB: a send or receive kernel
    spins on its SMs until the peer arrives, and in a pipeline it usually waits a whole
    action for it, so by default it takes SMs from the stage's own compute for that long;
    a message is only megabytes, which NVLink carries as fast with a few blocks."""
    if dist.get_world_size() != topology.world_size:
        raise ValueError(f"world size {dist.get_world_size()} != replicas × stages = {topology.world_size}")
    if p2p_max_ctas is not None and p2p_max_ctas < 1:
        raise ValueError(f"p2p_max_ctas must be >= 1 (thread blocks), got {p2p_max_ctas}")
    options = _p2p_options(p2p_max_ctas, p2p_high_priority)
    mine = PipelineGroups()
    me = topology.rank
    for replica in range(topology.replicas):
        for stage in range(topology.stages - 1):
            low, high = topology.global_rank(replica, stage), topology.global_rank(replica, stage + 1)
            forward = dist.new_group([low, high], pg_options=options, timeout=timeout)
            backward = dist.new_group([low, high], pg_options=options, timeout=timeout)
            if me == low:
                mine.to_next, mine.from_next = forward, backward
            elif me == high:
                mine.from_previous, mine.to_previous = forward, backward
            if me in (low, high):
                _connect(forward, sender=low, receiver=high, me=me)
                _connect(backward, sender=high, receiver=low, me=me)
    if topology.stages > 1:
        # one communicator for a replica's whole pipeline, as torch.distributed.pipelining uses:
        # a lockstep exchange batches operations towards both neighbours into one NCCL group
        for replica in range(topology.replicas):
            members = [topology.global_rank(replica, stage) for stage in range(topology.stages)]
            group = dist.new_group(members, pg_options=options, timeout=timeout)
            if me in members:
                mine.pipeline = group
                _connect_both_ways(group, topology, me)
    if topology.replicas > 1:
        for stage in range(topology.stages):
            members = [topology.global_rank(r, stage) for r in range(topology.replicas)]
            group = dist.new_group(members, timeout=timeout)
            if me in members:
                mine.data_parallel = group
                dist.all_reduce(torch.zeros(1, device=_device()), group=group)
    if dist.get_backend() == "nccl":
        torch.cuda.synchronize()
    return mine


def _p2p_options(max_ctas: int | None, high_priority: bool) -> object | None:
    """NCCL options for the edge communicators, or None (the defaults; always so on gloo)."""
    if dist.get_backend() != "nccl" or (max_ctas is None and not high_priority):
        return None
    options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    if max_ctas is not None:
        options.config.max_ctas = max_ctas
        options.config.min_ctas = 1
    return options


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _connect(group: dist.ProcessGroup, sender: int, receiver: int, me: int) -> None:
    """One number from sender to receiver, so the communicator exists before real traffic."""
    probe = torch.zeros(1, device=_device())
    if me == sender:
        dist.send(probe, dst=receiver, group=group)
    else:
        dist.recv(probe, src=sender, group=group)


def _connect_both_ways(group: dist.ProcessGroup, topology: PipelineTopology, me: int) -> None:
    """One batched exchange with each neighbour, in both directions, before any step.

    NB: NCCL connects a peer lazily, on the first operation in each direction, and that set-up
    blocks the host in the batched call until the peer's host joins it. In a lockstep GPipe
    step, stage 0 first receives a gradient in the batch that sends its last activation; stage
    1 meanwhile sat in a host-blocking copy (a CPU target moved to the GPU) that waited for that
    very activation, so neither host moved (2×H200, 2026-11-30). With every direction connected
    here, a step never sets up a connection."""
    stage, replica = topology.stage, topology.replica
    peers = [topology.global_rank(replica, s) for s in (stage - 1, stage + 1) if 0 <= s < topology.stages]
    outgoing = [torch.zeros(1, device=_device()) for _ in peers]
    incoming = [torch.zeros(1, device=_device()) for _ in peers]
    ops = [dist.P2POp(dist.isend, t, peer, group=group) for t, peer in zip(outgoing, peers, strict=True)]
    ops += [dist.P2POp(dist.irecv, t, peer, group=group) for t, peer in zip(incoming, peers, strict=True)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def prefer_eager_module_loading() -> None:
    """Ask CUDA to load every kernel when the context starts, not at first launch.

    Must run before the process's first CUDA call. Lazy loading waits for the device, and a
    pipeline stage always has NCCL receives waiting on the device for its peer (see
    StageExecutor._warm_up_backward); an explicit setting by the user wins."""
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
