"""Measure real data-parallel step times (torch DDP over gloo, CPU) for the performance model's test.

Each configuration (replicas × local batch) runs a small transformer encoder under
DistributedDataParallel in real processes, times a window of steps after warm-up, and records the
median step time. The CSV it writes (tests/data/ddp_step_times.csv) is the telemetry the perf model
is fitted on in tests/test_scheduler_perfmodel.py; held-out configurations check its predictions.

One core per replica stands in for one GPU per replica, so a host needs at least as many cores
as the largest world: the 2-core VM measures 1 and 2 replicas (and the two share its cores), a
16-core host up to 12 with cores to spare for the rest of the machine. The second file, of whole
replica counts held out, is what tells whether the fit extrapolates to a larger gang, which is
what the allocator asks of it.

    .venv/bin/python benchmarks/measure_step_times.py --output tests/data/ddp_step_times.csv
    python3 benchmarks/measure_step_times.py --worlds 1,2,3,4,6,8,12 \\
        --output benchmarks/results/ddp_step_times_16core/run1.csv    # a 16-core host; and again
    .venv/bin/python benchmarks/measure_step_times.py \\
        --median-of benchmarks/results/ddp_step_times_16core/*.csv \\
        --output tests/data/ddp_step_times_16core.csv

The median of several runs: on a host whose cores are shared with other tenants one run of a
configuration came out up to 1.65 times another (the 16-core host of 2026-12-07, five runs).
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
from rich.progress import Progress
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
    cores = os.cpu_count() or 1
    if max(worlds) > cores:
        raise SystemExit(f"--worlds: {max(worlds)} replicas need as many cores, this host has {cores}; "
                         "measure fewer replicas here, or on a larger host")
    ctx = mp.get_context("spawn")
    rows: list[tuple[int, int, float]] = []
    with Progress() as progress:
        task = progress.add_task("configurations", total=len(worlds) * len(batches))
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
                    progress.advance(task)
                for p in procs:
                    p.join(timeout=120)
    return rows


def median_of(paths: list[Path]) -> list[tuple[int, int, float]]:
    """Each configuration's median step time over several runs' CSVs (same columns as written)."""
    times: dict[tuple[int, int], list[float]] = {}
    for path in paths:
        with path.open(newline="") as fh:
            for row in csv.DictReader(fh):
                times.setdefault((int(row["replicas"]), int(row["local_batch"])), []).append(
                    float(row["step_time_s"]))
    return [(world, batch, statistics.median(seconds)) for (world, batch), seconds in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("tests/data/ddp_step_times.csv"))
    parser.add_argument("--worlds", default="1,2")
    parser.add_argument("--batches", default="2,4,6,8,12,16,24,32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--median-of", type=Path, nargs="+", metavar="CSV",
                        help="measure nothing: write each configuration's median over these runs")
    args = parser.parse_args()
    if args.median_of:
        rows = median_of(args.median_of)
    else:
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
