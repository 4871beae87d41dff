"""Is a pipeline stage bound by its host or by its GPU, eagerly and as CUDA graphs? One GPU, no
communication: each half of benchmarks/pipeline_gpu.py's decoder runs a step's 16 forwards and
backwards (1F1B order on one stage: F then B), eagerly and through `graphs.GraphedStage` with
two slots, as the executor uses it.

    python3 benchmarks/pipeline_gpu_probe.py --out $OUT     # one H200 is enough

Per stage it reports the host time until the last launch returns, the whole step (after a
synchronise) and the GPU time between two events, medians of 5 steps after 3 warm-up steps,
and how far the graphed gradients are from the eager ones (bf16: the same kernels, so they
should agree to bf16 rounding)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pipeline_bench
import torch

from huorn import models
from huorn.runtime.pipeline import graphs, split

Forward = Callable[[Sequence[torch.Tensor]], tuple[tuple[torch.Tensor, ...], int]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/pipeline_gpu_probe"))
    args = parser.parse_args()
    config = pipeline_bench.diagnosis_config(tiny=False)
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    decoder = models.build_model(config.model).to(device=device, dtype=torch.bfloat16)
    stages = split.split_decoder(decoder, 2)
    count = config.microbatches
    shape = (config.micro_batch * count, config.model.context)
    tokens = list(torch.randint(0, config.model.vocabulary, shape, device=device).chunk(count))
    targets = list(torch.randint(0, config.model.vocabulary, shape, device=device).chunk(count))
    with torch.no_grad():
        hidden = [stages[0](t) for t in tokens]
    hidden = [(h,) if isinstance(h, torch.Tensor) else tuple(h) for h in hidden]

    def inputs(stage: int, m: int) -> list[torch.Tensor]:
        if stage == 0:
            return [tokens[m]]
        return [h.clone().requires_grad_(True) for h in hidden[m]] + [targets[m]]

    def eager(stage: int) -> Forward:
        def forward(args: Sequence[torch.Tensor]) -> tuple[tuple[torch.Tensor, ...], int]:
            if stage == 0:
                out = stages[0](*args)
                return ((out,) if isinstance(out, torch.Tensor) else tuple(out)), -1
            out = stages[1](*args[:-1])
            return (split.compute_decoder_loss((out,), args[-1]),), -1
        return forward

    def step(stage: int, forward: Forward, graphed: graphs.GraphedStage | None) -> tuple[float, float, float]:
        module = stages[stage]
        module.zero_grad(set_to_none=True)
        if graphed is not None:
            graphed.ensure_grads()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        for m in range(count):
            outputs, slot = forward(inputs(stage, m))
            seeds = [torch.full_like(o, 1.0 / count) for o in outputs]
            torch.autograd.backward(outputs, seeds)
            if graphed is not None:
                graphed.release(slot)
        end.record()
        host = time.perf_counter() - began
        torch.cuda.synchronize()
        return host, time.perf_counter() - began, start.elapsed_time(end) / 1e3

    report: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for stage in (0, 1):
        loss_fn = split.compute_decoder_loss if stage == 1 else None
        for _ in range(3):
            step(stage, eager(stage), None)
        eager_runs = [step(stage, eager(stage), None) for _ in range(5)]
        want = {n: p.grad.float().clone() for n, p in stages[stage].named_parameters()}
        began = time.perf_counter()
        graphed = graphs.GraphedStage(stages[stage], loss_fn, inputs(stage, 0), max_slots=2)
        graphed.prepare(2)
        capture_s = time.perf_counter() - began
        for _ in range(3):
            step(stage, graphed.forward, graphed)
        graph_runs = [step(stage, graphed.forward, graphed) for _ in range(5)]
        error = max(float((p.grad.float() - want[n]).abs().max() / want[n].abs().max().clamp_min(1e-12))
                    for n, p in stages[stage].named_parameters())

        def median(runs: list[tuple[float, float, float]], i: int) -> float:
            return statistics.median(r[i] for r in runs) * 1e3

        report[f"stage{stage}"] = {
            "eager_host_ms": median(eager_runs, 0), "eager_step_ms": median(eager_runs, 1),
            "eager_gpu_ms": median(eager_runs, 2), "graph_host_ms": median(graph_runs, 0),
            "graph_step_ms": median(graph_runs, 1), "graph_gpu_ms": median(graph_runs, 2),
            "capture_s": capture_s, "max_relative_grad_difference": error,
        }
        print(f"stage {stage}: " + ", ".join(f"{k} {v:.4g}" for k, v in report[f"stage{stage}"].items()),
              flush=True)
    report["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pipeline_gpu_probe.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
