"""Whether the Pollux baselines lose by their prior: each Pollux variant also run from each job's
own family curve, beside Huorn, in one run.

Why: the Pollux baselines start every job's performance model from the generic transformer prior
(AdaptDL has no per-family catalogue). Had that prior been what Pollux lost by, the comparison
would measure the catalogue, not the allocator. The variants start from the job's own family
curve (PolicySpec.priors = "family"), the most any prior could give: more than Huorn has, which
since 2026-12-07 starts from what its operator picks (moe or transformer, anchored; the figures
of docs/benchmarks.md for this study were measured when Huorn had the family curves too). The
variants are registered for this run only; the benchmark's baselines stay as they are.

    .venv/bin/python benchmarks/scheduling_pollux_priors.py [--cases 128:0:0.8,128:0:1.5]
"""

from __future__ import annotations

import dataclasses
import json

from rich.progress import track
from study_common import POLLUXES, TRACE, arguments, case, write

from huorn.sim import engine, policies, run

WITH_PRIORS = {f"{name}+priors": name for name in POLLUXES}


def main() -> None:
    args = arguments(__doc__, "128:0:0.8,128:0:1.5", "pollux_priors.json").parse_args()
    for name, base in WITH_PRIORS.items():
        policies.POLICIES[name] = dataclasses.replace(policies.POLICIES[base], name=name, priors="family")
    names = ["fifo", *POLLUXES, *WITH_PRIORS, "huorn"]
    rows = []
    for gpus, seed, load in track([case(c) for c in args.cases.split(",")], description="cases"):
        results, _ = run.run_policies(*TRACE, names, engine.SimConfig(gpus=gpus, seed=seed, load=load))
        fifo = results["fifo"]["goodput_saturated_gpu_equiv"]
        best = {label: min(group, key=lambda k: results[k]["jct_mean_s"])
                for label, group in (("generic", POLLUXES), ("priors", tuple(WITH_PRIORS)))}
        row = {
            "gpus": gpus, "seed": seed, "load": load,
            "policies": {k: {"jct_mean_s": v["jct_mean_s"], "restarts": v["restarts"],
                             "saturated_goodput_vs_fifo": v["goodput_saturated_gpu_equiv"] / fifo}
                         for k, v in results.items()},
            "best_pollux_generic": best["generic"], "best_pollux_priors": best["priors"],
            "huorn_jct_reduction_vs_best_of_both": 1 - results["huorn"]["jct_mean_s"] / min(
                results[best["generic"]]["jct_mean_s"], results[best["priors"]]["jct_mean_s"]),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args.output)


if __name__ == "__main__":
    main()
