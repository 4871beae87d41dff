"""Huorn's allocator settings, step by step, against the best Pollux on many seeds.

Why: six changes to Huorn's allocator (the in-place price of a placement that keeps a resized
gang's replicas, each resize also tried around the replicas, the protection of jobs near their
end, the remaining-time weight's exponent, the weight by rank, then the rank among every live
job) were measured on many seeds; their numbers were chosen on seeds 0-9, with seeds 10-19 (and,
for the rank weights, 10-29) held out from that choice (docs/scheduling.md, "Allocator", items 9
to 11). This reruns that table: each step on top of the ones before, with the best of the six
Pollux forms (three objectives, each with and without AdaptDL's admission on arrival) as the
baseline of each seed, in one run.

    .venv/bin/python benchmarks/scheduling_huorn_settings.py                 # 128 GPUs, seeds 0-19
    .venv/bin/python benchmarks/scheduling_huorn_settings.py --seeds 20-39 --tuned none
    .venv/bin/python benchmarks/scheduling_huorn_settings.py --seeds 0-9 --load 1.5
    .venv/bin/python benchmarks/scheduling_huorn_settings.py --seeds 0-9 --qps-start beginning
"""

from __future__ import annotations

import dataclasses
import json
import statistics

from study_common import (
    huorn_variants_against_best_pollux,
    register_huorn_variants,
    run_seeds,
    seed_list,
    seed_study_arguments,
)

from huorn.scheduler import allocator
from huorn.sim import policies

POLLUXES = policies.POLLUX_FORMS  # the best of them per seed is the baseline (report.best_pollux)
# Each step on top of the ones before; the last is allocator.HUORN as committed.
BEFORE = dataclasses.replace(allocator.HUORN, in_place_share=1.0, protect_finishing_restarts=5.0,
                             jct_weight=0.5, jct_weight_by="remaining")
PRICED = dataclasses.replace(BEFORE, in_place_share=allocator.IN_PLACE_RESIZE_SHARE)
PROTECTED = dataclasses.replace(PRICED, protect_finishing_restarts=16.0)
STEPS = {
    "before": BEFORE,
    "in-place pricing": dataclasses.replace(PRICED, resize_around_replicas=False),
    "+ around the replicas": PRICED,
    "+ protection 16": PROTECTED,
    "+ weight 0.35": dataclasses.replace(PROTECTED, jct_weight=0.35),
    "+ rank weight 0.4 among the allocation": dataclasses.replace(
        allocator.HUORN, jct_weight=0.4, rank_among="allocation"),
    "+ rank among live jobs, 0.7 (HUORN)": allocator.HUORN,
}


register_huorn_variants(STEPS)


def _one(task: tuple[int, int, float, str]) -> dict:
    return huorn_variants_against_best_pollux(task, STEPS)


def main() -> None:
    parser = seed_study_arguments(__doc__, "0-19", "huorn_settings.json")
    parser.add_argument("--tuned", default="0-9", help="the seeds the settings were chosen on, or none")
    args = parser.parse_args()
    seeds, tuned = seed_list(args.seeds), set(seed_list(args.tuned))
    runs = run_seeds(_one, args, seeds)
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
