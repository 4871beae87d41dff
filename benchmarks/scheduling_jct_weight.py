"""Huorn's JCT weight: by rank (heSRPT) among every live job at several exponents, against the
rank among the jobs handed to the allocator and the remaining-time weight, each against the best
Pollux of every seed.

Why: Huorn weighs each job's speedups so that GPUs go where they finish work soonest. Until
2026-12-07 the weight was (horizon / remaining time)^0.35; heSRPT's optimal shares for concave
speedups k^p weigh the i-th longest job by about i^p, so the order of the remaining times sets
the weights, not their ratios (docs/scheduling.md, "Allocator", item 10). Ranked among the jobs
handed to the allocator (rank^0.4, the first form), which pending jobs a caller left out moved
the weights, and the operator hands over other jobs than the simulator; a rank among every live
job of the virtual cluster does not depend on that cut (item 11). This runs the weights side by
side with everything else as committed (allocator.HUORN), with the best of the six Pollux forms
(three objectives, each with and without AdaptDL's admission on arrival) as each seed's
baseline, in one run. The exponents were chosen on seeds 0-9; later seeds were held out.

    .venv/bin/python benchmarks/scheduling_jct_weight.py                      # 128 GPUs, seeds 0-9
    .venv/bin/python benchmarks/scheduling_jct_weight.py --seeds 10-29 --output \\
        benchmarks/results/scheduling_sim/jct_weight_10_29.json
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

RANK_EXPONENTS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # ranks among every live job
WEIGHTS = {"remaining^0.35 (before)": dataclasses.replace(allocator.HUORN, jct_weight=0.35,
                                                          jct_weight_by="remaining"),
           "rank^0.4 among the allocation (before)": dataclasses.replace(
               allocator.HUORN, jct_weight=0.4, jct_weight_by="rank", rank_among="allocation"),
           **{f"rank^{e}": dataclasses.replace(allocator.HUORN, jct_weight=e, jct_weight_by="rank",
                                               rank_among="live")
              for e in RANK_EXPONENTS}}


register_huorn_variants(WEIGHTS)


def _one(task: tuple[int, int, float, str]) -> dict:
    return huorn_variants_against_best_pollux(task, WEIGHTS)


def main() -> None:
    parser = seed_study_arguments(__doc__, "0-9", "jct_weight.json")
    args = parser.parse_args()
    runs = run_seeds(_one, args, seed_list(args.seeds))
    summary = {w: statistics.fmean(r["huorn"][w]["jct_reduction_vs_best_pollux"] for r in runs)
               for w in WEIGHTS}
    print(f"Huorn's mean JCT below the best Pollux, {args.gpus} GPUs, load {args.load}, {args.qps_start}, "
          f"seeds {args.seeds}:")
    for weight, margin in summary.items():
        per_seed = " ".join(f"{r['huorn'][weight]['jct_reduction_vs_best_pollux'] * 100:5.1f}" for r in runs)
        print(f"{weight:<40}{margin * 100:7.2f} %   {per_seed}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"gpus": args.gpus, "load": args.load, "qps_start": args.qps_start,
                                       "seeds": args.seeds, "runs": runs, "summary": summary}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
