"""Run a function in N local processes that form one torch.distributed world: what tests and
benchmarks use to stand up a pipeline on one machine (pods use torchrun instead).

A FileStore rendezvous avoids picking free ports, which races when several test sessions
share a machine. Each worker's return value comes back through a file, in rank order."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from huorn.runtime.pipeline import topology as pp_topology


def run_workers(fn: Callable[..., Any], world_size: int, backend: str = "gloo", args: tuple = (),
                timeout_s: float = 300.0) -> list[Any]:
    """Call fn(rank, world_size, *args) in `world_size` spawned processes inside an initialised
    process group; return the results (anything torch.save can store) by rank."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    # A fork server imports torch and fn's module once, then forks every worker of every call
    # from that state: a spawned worker imported them afresh, 3-4 s of CPU each, which a test
    # module standing up a dozen small worlds paid for each rank of each. The server forks before
    # any thread or CUDA context exists, so the children start as clean as spawned ones.
    mp.set_forkserver_preload(["torch", "torch.distributed", __name__, fn.__module__])
    with tempfile.TemporaryDirectory(prefix="huorn-pp-") as scratch:
        mp.start_processes(_worker, args=(fn, world_size, backend, scratch, timeout_s, args),
                           nprocs=world_size, join=True, start_method="forkserver")
        return [torch.load(Path(scratch) / f"result-{r}.pt", weights_only=False) for r in range(world_size)]


def _worker(rank: int, fn: Callable[..., Any], world_size: int, backend: str, scratch: str,
            timeout_s: float, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        pp_topology.prefer_eager_module_loading()
        torch.cuda.set_device(rank % torch.cuda.device_count())
    store = dist.FileStore(os.path.join(scratch, "store"), world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(scratch) / f"result-{rank}.pt")
    finally:
        dist.destroy_process_group()
