"""What restarts cost in goodput: Huorn, Pollux and FIFO with every job's restart time scaled.

Why: at 128 GPUs Huorn's saturated-window goodput (1.74× FIFO at seed 0) sits 8 % under the bound
(1.89×), and the bound counts one restart per job. This study scales every family's restart time
(the stop, checkpoint load and re-rendezvous a resize costs; 1 is the catalogue's) and re-runs the
same trace, to measure how much of the gap restarts are. It also runs Huorn with fewer resizes
(a higher hysteresis, a longer cooldown) at the catalogue's cost, which is the other way to pay
for fewer restarts. The rule itself is not changed: the benchmark's figures stay those of cost 1.

    .venv/bin/python benchmarks/scheduling_restart_cost.py [--cases 128:0:0.8,1024:0:0.8] [--costs 1,0.5,0]
    .venv/bin/python benchmarks/scheduling_restart_cost.py --plot-only   # redraw the PNG from the JSON
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.progress import track
from study_common import POLLUXES, TRACE, arguments, case, redraw, write

from huorn.sim import bounds, engine, policies, report, run

# Huorn with fewer resizes, at the catalogue's restart cost (128 GPUs only: the 1,024-GPU runs
# cost a minute each). Registered under their own names for this run only.
FEWER_RESIZES = {"huorn-hysteresis-0.15": {"hysteresis": 0.15}, "huorn-hysteresis-0.3": {"hysteresis": 0.3},
                 "huorn-cooldown-900s": {"cooldown_seconds": 900.0}}


def main() -> None:
    parser = arguments(__doc__, "128:0:0.8,1024:0:0.8", "restart_cost.json")
    parser.add_argument("--costs", default="1,0.5,0", help="restart-time factors, comma-separated")
    args = parser.parse_args()
    if redraw(args, plot):
        return
    huorn = policies.POLICIES["huorn"]
    for name, change in FEWER_RESIZES.items():
        policies.POLICIES[name] = dataclasses.replace(
            huorn, name=name, allocator=dataclasses.replace(huorn.allocator, **change))
    work = [(case(c), float(cost)) for c in args.cases.split(",") for cost in args.costs.split(",")]
    rows = []
    for (gpus, seed, load), cost in track(work, description="cases"):
        config = engine.SimConfig(gpus=gpus, seed=seed, load=load, restart_cost=cost)
        variants = list(FEWER_RESIZES) if cost == 1.0 and gpus <= 128 else []
        results, sims = run.run_policies(*TRACE, ["fifo", *POLLUXES, "huorn", *variants], config)
        fifo = results["fifo"]["goodput_saturated_gpu_equiv"]
        best = report.best_pollux(results)
        row = {
            "gpus": gpus, "seed": seed, "load": load, "restart_cost": cost,
            "bound_vs_fifo": bounds.saturated_goodput_bound(sims["fifo"]) / fifo,
            "best_pollux": best,
            "policies": {name: {"saturated_goodput_vs_fifo": r["goodput_saturated_gpu_equiv"] / fifo,
                                "jct_mean_s": r["jct_mean_s"], "restarts": r["restarts"],
                                "slo": r["inference_slo_attainment"]}
                         for name, r in results.items()},
        }
        huorn_jct, best_jct = results["huorn"]["jct_mean_s"], results[best]["jct_mean_s"]
        row["huorn_jct_reduction_vs_best_pollux"] = 1 - huorn_jct / best_jct
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args.output, plot)


def plot(rows: list[dict], path: Path) -> None:
    key = "saturated_goodput_vs_fifo"
    flat = [{**r, f"huorn_{key}": r["policies"]["huorn"][key],
             f"best_pollux_{key}": r["policies"][r["best_pollux"]][key]} for r in rows]
    report.plot_goodput_sensitivity(flat, path, "restart_cost", "restart time (× the catalogue's)")


if __name__ == "__main__":
    main()
