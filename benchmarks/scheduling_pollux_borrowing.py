"""How much of Huorn's margin over Pollux is the inference cluster's idle GPUs, which only Huorn
may borrow: Huorn against the best Pollux, Huorn without loaning against it, and Huorn against the
best Pollux that borrows idle inference GPUs as Kueue lends them, per seed and on the mean.

Why: the issue defines the Pollux baseline as having no loaning, so every Pollux form trains on
the training GPUs only, while Huorn also borrows what the inference cluster's forecast leaves
idle. The real AdaptDL scheduler places replicas on any untainted node's unrequested GPUs, so in
a cluster whose inference nodes are not tainted it would borrow too. The review of 2026-12-07
(finding 1) measured a large share of the margin to be that capacity. This study is not the
headline baseline, which stays as the issue defines it: it says how much of the margin is the
allocator and how much is the loaning. Three margins of mean JCT, each against the best of the
six forms of its kind (report.best_pollux):

- huorn vs the best Pollux (pollux, pollux-p-1, pollux-p-1-fair, each also -arrival): the
  headline;
- huorn-noloan (Huorn with loaning="none") vs the same: the allocator alone;
- huorn vs the best Pollux+kueue-loan (each form with loaning="kueue": it borrows the inference
  cluster's unused quota as of now, with no forecast, and when the quota is needed back its
  borrowers are evicted whole, newest first, losing the work since their last checkpoint).

The variants are registered for this run only (in every worker too); the benchmark's baselines
stay as they are.

    .venv/bin/python benchmarks/scheduling_pollux_borrowing.py                    # 128 GPUs, seeds 0-4
    .venv/bin/python benchmarks/scheduling_pollux_borrowing.py --seeds 0-9 --load 1.5
    .venv/bin/python benchmarks/scheduling_pollux_borrowing.py --seeds 0-4 --qps-start beginning
"""

from __future__ import annotations

import dataclasses
import json
import statistics

from study_common import TRACE, run_seeds, seed_list, seed_study_arguments

from huorn.sim import engine, policies, report, run

LOAN = "+kueue-loan"  # a Pollux form that borrows idle inference GPUs as Kueue does
NOLOAN = "huorn-noloan"
MARGINS = ("huorn_vs_best_pollux", "huorn_noloan_vs_best_pollux", "huorn_vs_best_pollux_borrowing")


def _register() -> None:
    """Each Pollux form with Kueue's loaning, and Huorn without loaning (in every worker too)."""
    for form in policies.POLLUX_FORMS:
        name = f"{form}{LOAN}"
        policies.POLICIES[name] = dataclasses.replace(policies.POLICIES[form], name=name, loaning="kueue")
    policies.POLICIES[NOLOAN] = dataclasses.replace(policies.POLICIES["huorn"], name=NOLOAN, loaning="none")


_register()


def _one(task: tuple[int, int, float, str]) -> dict:
    seed, gpus, load, qps_start = task
    config = engine.SimConfig(gpus=gpus, seed=seed, load=load, qps_start=qps_start)
    names = [*policies.POLLUX_FORMS, *(f"{f}{LOAN}" for f in policies.POLLUX_FORMS), "huorn", NOLOAN]
    results, _ = run.run_policies(*TRACE, names, config)
    best, borrowing = report.best_pollux(results), report.best_pollux(results, suffix=LOAN)
    jct = {name: r["jct_mean_s"] for name, r in results.items()}
    return {
        "seed": seed, "best_pollux": best, "best_pollux_borrowing": borrowing,
        "huorn_vs_best_pollux": 1 - jct["huorn"] / jct[best],
        "huorn_noloan_vs_best_pollux": 1 - jct[NOLOAN] / jct[best],
        "huorn_vs_best_pollux_borrowing": 1 - jct["huorn"] / jct[borrowing],
        "policies": {name: {"jct_mean_s": r["jct_mean_s"], "restarts": r["restarts"],
                            "preemptions": r["preemptions"], "gpu_hours_lost": r["gpu_hours_lost"],
                            "goodput_saturated_gpu_equiv": r["goodput_saturated_gpu_equiv"],
                            "slo": r["inference_slo_attainment"]}
                     for name, r in results.items()},
    }


def main() -> None:
    args = seed_study_arguments(__doc__, "0-4", "pollux_borrowing.json").parse_args()
    runs = run_seeds(_one, args, seed_list(args.seeds))
    summary = {key: {"mean": statistics.fmean(r[key] for r in runs), "min": min(r[key] for r in runs),
                     "max": max(r[key] for r in runs)} for key in MARGINS}
    print(f"Huorn's mean JCT below the best Pollux, {args.gpus} GPUs, load {args.load:g}, {args.qps_start}:")
    print(f"{'seed':>6}" + "".join(f"{key:>34}" for key in MARGINS))
    for r in runs:
        print(f"{r['seed']:>6}" + "".join(f"{100 * r[key]:>33.1f}%" for key in MARGINS))
    print(f"{'mean':>6}" + "".join(f"{100 * summary[key]['mean']:>33.1f}%" for key in MARGINS))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"gpus": args.gpus, "load": args.load, "qps_start": args.qps_start,
                                       "runs": runs, "summary": summary}, indent=2))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
