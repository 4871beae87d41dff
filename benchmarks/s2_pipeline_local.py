"""S2 applied to a real pipelined job: one pipeline replica's devices become slower per layer,
with and without S2 (moving micro-batches between the pipeline replicas).

Every run is the same TrainingJob on the local backend: the real pipeline trainer under torchrun,
2 stages × 2 replicas (two agents of two ranks), a 4-layer decoder, gloo on CPU, M = 8
micro-batches a step. From step SLOW_FROM on, both ranks of agent trainer-1 get a `slow-compute`
fault with `perLayer` (every layer's forward there takes `--slow-ms` longer), so that whole
pipeline replica runs slower per micro-batch. The same monitor loop and remediation policy run in
every case:

- the baseline caps the ladder at `observe` (detect, wait), what a job without S2 does;
- Huorn allows `rebalance`: the ladder takes S2, the graph gets a `microbatches` set-param with
  one count per pipeline replica, the backend writes the control file, and the trainers run the
  unequal tables from a step boundary on, without a restart;
- a healthy run (no fault) gives the step time the slowdown took away.

Reported: the median step time after the onset (baseline) and after the plan applied (Huorn),
their ratio, the share of the lost throughput S2 won back, the counts, the MILP's prediction,
and a PNG of step time against step.

    PYTHONPATH=. .venv/bin/python benchmarks/s2_pipeline_local.py [--out benchmarks/results/s2_pipeline_local]
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
from rich.progress import Progress  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remediation_run import LocalJob, run_local_job  # noqa: E402

from huorn.api.common import MitigationLevel  # noqa: E402
from huorn.scheduler.remediation import ladder  # noqa: E402

STEPS, SLOW_FROM, LAYERS = 70, 12, 4
JOB = LocalJob(layers=LAYERS, replicas=2, micro_batch=1, steps=STEPS)


def run_job(name: str, cap: str, slow_ms: float | None, workdir: Path) -> dict:
    faults = [] if slow_ms is None else [
        {"kind": "slow-compute", "ms": slow_ms, "perLayer": True, "fromStep": SLOW_FROM,
         "replica": "trainer-1"}]
    run = run_local_job(name, cap, faults, workdir, JOB, ladder.LadderCosts(rebalance=1.0))
    applied = [r for r in run.records if r.get("event") == "microbatch-plan"]
    s2 = [d for d in run.remediation.decisions
          if d.level is MitigationLevel.REBALANCE and "microbatches" in d.plan]
    endpoints = [json.loads(p.read_text()) for p in (run.run_dir / "endpoints").glob("*.json")]
    slow_replica = sorted({e["rank"] // 2 for e in endpoints if e["replica"] == "trainer-1"})
    return {"name": name, "cap": cap, "wall_seconds": run.wall_seconds, "step_seconds": run.step_seconds(),
            "counts": s2[0].plan["microbatches"] if s2 else None,
            "predicted_step_s": s2[0].plan["predictedStepSeconds"] if s2 else None,
            "predicted_even_step_s": s2[0].plan["stepSecondsBefore"] if s2 else None,
            "reason": s2[0].reason if s2 else None,
            "applied_from_step": applied[0]["from_step"] if applied else None,
            "slow_pipeline_replica": slow_replica, "mutations": run.mutations()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "s2_pipeline_local")
    parser.add_argument("--slow-ms", type=float, default=25.0,
                        help="extra ms per layer forward on the slowed replica's ranks")
    args = parser.parse_args()
    if args.slow_ms <= 0:
        parser.error("--slow-ms must be > 0")
    cases = [("healthy", "observe", None), ("baseline", "observe", args.slow_ms),
             ("huorn", "rebalance", args.slow_ms)]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="huorn-s2pp-") as scratch, Progress() as progress:
        task = progress.add_task("S2 (pipelined) benchmark", total=len(cases))
        for name, cap, slow in cases:
            progress.update(task, description=f"{name} run ({STEPS} steps)")
            runs[name] = run_job(name, cap, slow, Path(scratch))
            progress.advance(task)
    huorn = runs["huorn"]
    if huorn["applied_from_step"] is None:
        raise SystemExit("no S2 plan was applied; see the run's actions.jsonl")
    start = huorn["applied_from_step"] + 1

    def median(run: dict, after: int) -> float:
        return statistics.median(s for k, s in run["step_seconds"].items() if k >= after)

    healthy, base, fixed = median(runs["healthy"], SLOW_FROM + 2), median(runs["baseline"], SLOW_FROM + 2), \
        median(huorn, start)
    summary = {
        "slow_ms_per_layer": args.slow_ms, "steps": STEPS, "slow_from": SLOW_FROM, "layers": LAYERS,
        "healthy_median_step_s": healthy, "baseline_median_step_s": base,
        "huorn_median_step_s_after_s2": fixed, "speedup": base / fixed,
        "recovered_share": (base - fixed) / (base - healthy) if base > healthy else None,
        "counts": huorn["counts"], "slow_pipeline_replica": huorn["slow_pipeline_replica"],
        "applied_from_step": huorn["applied_from_step"], "predicted_step_s": huorn["predicted_step_s"],
        "predicted_even_step_s": huorn["predicted_even_step_s"], "reason": huorn["reason"],
        "wall_s": {name: run["wall_seconds"] for name, run in runs.items()}, "mutations": huorn["mutations"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({**summary, "runs": runs}, indent=2, default=str)
    (args.out / "s2_pipeline_local.json").write_text(payload + "\n")
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, label in (("healthy", "healthy (no fault)"), ("baseline", "baseline (maxMitigation: observe)"),
                        ("huorn", "Huorn (S2 allowed)")):
        xs = sorted(int(k) for k in runs[name]["step_seconds"])
        ax.plot(xs, [runs[name]["step_seconds"][k] for k in xs], label=label)
    ax.axvline(SLOW_FROM, color="grey", linestyle=":", label="replica trainer-1 slows down")
    ax.axvline(huorn["applied_from_step"], color="green", linestyle="--", label=f"counts {huorn['counts']}")
    ax.set_xlabel("step")
    ax.set_ylabel("step seconds")
    ax.set_title(f"S2 on a pipelined job (2 stages × 2 replicas): {base / fixed:.2f}× faster steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "s2_pipeline_local.png", dpi=120)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
