"""All scheduling policies on the OpenB trace at 128 and 1,024 GPUs, in one run, with ratios.

    .venv/bin/python benchmarks/scheduling_sim.py --output benchmarks/results/scheduling_sim
    python3 benchmarks/scheduling_sim.py --jobs 8          # a host with 8 cores to spare: every case at once

Baselines (static gang FIFO, Kueue-style borrowing with preemption, Pollux at its fairness exponent
p = 1, at the paper's p = -1, and at p = -1 with the paper's fair-share speedup, each of the three
also with AdaptDL's admission on arrival) and Huorn run in the same simulator on the same scaled
trace; the best baseline per case is the best of all eight. The
script prints the issue's goals next to what was measured: Huorn's mean JCT ≥ 25 % below the best
baseline, goodput ≥ 1.8× static FIFO (every goodput measure of huorn/sim/report.py), inference
SLO ≥ 99 %, and the whole trace at 1,024 GPUs in < 60 s (CPU and wall seconds per policy). Each
case runs at the trace's load (0.8) and at 1.5.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from rich.progress import track
from study_common import TRACE

from huorn.sim import engine, report, run


def run_case(case: tuple[int, str, float], seed: int, output: Path) -> tuple[str, dict, list[str]]:
    """One case, every policy in turn in this process (so that each one's CPU seconds are its
    own): its report directory written, its summary entry and its printed lines returned."""
    gpus, qps_start, load = case
    config = engine.SimConfig(gpus=gpus, seed=seed, qps_start=qps_start, load=load)
    suffix = "" if load == 0.8 else f"-load{load:g}"
    tag = f"{gpus} GPUs {qps_start[:5]} load {load:g}"
    results: dict[str, dict] = {}
    sims: dict[str, engine.Simulation] = {}
    lines: list[str] = []
    for name in report.ORDER:  # fifo, kueue, the six Pollux forms, huorn
        start = time.process_time()
        r, s = run.run_policies(*TRACE, [name], config)
        cpu = time.process_time() - start
        results.update(r)
        sims.update(s)
        results[name]["cpu_seconds"] = cpu
        lines.append(f"{tag} {name:>23}: mean JCT {r[name]['jct_mean_s']:8.0f} s  p99 "
                     f"{r[name]['jct_p99_s']:8.0f} s  goodput {r[name]['goodput_gpu_equiv']:7.1f}  saturated "
                     f"{r[name]['goodput_saturated_gpu_equiv']:7.1f}  SLO "
                     f"{r[name]['inference_slo_attainment']:.4f}  preemptions {r[name]['preemptions']:4d}  "
                     f"cpu {cpu:5.1f} s  wall {r[name]['wall_seconds']:5.1f} s")
    report.write_report(output / f"gpus{gpus}-{qps_start}{suffix}", results, sims)
    cmp = report.compare(results)
    lines.append(f"{tag}: Huorn mean JCT {100 * cmp['mean_jct_reduction_vs_best']:.1f} % below "
                 f"{cmp['best_baseline_by_mean_jct']} (goal ≥ 25 %); goodput vs FIFO (goal ≥ 1.8×): "
                 f"saturated window {cmp['saturated_goodput_vs_fifo']:.2f}×, arrival window "
                 f"{cmp['goodput_vs_fifo']:.2f}×, "
                 f"per job {cmp['job_goodput_vs_fifo']:.2f}×, per job with queueing "
                 f"{cmp['job_goodput_with_wait_vs_fifo']:.2f}×; saturated vs the best baseline "
                 f"({cmp['best_baseline_by_saturated_goodput']}) {cmp['saturated_goodput_vs_best']:.2f}×; "
                 f"SLO {cmp['inference_slo_attainment']:.4f} (goal ≥ 0.99)")
    entry = {"load": load, "policies": results, "huorn_vs_baselines": cmp}
    return f"{gpus}-{qps_start}{suffix}", entry, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/scheduling_sim"))
    parser.add_argument("--sizes", default="128,1024")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--qps-start", default="middle,beginning")
    parser.add_argument("--loads", default="0.8,1.5", help="offered loads; 0.8 is the trace's default")
    parser.add_argument("--jobs", type=int, default=1,
                        help="cases run at once, one process each (a case's policies run in turn)")
    args = parser.parse_args()
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    cases = [(int(g), q, float(load)) for load in args.loads.split(",") for q in args.qps_start.split(",")
             for g in args.sizes.split(",")]
    for gpus, qps_start, load in cases:  # a bad case is refused before any case has run
        try:
            engine.SimConfig(gpus=gpus, seed=args.seed, qps_start=qps_start, load=load)
        except ValueError as error:
            parser.error(str(error))
    entries: dict[str, dict] = {}
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(run_case, case, args.seed, args.output) for case in cases]
        try:
            for future in track(as_completed(futures), total=len(futures), description="cases"):
                key, entry, lines = future.result()
                entries[key] = entry
                print("\n".join(lines), flush=True)
        except BaseException:
            # stop at the first failure, as one case after another did: the queued cases would
            # otherwise run on, rewriting their reports with no summary.json written after them
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    args.output.mkdir(parents=True, exist_ok=True)
    summary = {key: entries[key] for key in sorted(entries)}
    (args.output / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
