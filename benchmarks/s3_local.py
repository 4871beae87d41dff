"""S3 applied to a real pipelined job: one stage's device becomes slower per layer, with and
without S3 (re-splitting the layers).

Every run is the same TrainingJob on the local backend: the real pipeline trainer under torchrun,
2 stages × 1 replica, an 8-layer decoder, gloo on CPU. From step SLOW_FROM on, the stage-0 rank
gets a `slow-compute` fault with `perLayer` (every layer's forward on that rank takes `--slow-ms`
longer, so the cost moves with the layers it holds). The same monitor loop and remediation policy
run in every case:

- the baseline caps the ladder at `observe` (detect, wait), what a job without S3 does;
- Huorn allows `resplit`: the ladder takes S3, the graph gets a `stageLayers` set-param, and the
  backend drains the gang at a coordinated checkpoint and restarts it on the new split;
- a healthy run (no fault) gives the step time the slowdown took away.

Reported: the median step time after the onset (baseline) and after the restart on the new
split (Huorn), their ratio, the share of the lost throughput S3 won back, the split, the wall
times, and a PNG of step time against step.

    .venv/bin/python benchmarks/s3_local.py [--out benchmarks/results/s3_local] [--slow-ms 15]
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

STEPS, SLOW_FROM, LAYERS = 70, 12, 8
JOB = LocalJob(layers=LAYERS, replicas=1, micro_batch=2, steps=STEPS)


def run_job(name: str, cap: str, slow_ms: float | None, workdir: Path) -> dict:
    faults = [] if slow_ms is None else [
        {"kind": "slow-compute", "ms": slow_ms, "perLayer": True, "fromStep": SLOW_FROM, "rank": 0}]
    run = run_local_job(name, cap, faults, workdir, JOB, ladder.LadderCosts(resplit=1.0))
    steps = [r for r in run.records if r.get("event") == "step"]
    layouts = {r["step"]: r.get("stage_layers") for r in steps}
    s3 = [d for d in run.remediation.decisions if d.level is MitigationLevel.RESPLIT]
    return {"name": name, "cap": cap, "wall_seconds": run.wall_seconds, "step_seconds": run.step_seconds(),
            "stage_layers": layouts, "split": s3[0].plan["stageLayers"] if s3 else None,
            "reason": s3[0].reason if s3 else None, "mutations": run.mutations()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "s3_local")
    parser.add_argument("--slow-ms", type=float, default=15.0, help="extra ms per layer forward on stage 0")
    args = parser.parse_args()
    if args.slow_ms <= 0:
        parser.error("--slow-ms must be > 0")
    cases = [("healthy", "observe", None), ("baseline", "observe", args.slow_ms),
             ("huorn", "resplit", args.slow_ms)]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="huorn-s3-") as scratch, Progress() as progress:
        task = progress.add_task("S3 benchmark", total=len(cases))
        for name, cap, slow in cases:
            progress.update(task, description=f"{name} run ({STEPS} steps)")
            runs[name] = run_job(name, cap, slow, Path(scratch))
            progress.advance(task)
    huorn = runs["huorn"]
    if huorn["split"] is None:
        raise SystemExit("S3 was never decided; see the run's actions.jsonl")
    even = [LAYERS // 2, LAYERS // 2]
    moved = sorted(s for s, layout in huorn["stage_layers"].items() if layout and layout != even)
    if not moved:
        raise SystemExit("the job never ran on the new split")
    start = moved[0] + 2  # the first steps after a restart warm up

    def median(run: dict, after: int) -> float:
        return statistics.median(s for k, s in run["step_seconds"].items() if k >= after)

    healthy, base, fixed = median(runs["healthy"], SLOW_FROM + 2), median(runs["baseline"], SLOW_FROM + 2), \
        median(huorn, start)
    summary = {
        "slow_ms_per_layer": args.slow_ms, "steps": STEPS, "slow_from": SLOW_FROM, "layers": LAYERS,
        "healthy_median_step_s": healthy, "baseline_median_step_s": base,
        "huorn_median_step_s_after_s3": fixed, "speedup": base / fixed,
        "recovered_share": (base - fixed) / (base - healthy) if base > healthy else None,
        "split": huorn["split"], "new_split_from_step": moved[0], "reason": huorn["reason"],
        "wall_s": {name: run["wall_seconds"] for name, run in runs.items()}, "mutations": huorn["mutations"],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    payload = json.dumps({**summary, "runs": runs}, indent=2, default=str)
    (args.out / "s3_local.json").write_text(payload + "\n")
    fig, ax = plt.subplots(figsize=(8, 4))
    for name, label in (("healthy", "healthy (no fault)"), ("baseline", "baseline (maxMitigation: observe)"),
                        ("huorn", "Huorn (S3 allowed)")):
        xs = sorted(int(k) for k in runs[name]["step_seconds"])
        ax.plot(xs, [runs[name]["step_seconds"][k] for k in xs], label=label)
    ax.axvline(SLOW_FROM, color="grey", linestyle=":", label="stage 0 slows down")
    ax.axvline(moved[0], color="green", linestyle="--", label=f"runs on split {huorn['split']}")
    ax.set_xlabel("step")
    ax.set_ylabel("step seconds")
    ax.set_title(f"S3 on the local backend: {base / fixed:.2f}× faster steps after the re-split")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / "s3_local.png", dpi=120)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
