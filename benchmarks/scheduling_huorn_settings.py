"""Huorn's allocator settings, step by step, against the best Pollux on many seeds.

Why: four changes to Huorn's allocator (the in-place price of a placement that keeps a resized
gang's replicas, each resize also tried around the replicas, the protection of jobs near their
end, the remaining-time weight's exponent) were measured on many seeds; the two numbers were
chosen on seeds 0-9, with seeds 10-19 held out from that choice (docs/scheduling.md,
"Allocator", item 9). This reruns that table: each step on top of the ones before, with the best
of the six Pollux forms (three objectives, each with and without AdaptDL's admission on arrival)
as the baseline of each seed, in one run.

    .venv/bin/python benchmarks/scheduling_huorn_settings.py                 # 128 GPUs, seeds 0-19
    .venv/bin/python benchmarks/scheduling_huorn_settings.py --seeds 20-39 --tuned none
    .venv/bin/python benchmarks/scheduling_huorn_settings.py --seeds 0-9 --load 1.5
    .venv/bin/python benchmarks/scheduling_huorn_settings.py --seeds 0-9 --qps-start beginning
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.progress import track

from huorn.scheduler import allocator
from huorn.sim import engine, policies, report, run, shared_data

DATA = shared_data.shared_data_dir()
TRACE = (DATA / "openb_pod_list_default.csv", DATA / "openb_node_list_gpu_node.csv", DATA / "genai_qps.csv")
POLLUXES = policies.POLLUX_FORMS  # the best of them per seed is the baseline (report.best_pollux)
# Each step on top of the ones before; the last is allocator.HUORN as committed.
BEFORE = dataclasses.replace(allocator.HUORN, in_place_share=1.0, protect_finishing_restarts=5.0,
                             jct_weight=0.5)
PRICED = dataclasses.replace(BEFORE, in_place_share=allocator.IN_PLACE_RESIZE_SHARE)
STEPS = {
    "before": BEFORE,
    "in-place pricing": dataclasses.replace(PRICED, resize_around_replicas=False),
    "+ around the replicas": PRICED,
    "+ protection 16": dataclasses.replace(PRICED, protect_finishing_restarts=16.0),
    "+ weight 0.35 (HUORN)": allocator.HUORN,
}


def _policy_name(step: str) -> str:
    return f"huorn[{step}]"


def _register() -> None:
    """Each step as a simulator policy: Huorn's spec with that allocator (in every worker too)."""
    for step, config in STEPS.items():
        policies.POLICIES[_policy_name(step)] = dataclasses.replace(
            policies.POLICIES["huorn"], name=_policy_name(step), allocator=config)


_register()


def _seeds(text: str) -> list[int]:
    """Seeds as ranges and single ones, "0-9,12,20-29"; "none" is no seed."""
    seeds: list[int] = []
    for part in filter(None, text.replace("none", "").split(",")):
        first, _, last = part.partition("-")
        seeds += range(int(first), int(last or first) + 1)
    return seeds


def _one(task: tuple[int, int, float, str]) -> dict:
    seed, gpus, load, qps_start = task
    config = engine.SimConfig(gpus=gpus, seed=seed, load=load, qps_start=qps_start)
    names = [*POLLUXES, *(_policy_name(s) for s in STEPS)]
    results, _ = run.run_policies(*TRACE, names, config)
    best = report.best_pollux(results)
    return {
        "seed": seed, "best_pollux": best, "best_pollux_jct_mean_s": results[best]["jct_mean_s"],
        "huorn": {step: {"jct_mean_s": results[_policy_name(step)]["jct_mean_s"],
                         "jct_reduction_vs_best_pollux": 1 - results[_policy_name(step)]["jct_mean_s"]
                         / results[best]["jct_mean_s"],
                         "restarts": results[_policy_name(step)]["restarts"],
                         "slo": results[_policy_name(step)]["inference_slo_attainment"]}
                  for step in STEPS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0-19", help="ranges and seeds: 0-19, or 0,3,20-29")
    parser.add_argument("--tuned", default="0-9", help="the seeds the settings were chosen on, or none")
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--qps-start", default="middle", choices=("middle", "beginning"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--output", type=Path,
                        default=Path("benchmarks/results/scheduling_sim/huorn_settings.json"))
    args = parser.parse_args()
    seeds, tuned = _seeds(args.seeds), set(_seeds(args.tuned))
    tasks = [(seed, args.gpus, args.load, args.qps_start) for seed in seeds]
    with ProcessPoolExecutor(args.workers) as pool:
        runs = list(track(pool.map(_one, tasks), total=len(tasks), description="seeds"))
    groups = {"tuned": [r for r in runs if r["seed"] in tuned],
              "held_out": [r for r in runs if r["seed"] not in tuned], "all": runs}
    summary = {name: {step: statistics.fmean(r["huorn"][step]["jct_reduction_vs_best_pollux"] for r in rows)
                      for step in STEPS} for name, rows in groups.items() if rows}
    print(f"Huorn's mean JCT below the best Pollux, {args.gpus} GPUs, load {args.load}, {args.qps_start}:")
    print(f"{'step':<24}" + "".join(f"{name:>12}" for name in summary))
    for step in STEPS:
        print(f"{step:<24}" + "".join(f"{summary[name][step] * 100:>11.2f}%" for name in summary))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"gpus": args.gpus, "load": args.load, "qps_start": args.qps_start,
                                       "tuned_seeds": sorted(tuned), "runs": runs, "summary": summary},
                                      indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
