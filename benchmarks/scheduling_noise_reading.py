"""What the jitter of the noise-scale readings costs Huorn and Pollux: the same seeds with a fresh
reading every tick (the rule) and with each reading kept longer.

Why: since 2026-12-07 the simulator's policies read each job's gradient noise scale as the
runtime reports it, the truth times a log-normal error drawn afresh every 60 s tick
(`SimConfig.noise_reading_seconds`; the runtime's reading decorrelates within about 40 steps,
benchmarks/noise_scale_reading.py). A fresh error moves each job's goodput table, and an
allocator may resize for it. This study keeps each reading for longer (a job's first reading
still comes at once) and reports, per setting, Huorn's mean JCT against the best Pollux and both
policies' restarts. The benchmark's own figures stay those of a reading every tick.

    .venv/bin/python benchmarks/scheduling_noise_reading.py [--seeds 0-9] [--periods 60,300,1800]
"""

from __future__ import annotations

import functools
import json
import statistics

from study_common import POLLUXES, TRACE, run_seeds, seed_list, seed_study_arguments, write

from huorn.sim import engine, report, run


def one_seed(task: tuple[int, int, float, str], period: float) -> dict:
    seed, gpus, load, qps_start = task
    config = engine.SimConfig(gpus=gpus, seed=seed, load=load, qps_start=qps_start,
                              noise_reading_seconds=period)
    results, _ = run.run_policies(*TRACE, [*POLLUXES, "huorn"], config)
    best = report.best_pollux(results)
    huorn_jct, best_jct = results["huorn"]["jct_mean_s"], results[best]["jct_mean_s"]
    return {
        "seed": seed, "gpus": gpus, "load": load, "qps_start": qps_start, "noise_reading_seconds": period,
        "best_pollux": best,
        "huorn_jct_reduction_vs_best_pollux": 1 - huorn_jct / best_jct,
        "policies": {name: {"jct_mean_s": r["jct_mean_s"], "restarts": r["restarts"]}
                     for name, r in results.items()},
    }


def main() -> None:
    parser = seed_study_arguments(__doc__ or "", "0-9", "noise_reading.json")
    parser.add_argument("--periods", default="60,300,1800", help="seconds a reading is kept, comma-separated")
    args = parser.parse_args()
    periods = [float(p) for p in args.periods.split(",")]
    rows: list[dict] = []
    for period in periods:
        rows += run_seeds(functools.partial(one_seed, period=period), args, seed_list(args.seeds))
    write(rows, args.output)
    for period in periods:
        mine = [r for r in rows if r["noise_reading_seconds"] == period]
        margin = statistics.mean(r["huorn_jct_reduction_vs_best_pollux"] for r in mine)
        huorn = statistics.mean(r["policies"]["huorn"]["jct_mean_s"] for r in mine)
        best = statistics.mean(r["policies"][r["best_pollux"]]["jct_mean_s"] for r in mine)
        restarts = {name: statistics.mean(r["policies"][name]["restarts"] for r in mine)
                    for name in ("huorn", "pollux", "pollux-arrival")}
        print(json.dumps({"noise_reading_seconds": period, "margin": round(margin, 4),
                          "huorn_jct_mean_s": round(huorn), "best_pollux_jct_mean_s": round(best),
                          "restarts": {k: round(v) for k, v in restarts.items()}}))


if __name__ == "__main__":
    main()
