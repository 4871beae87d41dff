"""Pipeline schedules under network contention on two H200s: NCCL, 2 processes (2 stages),
levels 0/40/80%. The same table as benchmarks/pipeline_cpu.py on a larger bf16 decoder.

    python3 benchmarks/pipeline_gpu.py [--out $OUT] [--budget-s 270] [--quick]
    .venv/bin/python benchmarks/pipeline_gpu.py --tiny --out runs/pipeline_gpu_dry   # CPU dry run

Run through the device tool on nvidia-h200-x2 (see docs/benchmarks.md for the exact call).
NCCL_NVLS_ENABLE=0 stays set: NVLink multicast must not be used on those machines.

A device call is short and a hang used to eat all of it, so the run is fenced three ways:
each level stops its rounds after `--level-budget-s`, rank 0 rewrites the partial JSON after
every level, and a watchdog here ends the workers after `--budget-s` and turns whatever levels
finished into the JSON, table and PNG (named pipeline_gpu_partial.*), after the workers
printed their stacks. `--tiny` runs the same code over gloo on the CPU with a small model,
to check before spending device time that nothing else hangs."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
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
    parser.add_argument("--tiny", action="store_true", help="gloo on the CPU with a small model (dry run)")
    parser.add_argument("--budget-s", type=float, default=270.0, help="watchdog: end the workers after this")
    parser.add_argument("--level-budget-s", type=float, default=65.0, help="stop a level's rounds after this")
    parser.add_argument("--rounds", type=int, default=10, help="measured rounds per level (2 steps each)")
    parser.add_argument("--p2p-max-ctas", type=int, default=None,
                        help="NCCL thread blocks of the executor's edge communicators (default: NCCL's)")
    parser.add_argument("--p2p-high-priority", action="store_true",
                        help="put the executor's edge communicators on high-priority streams")
    parser.add_argument("--no-lockstep", action="store_true", help="leave out 1F1B in lockstep")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run our stages eagerly (by default they replay CUDA graphs, as a "
                             "TrainingJob's do, and an eager 1F1B runs beside them for comparison)")
    parser.add_argument("--adaptive-comm", choices=("overlap", "auto"), default="overlap",
                        help="auto: adaptive k also measures lockstep exchanges against overlapped links")
    args = parser.parse_args()
    if args.p2p_max_ctas is not None and args.p2p_max_ctas < 1:
        parser.error("--p2p-max-ctas must be >= 1")
    if args.budget_s <= 0 or args.level_budget_s <= 0:
        parser.error("--budget-s and --level-budget-s must be > 0 (seconds)")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[name] = value  # the spawned workers inherit them
    # The 2026-11-30 H200 run hung in the first backward on both ranks. With lazy module
    # loading (CUDA's default), the first launch of a kernel waits for the GPU to drain, and
    # the executor's receives posted ahead for later micro-batches never drain: their sends
    # need this very backward. Loading every kernel at start removes that wait (untested on
    # GPU so far; docs/benchmarks.md, pipeline section).
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    config = build_config(args)
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    outcome: dict = {}
    thread = threading.Thread(target=run_into, args=(outcome, config), daemon=True)
    thread.start()
    thread.join(args.budget_s)
    if "result" in outcome:
        result, name = outcome["result"][0], "pipeline_gpu"
    else:
        reason = (repr(outcome["error"]) if "error" in outcome
                  else f"still running after {args.budget_s:.0f} s")
        print(f"pipeline_gpu: workers failed or hung ({reason}); writing the levels that finished",
              file=sys.stderr)
        end_workers(grace_s=5.0)
        result, name = read_partial(Path(config.partial_path)), "pipeline_gpu_partial"
        result["error"] = reason
    result["wall_s"] = time.time() - started
    table = ""
    if result["levels"]:
        title = f"Pipeline throughput on {config.machine}, by contention"
        table = pipeline_bench.write_outputs(result, args.out, name, title)
    else:
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"torch {result.get('torch_version')}; burst {result.get('burst_s', 0.0) * 1e3:.3f} ms "
          f"(compute F+B {result.get('compute_fb_s', 0.0) * 1e3:.3f} ms), wall {result['wall_s']:.0f} s")
    for level in result["levels"]:
        print(f"level {level['level']:.0%}: {level['measured_rounds']} measured rounds")
    print(table)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if name == "pipeline_gpu" else 3)  # a hung worker thread must not keep us alive


def build_config(args: argparse.Namespace) -> pipeline_bench.BenchConfig:
    quick = args.quick or args.tiny
    common = dict(stages=2, steps=3 if quick else args.rounds, warmup=2 if quick else 3,
                  partial_path=str(args.out / "pipeline_gpu_partial.json"),
                  level_budget_s=args.level_budget_s, hang_dump_s=max(args.budget_s - 10.0, 1.0),
                  p2p_max_ctas=args.p2p_max_ctas, p2p_high_priority=args.p2p_high_priority,
                  lockstep=not args.no_lockstep, adaptive_comm=args.adaptive_comm,
                  cuda_graphs=not args.no_cuda_graphs and not args.tiny)
    if args.tiny:
        return pipeline_bench.BenchConfig(
            backend="gloo", model=models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8),
            micro_batch=2, microbatches=8, machine="CPU dry run, gloo, 2 processes", **common)
    import torch

    return pipeline_bench.BenchConfig(
        backend="nccl",
        model=models.ModelConfig(layers=8, width=2048, heads=16, vocabulary=32768, context=1024),
        micro_batch=2, microbatches=16, dtype="bfloat16",
        machine=f"2× {torch.cuda.get_device_name(0)}, NCCL, 2 processes", **common)


def run_into(outcome: dict, config: pipeline_bench.BenchConfig) -> None:
    try:
        outcome["result"] = launch.run_workers(pipeline_bench.bench_worker, config.stages, config.backend,
                                               (config,), timeout_s=900)
    except BaseException as error:  # reported by main, which still writes what finished
        outcome["error"] = error


def end_workers(grace_s: float) -> None:
    """SIGTERM, then SIGKILL, the spawned workers (their faulthandler already printed stacks)."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    deadline = time.time() + grace_s
    for child in children:
        child.join(max(deadline - time.time(), 0.1))
        if child.is_alive():
            child.kill()


def read_partial(path: Path) -> dict:
    if not path.exists():
        return {"levels": []}
    return json.loads(path.read_text())


if __name__ == "__main__":
    main()
