"""How the elastic range bounds goodput: Huorn, Pollux and FIFO with each job's range widened.

Why: the 1.8× saturated-window goodput goal is out of reach for any policy at 1,024 GPUs under
the workload rule (each job may grow to 8× its requested replicas, 4× for LLMs, at most 64):
the jobs still running at the window's end are at their caps (docs/scheduling.md, caveats).
This study widens every job's range by a factor (2× and 4×: 16× its request, at most 128
replicas, and 32×, at most 256) and re-runs the same trace, so that the report can say whether
the goal is out of reach because of the rule or because of the scheduler. The rule itself is not
changed: the benchmark's figures stay those of factor 1.

    .venv/bin/python benchmarks/scheduling_elastic_range.py [--cases 1024:0:0.8,128:0:0.8] [--ranges 1,2,4]
    .venv/bin/python benchmarks/scheduling_elastic_range.py --plot-only   # redraw the PNG from the JSON
"""

from __future__ import annotations

import json
from pathlib import Path

from rich.progress import track
from study_common import POLLUXES, TRACE, arguments, case, redraw, write

from huorn.sim import bounds, engine, report, run


def main() -> None:
    parser = arguments(__doc__, "1024:0:0.8,128:0:0.8", "elastic_range.json")
    parser.add_argument("--ranges", default="1,2,4", help="elastic-range factors, comma-separated")
    args = parser.parse_args()
    if redraw(args, plot):
        return
    work = [(case(c), int(r)) for c in args.cases.split(",") for r in args.ranges.split(",")]
    rows = []
    for (gpus, seed, load), factor in track(work, description="cases"):
        config = engine.SimConfig(gpus=gpus, seed=seed, load=load, elastic_range=factor)
        results, sims = run.run_policies(*TRACE, ["fifo", *POLLUXES, "huorn"], config)
        fifo = results["fifo"]["goodput_saturated_gpu_equiv"]
        best = report.best_pollux(results)
        huorn = results["huorn"]
        row = {
            "gpus": gpus, "seed": seed, "load": load, "elastic_range": factor,
            "bound_vs_fifo": bounds.saturated_goodput_bound(sims["fifo"]) / fifo,
            "huorn_saturated_goodput_vs_fifo": huorn["goodput_saturated_gpu_equiv"] / fifo,
            "best_pollux": best,
            "best_pollux_saturated_goodput_vs_fifo": results[best]["goodput_saturated_gpu_equiv"] / fifo,
            "huorn_jct_mean_s": huorn["jct_mean_s"], "best_pollux_jct_mean_s": results[best]["jct_mean_s"],
            "huorn_jct_reduction_vs_best_pollux": 1 - huorn["jct_mean_s"] / results[best]["jct_mean_s"],
            "huorn_slo": huorn["inference_slo_attainment"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    write(rows, args.output, plot)


def plot(rows: list[dict], path: Path) -> None:
    report.plot_goodput_sensitivity(rows, path, "elastic_range", "elastic range (× the rule's)", log2=True)


if __name__ == "__main__":
    main()
