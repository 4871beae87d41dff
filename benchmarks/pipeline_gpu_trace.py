"""Is a pipeline step host-bound, and where does the compute stream sit idle? One question for
the 2×H200 gap at 0% contention between Huorn's 1F1B (overlapped links, and lockstep
exchanges) and torch's Schedule1F1B, on the model of benchmarks/pipeline_gpu.py.

    python3 benchmarks/pipeline_gpu_trace.py --out $OUT        # on nvidia-h200-x2
    .venv/bin/python benchmarks/pipeline_gpu_trace.py --tiny   # CPU dry run (gloo)

Per rank and configuration it records the host time until the step's Python returns (before
any synchronisation) against the whole step, and one torch.profiler chrome trace (gzipped) of
a step, from which `summarise_trace` takes the compute stream's busy time and its idle gaps."""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_bench
import torch.distributed as dist

from huorn.runtime.pipeline import launch, schedules


def worker(rank: int, world: int, config: pipeline_bench.BenchConfig, steps: int, out: str) -> dict:
    setup = pipeline_bench.build_stage(config, rank)
    device, topo, stage, runner = setup.device, setup.topo, setup.stage, setup.runner
    tokens, targets, inputs, labels = setup.tokens, setup.targets, setup.inputs, setup.labels
    on_gpu = device.type == "cuda"
    runner.negotiate_shapes(inputs[0], labels[0])
    torch_schedule = pipeline_bench.build_torch_schedule("Schedule1F1B", stage, topo, config, device)
    table = schedules.build_schedule("1f1b", config.stages, config.microbatches)

    def ours(comm: str) -> Callable[[], None]:
        def step() -> None:
            runner.run_step(table, inputs if topo.is_first else None, labels if topo.is_last else None,
                            comm=comm)
        return step

    configs = {"huorn 1F1B overlap": ours("overlap"), "huorn 1F1B lockstep": ours("lockstep"),
               "torch Schedule1F1B": pipeline_bench.torch_stepper(torch_schedule, topo, tokens, targets)}
    host: dict[str, list[float]] = {n: [] for n in configs}
    total: dict[str, list[float]] = {n: [] for n in configs}
    for round_ in range(steps + 1):
        for name, step in configs.items():
            for repeat in range(2):  # the first step after a switch is a warm-up
                pipeline_bench.synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                step()
                returned = time.perf_counter()
                pipeline_bench.synchronize(device)
                ended = time.perf_counter()
                stage.zero_grad(set_to_none=True)
                if round_ and repeat:
                    host[name].append(returned - start)
                    total[name].append(ended - start)
    result = {"rank": rank, "host_s": {n: statistics.median(v) for n, v in host.items()},
              "step_s": {n: statistics.median(v) for n, v in total.items()}, "traces": {}}
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    for name, step in configs.items():
        step()
        stage.zero_grad(set_to_none=True)
        pipeline_bench.synchronize(device)
        dist.barrier()
        with profile(activities=activities) as prof:
            step()
            pipeline_bench.synchronize(device)
        stage.zero_grad(set_to_none=True)
        dist.barrier()
        path = Path(out) / f"trace_rank{rank}_{name.replace(' ', '_')}.json"
        prof.export_chrome_trace(str(path))
        with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
            packed.write(raw.read())
        path.unlink()
        result["traces"][name] = summarise_trace(f"{path}.gz")
    runner.close()
    return result


def summarise_trace(path: str, gap_us: float = 20.0) -> dict:
    """Busy time, idle gaps and kernel count of the stream that ran the most kernel time."""
    with gzip.open(path, "rt") as handle:
        events = json.load(handle)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return {"kernels": 0}
    by_stream: dict[int, list[dict]] = {}
    for e in kernels:
        by_stream.setdefault(int(e.get("args", {}).get("stream", -1)), []).append(e)
    busy = {s: sum(float(e["dur"]) for e in ks) for s, ks in by_stream.items()}
    streams = {s: {"kernels": len(ks), "busy_ms": busy[s] / 1e3,
                   "nccl_ms": sum(float(e["dur"]) for e in ks if "nccl" in e["name"].lower()) / 1e3}
               for s, ks in by_stream.items()}
    compute = max((s for s in by_stream if streams[s]["nccl_ms"] < 0.5 * streams[s]["busy_ms"]),
                  key=lambda s: busy[s], default=max(busy, key=busy.get))
    ordered = sorted(by_stream[compute], key=lambda e: float(e["ts"]))
    first, last = float(ordered[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in ordered)
    gaps = [float(b["ts"]) - (float(a["ts"]) + float(a["dur"])) for a, b in itertools.pairwise(ordered)]
    big = sorted((g for g in gaps if g > gap_us), reverse=True)
    return {"compute_stream": compute, "span_ms": (last - first) / 1e3, "busy_ms": busy[compute] / 1e3,
            "idle_ms": sum(g for g in gaps if g > 0) / 1e3, "gaps_over_20us": len(big),
            "gaps_over_20us_ms": sum(big) / 1e3, "largest_gaps_us": [round(g) for g in big[:12]],
            "streams": streams}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/pipeline_gpu_trace"))
    parser.add_argument("--steps", type=int, default=6, help="measured rounds (one timed step each)")
    parser.add_argument("--tiny", action="store_true", help="gloo on the CPU with a small model (dry run)")
    args = parser.parse_args()
    config = pipeline_bench.diagnosis_config(args.tiny)
    args.out.mkdir(parents=True, exist_ok=True)
    results = launch.run_workers(worker, 2, config.backend, (config, args.steps, str(args.out)),
                                 timeout_s=400)
    (args.out / "pipeline_gpu_trace.json").write_text(json.dumps(results, indent=2))
    for result in results:
        print(f"--- rank {result['rank']}")
        for name in result["step_s"]:
            trace = result["traces"][name]
            print(f"{name:22s} step {result['step_s'][name] * 1e3:7.1f} ms, host returns at "
                  f"{result['host_s'][name] * 1e3:7.1f} ms; traced compute stream: busy "
                  f"{trace.get('busy_ms', 0):.1f} of {trace.get('span_ms', 0):.1f} ms, "
                  f"{trace.get('gaps_over_20us', 0)} gaps > 20 us = "
                  f"{trace.get('gaps_over_20us_ms', 0):.1f} ms, "
                  f"largest {trace.get('largest_gaps_us', [])[:6]}")


if __name__ == "__main__":
    main()
