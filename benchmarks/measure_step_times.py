"""Measure real data-parallel step times (torch DDP over gloo, CPU) for the performance model's test.

Each configuration (replicas × local batch) runs a small transformer encoder under
DistributedDataParallel in real processes, times a window of steps after warm-up, and records the
median step time. The CSV it writes (tests/data/ddp_step_times.csv) is the telemetry the perf model
is fitted on in tests/test_scheduler_perfmodel.py; held-out configurations check its predictions.

    .venv/bin/python benchmarks/measure_step_times.py --output tests/data/ddp_step_times.csv
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

WIDTH = 128
LAYERS = 2
SEQ = 32


def build_model() -> nn.Module:
    layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH, batch_first=True)
    encoder = nn.TransformerEncoder(layer, LAYERS)
    return nn.Sequential(nn.Embedding(256, WIDTH), encoder, nn.Linear(WIDTH, 256))


def run_worker(
    rank: int, world: int, init_file: str, batches: list[int], steps: int, queue: mp.Queue
) -> None:
    torch.set_num_threads(1)  # one core per replica, like one GPU per replica
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(build_model())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    for batch in batches:
        x = torch.randint(0, 256, (batch, SEQ))
        times = []
        for step in range(steps + 3):
            dist.barrier()
            start = time.perf_counter()
            out = model(x)
            loss = loss_fn(out.reshape(-1, 256), x.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step >= 3:  # the first steps build DDP buckets and warm caches
                times.append(time.perf_counter() - start)
        # The slowest rank sets the pace of a synchronous step.
        slowest = torch.tensor([statistics.median(times)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if rank == 0:
            queue.put((world, batch, float(slowest)))
    dist.destroy_process_group()


def measure(worlds: list[int], batches: list[int], steps: int) -> list[tuple[int, int, float]]:
    ctx = mp.get_context("spawn")
    rows: list[tuple[int, int, float]] = []
    for world in worlds:
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            init_file = os.path.join(tmp, "rdzv")
            procs = [ctx.Process(target=run_worker, args=(r, world, init_file, batches, steps, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            for _ in batches:
                rows.append(queue.get(timeout=600))
            for p in procs:
                p.join(timeout=120)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("tests/data/ddp_step_times.csv"))
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--batches", default="2,4,6,8,12,16,24,32")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    rows = measure([int(w) for w in args.worlds.split(",")], [int(b) for b in args.batches.split(",")],
                   args.steps)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["model_family", "params_b", "gpu_type", "replicas", "nodes", "local_batch",
                         "step_time_s"])
        for world, batch, seconds in sorted(rows):
            writer.writerow(["transformer-tiny", f"{WIDTH * WIDTH * 12 * LAYERS / 1e9:.6f}", "cpu",
                             world, 1, batch, f"{seconds:.6f}"])
    print(f"wrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
