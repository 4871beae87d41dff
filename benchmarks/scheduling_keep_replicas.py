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

import contextlib
import dataclasses
import json
from collections import Counter
from collections.abc import Iterator

from rich.progress import track
from study_common import POLLUXES, TRACE, arguments, case, write

from huorn.scheduler import allocator
from huorn.sim import engine, policies, report, run

KEEPING = "huorn+keep-replicas"


@contextlib.contextmanager
def counting_resizes(configs: dict[allocator.AllocatorConfig, str]) -> Iterator[dict[str, Counter]]:
    """Count the grows (and the nodes each grown gang spans) and shrinks each allocator decides,
    by wrapping `Allocator.allocate`: why keeping replicas costs what it does. What the allocator
    decides is unchanged, only counted."""
    counts: dict[str, Counter] = {name: Counter() for name in configs.values()}
    original = allocator.Allocator.allocate

    def allocate(self: allocator.Allocator, *args: object, **kwargs: object) -> list[allocator.Decision]:
        decisions = original(self, *args, **kwargs)  # type: ignore[arg-type]
        name = configs.get(self.config)
        for d in decisions if name is not None else []:
            if d.action in ("grow", "shrink"):
                counts[name][d.action + "s"] += 1
            if d.action == "grow":
                counts[name]["grown_spans"] += len(set(d.assignments))
        return decisions

    allocator.Allocator.allocate = allocate  # type: ignore[method-assign]
    try:
        yield counts
    finally:
        allocator.Allocator.allocate = original  # type: ignore[method-assign]


def main() -> None:
    args = arguments(__doc__, "128:0:0.8,128:0:1.5,1024:0:0.8,1024:0:1.5", "keep_replicas.json").parse_args()
    huorn = policies.POLICIES["huorn"]
    policies.POLICIES[KEEPING] = dataclasses.replace(
        huorn, name=KEEPING, allocator=dataclasses.replace(huorn.allocator, keep_replicas=True))
    rows = []
    for gpus, seed, load in track([case(c) for c in args.cases.split(",")], description="cases"):
        configs = {policies.POLICIES[k].allocator: k for k in ("huorn", KEEPING)}
        with counting_resizes(configs) as counts:
            results, _ = run.run_policies(*TRACE, [*POLLUXES, "huorn", KEEPING],
                                          engine.SimConfig(gpus=gpus, seed=seed, load=load))
        best = results[report.best_pollux(results)]["jct_mean_s"]
        row = {
            "gpus": gpus, "seed": seed, "load": load, "best_pollux_jct_mean_s": best,
            "policies": {k: {"jct_mean_s": results[k]["jct_mean_s"], "restarts": results[k]["restarts"],
                             "preemptions": results[k]["preemptions"],
                             "jct_reduction_vs_best_pollux": 1 - results[k]["jct_mean_s"] / best,
                             "grows": counts[k]["grows"], "shrinks": counts[k]["shrinks"],
                             "mean_nodes_of_a_grown_gang": counts[k]["grown_spans"]
                             / max(1, counts[k]["grows"])}
                         for k in ("huorn", KEEPING)},
            "keep_replicas_jct_cost": results[KEEPING]["jct_mean_s"] / results["huorn"]["jct_mean_s"] - 1,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args.output)


if __name__ == "__main__":
    main()
