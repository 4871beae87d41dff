"""What deciding resizes as the operator executes them would cost Huorn: its allocator with
`keep_replicas` (a grow placed around the gang's running replicas, a shrink by some of them)
beside the allocator as benchmarked (a resized gang placed afresh, a full restart where a staying
replica moved), in one run.

Why: until 2026-12-06 the operator's reconcile kept a resized gang's pods and placed only the new
ones, while the simulator's Huorn re-packs a resized gang where the allocator placed it. This study
measured how far apart the two were, which is why the operator now moves a resized gang to the
allocator's placement (docs/scheduling.md, caveats, "Resizes that keep their replicas").

    .venv/bin/python benchmarks/scheduling_keep_replicas.py [--cases 128:0:0.8,...]
"""

from __future__ import annotations

import dataclasses
import json

from rich.progress import track
from study_common import POLLUXES, TRACE, arguments, case, write

from huorn.sim import engine, policies, run

KEEPING = "huorn+keep-replicas"


def main() -> None:
    args = arguments(__doc__, "128:0:0.8,128:0:1.5,1024:0:0.8,1024:0:1.5", "keep_replicas.json").parse_args()
    huorn = policies.POLICIES["huorn"]
    policies.POLICIES[KEEPING] = dataclasses.replace(
        huorn, name=KEEPING, allocator=dataclasses.replace(huorn.allocator, keep_replicas=True))
    rows = []
    for gpus, seed, load in track([case(c) for c in args.cases.split(",")], description="cases"):
        results, _ = run.run_policies(*TRACE, [*POLLUXES, "huorn", KEEPING],
                                      engine.SimConfig(gpus=gpus, seed=seed, load=load))
        best = min(results[p]["jct_mean_s"] for p in POLLUXES)
        row = {
            "gpus": gpus, "seed": seed, "load": load, "best_pollux_jct_mean_s": best,
            "policies": {k: {"jct_mean_s": results[k]["jct_mean_s"], "restarts": results[k]["restarts"],
                             "preemptions": results[k]["preemptions"],
                             "jct_reduction_vs_best_pollux": 1 - results[k]["jct_mean_s"] / best}
                         for k in ("huorn", KEEPING)},
            "keep_replicas_jct_cost": results[KEEPING]["jct_mean_s"] / results["huorn"]["jct_mean_s"] - 1,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args.output)


if __name__ == "__main__":
    main()
