"""How much of Huorn's JCT gain survives a wrong or missing declaration of each job's length.

Why: Huorn's JCT-aware terms (the remaining-time weight, restarts charged over the remaining time,
shortest-remaining admission, jobs near their end kept whole) read each job's remaining work. In
the simulator that was exact; in a cluster it comes from the spec's declared steps or tokens, which
a job that stops early, or was declared by guesswork, gets wrong, and which some specs leave out.
This study re-runs the same trace with every job's declared total off by a log-normal factor
(`SimConfig.work_estimate_error`, the σ of its natural log: 0.5 is "within 1.65× either way for two
jobs in three") and with a share of jobs declaring nothing (`SimConfig.undeclared_share`), and
reports Huorn's mean JCT against the best Pollux, which reads no declaration and so runs once per
case. The benchmark's own figures stay those of exact declarations.

    .venv/bin/python benchmarks/scheduling_work_estimate.py [--cases 128:0:0.8,128:0:1.5,1024:0:0.8]
    .venv/bin/python benchmarks/scheduling_work_estimate.py --plot-only   # redraw the PNG from the JSON
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from rich.progress import track
from study_common import POLLUXES, TRACE, arguments, case, redraw, write

from huorn.sim import engine, report, run

# (work_estimate_error, undeclared_share): exact, three error levels, half and all undeclared.
VARIANTS = ((0.0, 0.0), (0.25, 0.0), (0.5, 0.0), (1.0, 0.0), (0.0, 0.5), (0.0, 1.0))


def main() -> None:
    args = arguments(__doc__, "128:0:0.8,128:0:1.5,1024:0:0.8", "work_estimate.json").parse_args()
    if redraw(args, plot):
        return
    rows = []
    for gpus, seed, load in track([case(c) for c in args.cases.split(",")], description="cases"):
        config = engine.SimConfig(gpus=gpus, seed=seed, load=load)
        baselines, _ = run.run_policies(*TRACE, ["fifo", *POLLUXES], config)
        best = report.best_pollux(baselines)
        best_jct = baselines[best]["jct_mean_s"]
        fifo_goodput = baselines["fifo"]["goodput_saturated_gpu_equiv"]
        for error, undeclared in VARIANTS:
            varied = dataclasses.replace(config, work_estimate_error=error, undeclared_share=undeclared)
            huorn = run.run_policies(*TRACE, ["huorn"], varied)[0]["huorn"]
            row = {
                "gpus": gpus, "seed": seed, "load": load,
                "work_estimate_error": error, "undeclared_share": undeclared,
                "best_pollux": best, "best_pollux_jct_mean_s": best_jct,
                "huorn_jct_mean_s": huorn["jct_mean_s"], "huorn_jct_p99_s": huorn["jct_p99_s"],
                "huorn_jct_reduction_vs_best_pollux": 1 - huorn["jct_mean_s"] / best_jct,
                "huorn_saturated_goodput_vs_fifo": huorn["goodput_saturated_gpu_equiv"] / fifo_goodput,
                "huorn_restarts": huorn["restarts"], "huorn_slo": huorn["inference_slo_attainment"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    write(rows, args.output, plot)


def plot(rows: list[dict], path: Path) -> None:
    """Huorn's JCT reduction against the best Pollux: by declaration error (left) and by the
    share of jobs that declare nothing (right), one line per case, with the 25 % goal."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    cases = sorted({(r["gpus"], r["seed"], r["load"]) for r in rows})
    for gpus, seed, load in cases:
        mine = [r for r in rows if (r["gpus"], r["seed"], r["load"]) == (gpus, seed, load)]
        label = f"{gpus:,} GPUs, seed {seed}, load {load:g}"
        noisy = sorted((r for r in mine if r["undeclared_share"] == 0),
                       key=lambda r: r["work_estimate_error"])
        left.plot([r["work_estimate_error"] for r in noisy],
                  [100 * r["huorn_jct_reduction_vs_best_pollux"] for r in noisy], marker="o", label=label)
        missing = sorted((r for r in mine if r["work_estimate_error"] == 0),
                         key=lambda r: r["undeclared_share"])
        right.plot([100 * r["undeclared_share"] for r in missing],
                   [100 * r["huorn_jct_reduction_vs_best_pollux"] for r in missing], marker="o", label=label)
    for ax in (left, right):
        ax.axhline(25, color="grey", ls="--", lw=0.8, label="goal 25 %")
        ax.axhline(0, color="black", lw=0.5)
    left.set_xlabel("σ of log(declared / true total work)")
    right.set_xlabel("jobs that declare no total (%)")
    left.set_ylabel("mean JCT below the best Pollux (%)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
