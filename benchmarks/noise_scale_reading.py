"""How well the runtime reads the gradient noise scale: the same small decoder trained by a world
of one (two halves of its micro-batches, huorn.runtime.solo_noise) and by two ranks (each rank
against the reduced gradient), on several data seeds, side by side in one run.

Two figures come out of it:
- **agreement**: the two readings estimate the same B_noise, so the one-replica reading over the
  two-rank one, each averaged over the seeds, should be near 1 once both have settled;
- **spread**: the standard deviation of log(reading) across seeds at the same step, the error a
  policy sees in one step's value. The simulator draws what its policies read with this σ
  (huorn.sim.state.NOISE_READING_SIGMA_ALONE and NOISE_READING_SIGMA).

    .venv/bin/python benchmarks/noise_scale_reading.py                 # ~3 min on the 2-core VM
    .venv/bin/python benchmarks/noise_scale_reading.py --seeds 2 --steps 60   # smoke run
    .venv/bin/python benchmarks/noise_scale_reading.py --layers 4 --width 256 --context 128 \
        --global-batch 64 --micro-batch 8 --learning-rate 0.001      # a larger model and batch
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import matplotlib
import numpy as np
import trainer_runs
from rich.progress import Progress

from huorn.runtime import config as run_config
from huorn.runtime import steplog

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

WORLDS = (1, 2)


def job_body(seed: int, args: argparse.Namespace) -> dict:
    """By default a decoder small enough for two ranks on two cores, with 8 micro-batches a step: a
    world of one reads two halves of 8 sequences against 16, as two ranks of 8 do."""
    return {
        "virtualCluster": "bench",
        "elasticity": {"minReplicas": 1, "maxReplicas": 2},
        "model": {"layers": args.layers, "width": args.width, "heads": max(2, args.width // 64),
                  "context": args.context},
        "data": {"sources": [{"name": "general", "weight": 2}, {"name": "code", "weight": 1},
                             {"name": "math", "weight": 1}], "seed": seed},
        "optimization": {"globalBatch": args.global_batch, "microBatch": args.micro_batch,
                         "learningRate": args.learning_rate, "warmupSteps": 10, "steps": args.steps},
        "checkpoint": {"path": "/checkpoints"},
    }


def readings(config: run_config.RunConfig) -> list[float | None]:
    """Rank 0's gradient noise scale at each step, in step order."""
    steps = steplog.steps_of(steplog.read_events(Path(config.run_dir)))
    return [e.get("gradient_noise_scale") for e in sorted(steps, key=lambda e: e["step"])]


def summarise(series: dict[int, list[list[float | None]]], settle: int) -> dict:
    """Per world, the seeds' log-spread at each settled step; across worlds, their agreement."""
    logs = {w: np.log(np.array([[v if v and v > 0 else np.nan for v in run[settle:]] for run in runs]))
            for w, runs in series.items()}
    out: dict = {"settle_steps": settle}
    for world, values in logs.items():
        spread = np.nanstd(values, axis=0, ddof=1)
        out[f"world_{world}"] = {
            "log_spread_median": round(float(np.nanmedian(spread)), 4),
            "log_spread_p90": round(float(np.nanpercentile(spread, 90)), 4),
            "missing_readings": int(np.isnan(values).sum()),
            "geometric_mean": round(float(np.exp(np.nanmean(values))), 3),
        }
    ratio = np.nanmean(logs[1], axis=0) - np.nanmean(logs[2], axis=0)
    out["one_over_two"] = {"median": round(float(np.exp(np.nanmedian(ratio))), 3),
                           "p10": round(float(np.exp(np.nanpercentile(ratio, 10))), 3),
                           "p90": round(float(np.exp(np.nanpercentile(ratio, 90))), 3)}
    return out


def plot(series: dict[int, list[list[float | None]]], settle: int, path: Path, title: str) -> None:
    figure, axis = pyplot.subplots(figsize=(8, 4))
    colours = {1: "tab:blue", 2: "tab:orange"}
    for world, runs in series.items():
        for i, run in enumerate(runs):
            steps = [s + 1 for s, v in enumerate(run) if v]
            axis.plot(steps, [v for v in run if v], color=colours[world], alpha=0.5, lw=1,
                      label=f"world of {world}: {'micro-batch halves' if world == 1 else 'per rank'}"
                      if i == 0 else None)
    axis.axvline(settle, color="grey", ls=":", lw=1)
    axis.set_yscale("log")
    axis.set_ylabel("gradient noise scale (sequences)")
    trainer_runs.finish_axes([axis], "step")
    trainer_runs.save_figure(figure, title, path)


def main() -> None:
    parser = trainer_runs.argument_parser(__doc__, "noise_scale_reading")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--settle", type=int, default=50, help="steps left out while the EMA fills")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=0.003)
    args = parser.parse_args()
    if args.global_batch % (2 * args.micro_batch):
        raise SystemExit(f"--global-batch must be a multiple of 2 × --micro-batch ({2 * args.micro_batch}), "
                         f"so that two ranks split it evenly; got {args.global_batch}")
    if not 0 < args.settle < args.steps:
        raise SystemExit(f"--settle must be between 0 and --steps ({args.steps}), got {args.settle}")
    if args.seeds < 2:
        raise SystemExit(f"--seeds must be at least 2 (a spread needs two), got {args.seeds}")
    started = time.perf_counter()
    data_dir = trainer_runs.build_corpora(args.work)
    jobs = {f"w{w}-s{s}": job_body(s, args) for w in WORLDS for s in range(args.seeds)}
    ranks = {name: int(name[1]) for name in jobs}
    with Progress() as progress:
        configs = trainer_runs.run_all(jobs, args.work, data_dir, progress, parallel=1, ranks=ranks)
    series = {w: [readings(configs[f"w{w}-s{s}"]) for s in range(args.seeds)] for w in WORLDS}
    summary = summarise(series, args.settle)
    plot(series, args.settle, args.png, f"Gradient noise scale read by a world of one and by two ranks "
         f"({args.seeds} data seeds)")
    trainer_runs.write_report(args, started, summary=summary,
                              series={str(w): runs for w, runs in series.items()})
    print(json.dumps(summary, indent=2))
    print(f"σ of one step's reading (log, median over settled steps): world of one "
          f"{summary['world_1']['log_spread_median']}, two ranks {summary['world_2']['log_spread_median']}; "
          f"one over two {summary['one_over_two']['median']}×. Figure: {args.png}")
    if not math.isfinite(summary["one_over_two"]["median"]):
        raise SystemExit("a world read no noise scale after settling; see the runs under --work")


if __name__ == "__main__":
    main()
