"""Where a pipeline step's time goes on two GPUs: Huorn's 1F1B with each link kind and with and
without saved-activation metering, against torch's Schedule1F1B, on the model of
benchmarks/pipeline_gpu.py, plus a torch.profiler summary of one step of each executor.

    python3 benchmarks/pipeline_gpu_profile.py --out $OUT          # on nvidia-h200-x2
    .venv/bin/python benchmarks/pipeline_gpu_profile.py --tiny     # CPU dry run (gloo)

It answers one question before a full benchmark is worth device time: is the executor's gap to
torch in the GPU's work (kernels) or in the host's hand-offs (link threads, hooks, waits)?
`gpu busy` is the union of kernel time on the compute stream over the step's wall time."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_bench
import torch
import torch.distributed as dist

from huorn.runtime.pipeline import contention, executor, launch, schedules, split
from huorn.runtime.pipeline import topology as pp_topology


def worker(rank: int, world: int, config: pipeline_bench.BenchConfig, rounds: int) -> dict:
    setup = pipeline_bench.build_stage(config, rank)
    device, topo, groups, stage, runner = setup.device, setup.topo, setup.groups, setup.stage, setup.runner
    on_gpu = device.type == "cuda"
    stream_links = runner.send_link, runner.grad_link
    thread_links = tuple(
        contention.LinkSender(peer, group, runner.throttle, device) if peer is not None else None
        for peer, group in ((runner._next, groups.to_next), (runner._previous, groups.to_previous)))
    # the same stage over edge communicators with other NCCL settings (build_groups' options)
    variants = {"max_ctas=2": dict(p2p_max_ctas=2), "max_ctas=4": dict(p2p_max_ctas=4),
                "max_ctas=8": dict(p2p_max_ctas=8), "high priority": dict(p2p_high_priority=True),
                "max_ctas=4, high priority": dict(p2p_max_ctas=4, p2p_high_priority=True)} if on_gpu else {}
    others = {name: executor.StageExecutor(stage, topo, pp_topology.build_groups(topo, **options),
                                           split.compute_decoder_loss, device)
              for name, options in variants.items()}
    tokens, targets, inputs, labels = setup.tokens, setup.targets, setup.inputs, setup.labels
    for each in (runner, *others.values()):
        each.negotiate_shapes(inputs[0], labels[0])
    torch_schedule = pipeline_bench.build_torch_schedule("Schedule1F1B", stage, topo, config, device)
    pipeline_bench.TORCH_BATCH[:] = [(tokens, targets)]

    def ours(links: tuple, meter: bool, k: int = 1, stage_runner: executor.StageExecutor = runner):
        table = schedules.build_schedule("kfkb", config.stages, config.microbatches, k)

        def step() -> None:
            if stage_runner is runner:
                runner.send_link, runner.grad_link = links
            if meter:
                stage_runner.measured_peaks.clear()
            stage_runner.run_step(table, inputs if topo.is_first else None, labels if topo.is_last else None)
            stage.zero_grad(set_to_none=True)
        return step

    torch_once = pipeline_bench.torch_stepper(torch_schedule, topo, tokens, targets)

    def torch_step() -> None:
        torch_once()
        stage.zero_grad(set_to_none=True)

    configs = {
        "huorn 1F1B, stream links": ours(stream_links, meter=False),
        "huorn 1F1B, stream links, metered": ours(stream_links, meter=True),
        "huorn 1F1B, thread links": ours(thread_links, meter=False),
        "huorn 1F1B, thread links, metered (old)": ours(thread_links, meter=True),
        "huorn k=2, stream links": ours(stream_links, meter=False, k=2),
        "torch Schedule1F1B": torch_step,
    }
    for name, other in others.items():
        configs[f"huorn 1F1B, stream links, {name}"] = ours((), meter=False, stage_runner=other)
    times: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_ in range(rounds + 1):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            for repeat in range(3):  # the first step after a switch is a warm-up
                pipeline_bench.synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                configs[name]()
                pipeline_bench.synchronize(device)
                dist.barrier()
                if round_ and repeat:
                    times[name].append(time.perf_counter() - start)
    tokens_per_step = config.micro_batch * config.microbatches * config.model.context
    result = {"rank": rank, "median_s": {n: statistics.median(v) for n, v in times.items()}}
    result["tokens_per_s"] = {n: tokens_per_step / s for n, s in result["median_s"].items()}
    # compute floor: the same forwards and backwards with no pipeline at all
    fb = [runner.run_step(schedules.build_schedule("1f1b", config.stages, config.microbatches),
                          inputs if topo.is_first else None, labels if topo.is_last else None)
          for _ in range(3)][-1]
    result["compute_s_per_step"] = config.microbatches * (fb.forward_s + fb.backward_s)
    result["profiles"] = {}
    for name in ("huorn 1F1B, stream links", "torch Schedule1F1B"):
        result["profiles"][name] = profile_step(configs[name], device)
    runner.send_link, runner.grad_link = stream_links
    for link in thread_links:
        if link is not None:
            link.close()
    for each in (runner, *others.values()):
        each.close()
    return result


def profile_step(step, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    pipeline_bench.synchronize(device)
    dist.barrier()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        pipeline_bench.synchronize(device)
        wall = time.perf_counter() - start
    dist.barrier()
    table = prof.key_averages().table(
        sort_by="self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total", row_limit=12)
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA")
    busy, last_end = 0.0, None
    for begin, end in spans:
        if last_end is None or begin > last_end:
            busy += end - begin
            last_end = end
        elif end > last_end:
            busy += end - last_end
            last_end = end
    return {"wall_s": wall, "gpu_busy_s": busy / 1e6, "table": table}


def best_link_flags(results: list[dict]) -> str:
    """benchmarks/pipeline_gpu.py's flags for the fastest edge-communicator setting measured
    (a step is as slow as its slowest rank)."""
    prefix = "huorn 1F1B, stream links"
    flags = {prefix: "", **{f"{prefix}, max_ctas={n}": f"--p2p-max-ctas {n}" for n in (2, 4, 8)},
             f"{prefix}, high priority": "--p2p-high-priority",
             f"{prefix}, max_ctas=4, high priority": "--p2p-max-ctas 4 --p2p-high-priority"}
    step = {name: max(r["median_s"][name] for r in results) for name in flags
            if all(name in r["median_s"] for r in results)}
    best = min(step, key=step.get)
    print(f"fastest link setting: {best.removeprefix(prefix + ', ') if best != prefix else 'default'} "
          f"({step[best] * 1e3:.1f} ms/step)")
    return flags[best]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/pipeline_gpu_profile"))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tiny", action="store_true", help="gloo on the CPU with a small model (dry run)")
    args = parser.parse_args()
    config = pipeline_bench.diagnosis_config(args.tiny)
    results = launch.run_workers(worker, 2, config.backend, (config, args.rounds), timeout_s=600)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_gpu_profile.json").write_text(json.dumps(results, indent=2))
    flags = best_link_flags(results)
    (args.out / "best_flags.txt").write_text(flags + "\n")
    for result in results:
        print(f"--- rank {result['rank']}: compute floor {result['compute_s_per_step'] * 1e3:.1f} ms/step")
        for name, seconds in result["median_s"].items():
            print(f"{name:58s} {seconds * 1e3:8.1f} ms  {result['tokens_per_s'][name]:10.0f} tok/s")
        for name, prof in result["profiles"].items():
            print(f"[{name}] wall {prof['wall_s'] * 1e3:.1f} ms, gpu busy {prof['gpu_busy_s'] * 1e3:.1f} ms")
            if result["rank"] == 1:
                print(prof["table"])


if __name__ == "__main__":
    main()
