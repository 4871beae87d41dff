"""Pipeline schedules under network contention on two H200s: NCCL, 2 processes (2 stages),
levels 0/40/80%. The same table as benchmarks/pipeline_cpu.py on a larger bf16 decoder.

    python3 benchmarks/pipeline_gpu.py [--out $OUT] [--quick]

Run through the device tool on nvidia-h200-x2 (see docs/benchmarks.md for the exact call).
NCCL_NVLS_ENABLE=0 stays set: NVLink multicast must not be used on those machines."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_bench

from huorn import models
from huorn.runtime.pipeline import launch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/pipeline_gpu"))
    parser.add_argument("--quick", action="store_true", help="fewer steps, for a smoke run")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch

    config = pipeline_bench.BenchConfig(
        backend="nccl", stages=2,
        model=models.ModelConfig(layers=8, width=2048, heads=16, vocabulary=32768, context=1024),
        micro_batch=2, microbatches=16, steps=3 if args.quick else 10, warmup=2 if args.quick else 3,
        dtype="bfloat16", machine=f"2× {torch.cuda.get_device_name(0)}, NCCL, 2 processes",
        partial_path=str(args.out / "pipeline_gpu_partial.json"),
    )
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    results = launch.run_workers(pipeline_bench.bench_worker, config.stages, "nccl", (config,), timeout_s=900)
    result = results[0]
    result["wall_s"] = time.time() - started
    table = pipeline_bench.write_outputs(result, args.out, "pipeline_gpu",
                                         "Pipeline throughput on 2× H200 (NCCL, 2 stages), by contention")
    print(f"burst {result['burst_s'] * 1e3:.3f} ms (compute F+B {result['compute_fb_s'] * 1e3:.3f} ms), "
          f"wall {result['wall_s']:.0f} s")
    print(table)


if __name__ == "__main__":
    main()
