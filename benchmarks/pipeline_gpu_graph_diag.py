"""Do CUDA-graphed stages capture and replay inside a real 2-rank NCCL pipeline? Two checks in
one process per rank, in this order (the order matters, see docs/pipeline.md "CUDA graphs"):

1. tests/pipeline_workers.py's decoder cases with `cuda_graphs=True` (a small float32 decoder,
   then a FusedKV one): whether each stage replayed graphs, and why not if it did not;
2. benchmarks/pipeline_gpu.py's model (bf16, width 2048, 16 micro-batches): per step, whether it
   was graphed and its time (the first step of each table is metered, so eager).

    python3 benchmarks/pipeline_gpu_graph_diag.py        # on nvidia-h200-x2, about 40 s

On 2026-11-30 the first check's first job failed to capture on both ranks
(cudaErrorStreamCaptureInvalidated), its FusedKV job captured and replayed 1F1B and GPipe,
and the benchmark model's graphed 1F1B steps took 147–148 ms (its eager step in that run was
the metered first step, 233 ms, so not a fair comparison)."""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import pipeline_bench
import pipeline_workers as workers

from huorn import models
from huorn.runtime.pipeline import launch, schedules

FUSED = models.ModelConfig(layers=4, width=32, heads=4, vocabulary=64, context=16, kv_sharing="fusedkv")


def worker(rank: int, world: int) -> None:
    jobs = ((dataclasses.replace(FUSED, kv_sharing="none"), [("1f1b", 1)]),
            (FUSED, [("1f1b", 1), ("gpipe", 1)]))
    for cfg, cases in jobs:
        results = workers.decoder_case_worker(rank, world, [("nccl-pp2-graphs", cfg, 2, cases, 8)])
        for key, result in results.items():
            print(f"rank {rank} {cfg.kv_sharing} {key[1:]}: graphed={result['graphed']} "
                  f"note={(result['graph_note'] or '')[:200]}", flush=True)
    config = dataclasses.replace(pipeline_bench.diagnosis_config(False), cuda_graphs=True)
    try:
        setup = pipeline_bench.build_stage(config, rank)
        runner = setup.runner
        runner.negotiate_shapes(setup.inputs[0], setup.labels[0])
        for k in (1, 1, 1, 2, 2):
            table = schedules.build_schedule("kfkb", 2, config.microbatches, k)
            stats = runner.run_step(table, setup.inputs if rank == 0 else None,
                                    setup.labels if rank == 1 else None)
            setup.stage.zero_grad(set_to_none=True)
            print(f"rank {rank} benchmark model k={k}: graphed={stats.graphed} {stats.seconds * 1e3:.1f} ms "
                  f"note={(runner.graph_note or '')[:200]}", flush=True)
    except Exception:
        print(f"rank {rank} failed:", traceback.format_exc()[-2500:], flush=True)
        os._exit(1)


if __name__ == "__main__":
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    launch.run_workers(worker, 2, "nccl", (), timeout_s=60)
