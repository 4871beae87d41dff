"""S2 applied to a real job: a rank that becomes slower per micro-batch, with and without S2.

Both runs are the same TrainingJob on the local backend (2 replicas of the real trainer, gloo on
CPU), the same `slow-compute` fault (perMicroBatch) on trainer-1 from step SLOW_FROM on, and the
same monitor loop with the remediation policy. The baseline caps the ladder at `observe` (what a
job without S2 does: detect, wait); Huorn allows `rebalance`, so the ladder takes S2, the local
backend writes the counts and the trainer applies them. Reported: median step time after the
onset (baseline) and after S2 took effect (Huorn), their ratio, the job's wall time, and the
counts. Writes JSON and a PNG (step time vs step).

    .venv/bin/python benchmarks/s2_local.py [--out benchmarks/results/s2_local] [--slow-ms 80]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remediation_run import LocalJob, run_local_job  # noqa: E402

from huorn.api.common import MitigationLevel  # noqa: E402
from huorn.scheduler.remediation import ladder  # noqa: E402

STEPS, SLOW_FROM = 80, 15
JOB = LocalJob(layers=2, replicas=2, micro_batch=1, steps=STEPS, pipeline_stages=None, timeout_s=600)


def run_job(cap: str, slow_ms: float, workdir: Path) -> dict:
    faults = [{"kind": "slow-compute", "ms": slow_ms, "perMicroBatch": True, "fromStep": SLOW_FROM,
               "replica": "trainer-1"}]
    run = run_local_job(cap, cap, faults, workdir, JOB, ladder.LadderCosts(rebalance=1.0))
    plans = [r for r in run.records if r.get("event") == "microbatch-plan"]
    s2 = [d for d in run.remediation.decisions if d.level is MitigationLevel.REBALANCE]
    return {"cap": cap, "wall_seconds": run.wall_seconds, "step_seconds": run.step_seconds(),
            "applied_from": plans[0]["from_step"] if plans else None,
            "counts": plans[0]["counts"] if plans else None,
            "reason": s2[0].reason if s2 else None, "mutations": run.mutations()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "s2_local")
    parser.add_argument("--slow-ms", type=float, default=80.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="huorn-s2-") as scratch:
        baseline = run_job("observe", args.slow_ms, Path(scratch))
        huorn = run_job("rebalance", args.slow_ms, Path(scratch))
    if huorn["applied_from"] is None:
        raise SystemExit("S2 was never applied; see the run's actions.jsonl")
    start = huorn["applied_from"]
    base_after = statistics.median(s for k, s in baseline["step_seconds"].items() if k > SLOW_FROM + 2)
    huorn_after = statistics.median(s for k, s in huorn["step_seconds"].items() if k > start)
    summary = {
        "slow_ms_per_micro_batch": args.slow_ms, "steps": STEPS, "slow_from": SLOW_FROM,
        "baseline_median_step_s": base_after, "huorn_median_step_s_after_s2": huorn_after,
        "speedup": base_after / huorn_after, "baseline_wall_s": baseline["wall_seconds"],
        "huorn_wall_s": huorn["wall_seconds"], "s2_applied_from_step": start, "counts": huorn["counts"],
        "reason": huorn["reason"], "mutations": huorn["mutations"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "s2_local.json").write_text(json.dumps(
        {**summary, "runs": {"baseline": baseline, "huorn": huorn}}, indent=2, default=str) + "\n")
    fig, ax = plt.subplots(figsize=(8, 4))
    for run, label in ((baseline, "baseline (maxMitigation: observe)"), (huorn, "Huorn (S2 allowed)")):
        xs = sorted(int(k) for k in run["step_seconds"])
        ax.plot(xs, [run["step_seconds"][k] for k in xs], label=label)
    ax.axvline(SLOW_FROM, color="grey", linestyle=":", label="rank 1 slows down")
    ax.axvline(start, color="green", linestyle="--", label=f"S2 applied: counts {huorn['counts']}")
    ax.set_xlabel("step")
    ax.set_ylabel("step seconds")
    ax.set_title(f"S2 on the local backend: {base_after / huorn_after:.2f}× faster steps after S2")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "s2_local.png", dpi=120)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
