"""Seed sensitivity of the scheduling simulation: Huorn against Pollux and FIFO at 128 GPUs.

One seed picks the nodes, the sampled tasks, the per-job curves and the telemetry noise; the
spread across seeds says how much of a single run's margin is luck. Pollux runs at both fairness
exponents (p = 1 and the paper's p = -1, the latter also with the paper's fair-share speedup), each
also with AdaptDL's admission on arrival, and Huorn's margin is taken against the best of the six
per seed, as in benchmarks/scheduling_sim.py.

    .venv/bin/python benchmarks/scheduling_seeds.py --seeds 0,1,2,3,4
    python3 benchmarks/scheduling_seeds.py --seeds 10,11,12,13,14 --jobs 5     # seeds at once
"""

from __future__ import annotations

import argparse
import json
import statistics
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from rich.progress import track
from study_common import TRACE

from huorn.sim import engine, policies, report, run


def run_seed(seed: int, gpus: int, load: float) -> dict:
    """One seed's row: FIFO, the six Pollux forms and Huorn on the same sample."""
    config = engine.SimConfig(gpus=gpus, seed=seed, load=load)
    results, _ = run.run_policies(*TRACE, ["fifo", *policies.POLLUX_FORMS, "huorn"], config)
    h, p, f = results["huorn"], results["pollux"], results["fifo"]
    best = report.best_pollux(results)
    row = {
        "seed": seed,
        "jct_mean_s": {k: v["jct_mean_s"] for k, v in results.items()},
        "best_pollux": best,
        "jct_reduction_vs_best_pollux": 1 - h["jct_mean_s"] / results[best]["jct_mean_s"],
        "jct_reduction_vs_pollux": 1 - h["jct_mean_s"] / p["jct_mean_s"],
        "jct_reduction_vs_pollux_p_minus_1": 1 - h["jct_mean_s"] / results["pollux-p-1"]["jct_mean_s"],
        "jct_reduction_vs_pollux_p_minus_1_fair": (1 - h["jct_mean_s"]
                                                   / results["pollux-p-1-fair"]["jct_mean_s"]),
        "goodput_vs_fifo": h["goodput_gpu_equiv"] / f["goodput_gpu_equiv"],
        "job_goodput_vs_fifo": h["job_goodput_vs_trace"] / f["job_goodput_vs_trace"],
        "saturated_goodput_vs_fifo": h["goodput_saturated_gpu_equiv"] / f["goodput_saturated_gpu_equiv"],
        "job_goodput_with_wait_vs_fifo": (h["job_goodput_with_wait_vs_trace"]
                                          / f["job_goodput_with_wait_vs_trace"]),
        "slo": h["inference_slo_attainment"],
    }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/scheduling_sim/seeds.json"))
    parser.add_argument("--jobs", type=int, default=1, help="seeds run at once, one process each")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_seed, seed, args.gpus, args.load) for seed in seeds]
        try:
            for future in track(as_completed(futures), total=len(futures), description="seeds"):
                rows.append(future.result())
                print(json.dumps(rows[-1]), flush=True)  # as each seed ends: kept if a later one fails
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    rows.sort(key=lambda row: seeds.index(row["seed"]))
    keys = ("jct_reduction_vs_best_pollux", "jct_reduction_vs_pollux", "jct_reduction_vs_pollux_p_minus_1",
            "jct_reduction_vs_pollux_p_minus_1_fair", "goodput_vs_fifo", "saturated_goodput_vs_fifo",
            "job_goodput_vs_fifo", "job_goodput_with_wait_vs_fifo", "slo")
    summary = {k: {"mean": statistics.fmean(r[k] for r in rows), "min": min(r[k] for r in rows),
                   "max": max(r[k] for r in rows)} for k in keys}
    print(json.dumps(summary, indent=2))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    out = {"gpus": args.gpus, "load": args.load, "runs": rows, "summary": summary}
    args.output.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
