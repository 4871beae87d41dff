"""GLVQ on CPU, side by side in one run: one trained decoder quantised at 2, 3 and 4 bits per
weight by round-to-nearest (the baseline: the same encoder with G = δ·I and no compander) and by
GLVQ (the lattice and compander learned per layer on calibration inputs), scored by the
validation loss of every source against the full-precision model. The model is trained by the
real trainer (`python -m huorn.runtime.train`); quantisation is huorn.runtime.glvq.

    .venv/bin/python benchmarks/glvq_quantize.py              # ~4 min on the 2-core VM
    .venv/bin/python benchmarks/glvq_quantize.py --steps 100 --glvq-steps 20   # smoke

The figure of merit is the excess loss over full precision; GLVQ's is reported as a ratio of
round-to-nearest's (below 1 is better), with the bits stored per weight (codes, lattices, row
scales). docs/figures/glvq_quantize.png plots it.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
import warnings
from pathlib import Path

import matplotlib
import torch
import trainer_runs
from rich.progress import Progress

from huorn import models
from huorn.runtime import checkpoint, distill, glvq
from huorn.runtime import config as run_config
from huorn.runtime.data import sampler

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

SOURCES = ["general", "code", "math"]
MODEL = {"layers": 4, "width": 96, "heads": 4, "context": 64}


def spec(args: argparse.Namespace) -> dict:
    return {"virtualCluster": "bench", "model": MODEL,
            "data": {"sources": [{"name": s, "weight": 1} for s in SOURCES], "seed": args.seed},
            "optimization": {"globalBatch": 16, "microBatch": 16, "learningRate": 3e-3,
                             "warmupSteps": max(1, args.steps // 20), "steps": args.steps},
            "checkpoint": {"path": "/checkpoints", "intervalSteps": args.steps}}


def losses(model: torch.nn.Module, mixture: sampler.Mixture, batches: int) -> dict[str, float]:
    values = distill.source_losses(model, mixture, batches, 8)
    return {**dict(zip(SOURCES, values, strict=True)), "mean": sum(values) / len(values)}


def plot(rows: dict, path: Path, title: str) -> None:
    figure, axis = pyplot.subplots(figsize=(7, 4.2))
    bits = sorted(rows)
    width = 0.35
    for i, method in enumerate(("rtn", "glvq")):
        axis.bar([b + (i - 0.5) * width for b in bits], [rows[b][method]["excess"] for b in bits], width,
                 label={"rtn": "round-to-nearest", "glvq": "GLVQ"}[method])
    axis.set_xticks(bits, [f"{b} bits" for b in bits])
    axis.set_yscale("log")
    axis.set_ylabel("mean validation loss above full precision")
    axis.grid(alpha=0.3, axis="y")
    axis.legend()
    trainer_runs.save_figure(figure, title, path)


def parse_args() -> argparse.Namespace:
    parser = trainer_runs.argument_parser(__doc__, "glvq_quantize")
    parser.add_argument("--steps", type=int, default=1000, help="training steps of the model")
    parser.add_argument("--bits", default="2,3,4")
    parser.add_argument("--group-size", type=int, default=8, help="d, the lattice's dimension")
    parser.add_argument("--glvq-steps", type=int, default=200, help="Adam steps per layer")
    parser.add_argument("--calibration-batches", type=int, default=8)
    parser.add_argument("--eval-batches", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    torch.set_num_threads(2)
    data_dir = trainer_runs.build_corpora(args.work)
    with Progress() as progress:
        config = trainer_runs.run_all({"model": spec(args)}, args.work, data_dir, progress, 1)["model"]
    model_spec = config.spec.model
    model = models.build_model(run_config.build_model_config(model_spec))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        checkpoint.load_checkpoint(checkpoint.resolve(config.checkpoint_root), model, None)
    model.eval()
    mixture = sampler.build_mixture([(s, 1.0, None) for s in SOURCES], args.seed, MODEL["context"], data_dir)
    calibration = [mixture.micro_batch(10**6 + i, 0, 8)[0] for i in range(args.calibration_batches)]
    full = losses(model, mixture, args.eval_batches)
    rows: dict[int, dict] = {}
    for bits in (int(b) for b in args.bits.split(",")):
        rows[bits] = {}
        for method in ("rtn", "glvq"):
            quantized = copy.deepcopy(model)
            began = time.perf_counter()
            report = glvq.quantize_model(quantized, calibration, bits, args.group_size,
                                         learn=method == "glvq", steps=args.glvq_steps)
            seconds = time.perf_counter() - began
            scored = losses(quantized, mixture, args.eval_batches)
            rows[bits][method] = {"losses": {k: round(v, 4) for k, v in scored.items()},
                                  "excess": round(scored["mean"] - full["mean"], 4),
                                  "bits_per_weight": round(report["bits_per_weight"], 3),
                                  "seconds": round(seconds, 1)}
        rtn, learned = rows[bits]["rtn"]["excess"], rows[bits]["glvq"]["excess"]
        rows[bits]["glvq/rtn excess"] = round(learned / rtn, 3) if rtn > 0 else None
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "model": MODEL, "full_precision": {k: round(v, 4) for k, v in full.items()},
              "bits": {str(b): r for b, r in rows.items()},
              "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.png, f"{MODEL['layers']}x{MODEL['width']} decoder, {args.steps} steps; "
         f"d = {args.group_size}, {args.glvq_steps} Adam steps per layer, "
         f"{args.calibration_batches}x8 calibration sequences")
    print(f"full precision mean loss {full['mean']:.4f}")
    for bits, row in rows.items():
        print(f"{bits} bits: RTN +{row['rtn']['excess']:.4f}, GLVQ +{row['glvq']['excess']:.4f} "
              f"(ratio {row['glvq/rtn excess']}), {row['glvq']['bits_per_weight']} bits stored per weight")
    print(f"wrote {args.out} and {args.png} in {result['seconds']} s")


if __name__ == "__main__":
    main()
