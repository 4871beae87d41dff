"""Where a serving replica's decoding step goes: the model's forward pass, choosing the tokens,
and the bookkeeping around them, for a running batch of `--rows` rows.

The continuous-batching benchmark measured 78-97 ms between two tokens of a 24-layer, width-1024
model in bf16 on an H100 (benchmarks/serving_continuous_batching.py, docs/benchmarks.md), where a
step that reads 0.7 GB of weights should take a few milliseconds. This splits the step, each part
timed with the device synchronised around it, and prints torch.profiler's busiest operators, so
the fix goes where the time is. No HTTP, no client: the `RunningBatch` the replica's decoding
thread drives, on the model `serve.load_model` would build. Each row count runs eagerly (each
kernel launched from Python) and as Huorn runs it, replaying CUDA graphs
(huorn.runtime.decode_graphs; on a CPU the same fixed-shape step, eagerly); with `--baseline`
also eagerly with cuDNN's attention allowed (as before the fix in huorn/models/attention.py).

    .venv/bin/python benchmarks/serving_decode_step.py [--device cpu|cuda] [--rows 8,24,64]
        [--prompt 200] [--steps 30] [--architecture layers=4,width=256,heads=8,context=1024] [--baseline]
        [--joins 1,4,16] [--chunk 2048]

With `--joins`, prompts joining the running batch are timed too, split into their admission, the
prefill's forward passes (padded together on a GPU) and their seating in the batch's rows: what a
continuous-batching replica pays whenever requests arrive.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

import torch
from serving_continuous_batching import ARCHITECTURE, parse_architecture
from trainer_runs import argument_parser, write_report

from huorn import models
from huorn.api import training
from huorn.models import attention
from huorn.runtime import config as run_config
from huorn.runtime import continuous_batching, prefix_cache, serve


def timed(device: torch.device, work: Callable[[], object]) -> float:
    """Seconds of `work`, the device synchronised before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


async def measure(args, rows: int, setting: str, fixed_steps: bool | None) -> dict:  # type: ignore[no-untyped-def]
    device = torch.device(args.device)
    spec = training.ModelSpec.model_validate(args.architecture)
    torch.manual_seed(0)
    model = models.build_model(run_config.build_model_config(spec)).eval().requires_grad_(False)
    model = model.to(device=device, dtype=serve.serving_dtype(device))
    max_length = spec.context
    joins = [int(k) for k in args.joins.split(",") if k]
    running = continuous_batching.RunningBatch(model, prefix_cache.PrefixCache(0), max_length,
                                               rows + max(joins, default=0), fixed_steps=fixed_steps)
    generator = torch.Generator().manual_seed(rows)
    requests = [continuous_batching.Request(
        torch.randint(32, 127, (args.prompt,), generator=generator).tolist(), max_length - args.prompt,
        0.0, i) for i in range(rows)]
    running.admit(requests)
    running.prefill()
    for _ in range(3):  # warm-up: kernels chosen, allocator filled
        running.step()
        running.feed()
    parts: dict[str, list[float]] = {"forward (feed)": [], "choose": [], "step bookkeeping": []}
    results_joins: list[dict] = []
    for _ in range(args.steps):
        choose = timed(device, running.choose)
        step = timed(device, running.step)  # chooses again, then the answers' bookkeeping
        parts["choose"].append(choose)
        parts["step bookkeeping"].append(max(0.0, step - choose))
        parts["forward (feed)"].append(timed(device, running.feed))
    # prompts joining the running batch: admitted, prefilled padded together, seated in rows
    seat = running._seat
    seated: list[float] = []
    running._seat = lambda group: seated.append(timed(device, lambda: seat(group)))  # type: ignore[method-assign]
    for k in joins:
        split: dict[str, list[float]] = {"admit": [], "prefill forward": [], "seat": []}
        for trial in range(args.join_trials):
            joining = [continuous_batching.Request(
                torch.randint(32, 127, (max(8, args.prompt - 13 * (i + trial)),),
                              generator=generator).tolist(), 8, 0.0, i) for i in range(k)]
            split["admit"].append(timed(device, lambda joining=joining: running.admit(joining)))
            seated.clear()
            whole = timed(device, lambda: running.prefill(args.chunk))
            split["seat"].append(sum(seated))
            split["prefill forward"].append(whole - sum(seated))
            while len(running.rows) > rows:  # back to the running batch alone
                running._drop(len(running.rows) - 1)
        ms = {name: 1000 * sorted(values)[len(values) // 2] for name, values in split.items()}
        print(f"{setting}, {rows} rows, {k} joining: "
              + ", ".join(f"{name} {value:.2f} ms" for name, value in ms.items()), flush=True)
        results_joins.append({"joining": k, "ms_median": ms})
    running._seat = seat  # type: ignore[method-assign]
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(5):
            running.step()
            running.feed()
        if device.type == "cuda":
            torch.cuda.synchronize()
    averages = profile.key_averages()
    device_key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    top = sorted(averages, key=lambda e: getattr(e, device_key, 0), reverse=True)[:12]
    by_cpu = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    ms = {name: 1000 * sum(values) / len(values) for name, values in parts.items()}
    shown = ", ".join(f"{name} {value:.2f} ms" for name, value in ms.items())
    print(f"{setting}, {rows} rows: {shown}", flush=True)
    print(averages.table(sort_by=device_key, row_limit=15), flush=True)
    captured = running.graphs is not None and running.graphs.captured
    return {"setting": setting, "rows": rows, "cuda_graphs": captured, "ms_per_step": ms,
            "joins": results_joins,
            "top_by_device": [{"name": e.key, "calls": e.count, "ms": getattr(e, device_key, 0) / 1000 / 5}
                              for e in top],
            "top_by_cpu": [{"name": e.key, "calls": e.count, "ms": e.self_cpu_time_total / 1000 / 5}
                           for e in by_cpu]}


def main() -> int:
    parser = argument_parser(__doc__, "serving_decode_step")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rows", default="8,24,64", help="rows of the running batch, comma-separated")
    parser.add_argument("--prompt", type=int, default=200, help="prompt tokens of every row")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--architecture", type=parse_architecture, default=ARCHITECTURE)
    parser.add_argument("--joins", default="",
                        help="also time prompts joining the running batch, this many at once (e.g. 1,4,16): "
                             "their admission, their prefill's forward passes and their seating in rows")
    parser.add_argument("--join-trials", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=2048, help="the joining prompts' prefillChunkTokens")
    parser.add_argument("--baseline", action="store_true",
                        help="also run each case with cuDNN's attention allowed in decoding (before the fix)")
    args = parser.parse_args()
    begun = time.perf_counter()
    torch.set_num_threads(1)  # as the replica runs
    huorn = list(attention.SHAPE_CHANGING_BACKENDS)
    settings = {"eager, cudnn allowed": ([attention.SDPBackend.CUDNN_ATTENTION, *huorn], False),
                "eager": (huorn, False), "huorn (cuda graphs)": (huorn, True)}
    results = []
    for rows in args.rows.split(","):
        for setting, (backends, fixed_steps) in settings.items():
            if setting != "eager, cudnn allowed" or args.baseline:
                attention.SHAPE_CHANGING_BACKENDS[:] = backends
                results.append(asyncio.run(measure(args, int(rows), setting, fixed_steps)))
    attention.SHAPE_CHANGING_BACKENDS[:] = huorn
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    write_report(args, begun, date=time.strftime("%Y-%m-%d"), device=args.device, device_name=name,
                 results=results)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
