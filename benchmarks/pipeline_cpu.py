"""Pipeline schedules under network contention on CPU: gloo, 4 processes (4 stages), levels
0/40/80%. Huorn's 1F1B, each fixed k, adaptive k, and torch.distributed.pipelining's
Schedule1F1B and ScheduleGPipe on the same decoder, in one run.

    .venv/bin/python benchmarks/pipeline_cpu.py [--out runs/pipeline_cpu] [--quick]

Writes <out>/pipeline_cpu.{json,md,png} (pipeline_cpu_<S>stages.* with --stages S); the table
is what docs/benchmarks.md quotes."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_bench

from huorn import models
from huorn.runtime.pipeline import launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/pipeline_cpu"))
    parser.add_argument("--quick", action="store_true", help="fewer steps, for a smoke run")
    parser.add_argument("--stages", type=int, default=4, help="processes = pipeline stages (default 4)")
    args = parser.parse_args()
    config = pipeline_bench.BenchConfig(
        backend="gloo", stages=args.stages,
        model=models.ModelConfig(layers=4, width=128, heads=4, vocabulary=256, context=32),
        micro_batch=4, microbatches=16, steps=2 if args.quick else 6, warmup=1 if args.quick else 2,
        machine=f"2-core CPU VM, gloo, {args.stages} processes",
    )
    started = time.time()
    results = launch.run_workers(pipeline_bench.bench_worker, args.stages, "gloo", (config,), timeout_s=1500)
    result = results[0]
    result["wall_s"] = time.time() - started
    name = "pipeline_cpu" if args.stages == 4 else f"pipeline_cpu_{args.stages}stages"
    title = f"Pipeline throughput on CPU (gloo, {args.stages} stages), by contention"
    table = pipeline_bench.write_outputs(result, args.out, name, title)
    print(f"burst {result['burst_s'] * 1e3:.2f} ms (compute F+B {result['compute_fb_s'] * 1e3:.2f} ms), "
          f"wall {result['wall_s']:.0f} s")
    print(table)


if __name__ == "__main__":
    main()
