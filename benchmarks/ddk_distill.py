"""DDK distillation on CPU, side by side in one run: a student trained alone, a student distilled
with a fixed even mix, and a student distilled with DDK's domain reweighting, all from the same
teacher, with the same steps, seed and architecture. Every run is the real trainer process
(`python -m huorn.runtime.train`), and every score is the real evaluator's per-source
validation loss (huorn.runtime.evaluate).

    .venv/bin/python benchmarks/ddk_distill.py                        # ~5 min on the 2-core VM
    .venv/bin/python benchmarks/ddk_distill.py --teacher-steps 60 --student-steps 40   # smoke run

It reports each student's loss on every source, their mean and the worst source, with ratios
against both baselines, and plots them with DDK's weights over the run
(docs/figures/ddk_distill.png). DDK's promise is the worst source: the mix moves toward where
the student lags the teacher most.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib
import trainer_runs
from rich.progress import Progress

from huorn.runtime import checkpoint, evaluate
from huorn.runtime import config as run_config

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["general", "code", "math"]
VARIANTS = ["alone", "kd-even", "ddk"]


def spec(args: argparse.Namespace, *, teacher: Path | None, steps: int, model: dict, ddk: bool) -> dict:
    task = ({"kind": "distill", "teacher": {"checkpoint": str(teacher), "reweightSteps": args.reweight_steps,
                                            "klWeight": args.kl_weight}} if teacher else {"kind": "pretrain"})
    return {
        "task": task,
        "virtualCluster": "bench",
        "model": model,
        "data": {"sources": [{"name": s, "weight": 1} for s in SOURCES], "seed": args.seed,
                 "mixture": "auto" if ddk else "manual"},
        "optimization": {"globalBatch": args.batch, "microBatch": args.batch, "learningRate": args.lr,
                         "warmupSteps": max(1, steps // 20), "steps": steps},
        "checkpoint": {"path": "/checkpoints", "intervalSteps": steps},
    }


def train(name: str, body: dict, out: Path, data_dir: Path, progress: Progress) -> run_config.RunConfig:
    """One trainer from scratch (trainer_runs.start_trainer clears its folder: this script once
    kept its own copy that did not, and a second run resumed the first one's final checkpoints,
    trained nothing, and scored the old models)."""
    directory = out / name
    config, process = trainer_runs.start_trainer(name, body, out, data_dir)
    steps_file = directory / "run" / run_config.STEPS_FILE
    task = progress.add_task(name, total=body["optimization"]["steps"])
    while process.poll() is None:
        time.sleep(0.5)
        done = steps_file.read_text().count('"event": "step"') if steps_file.exists() else 0
        progress.update(task, completed=done)
    if process.returncode != 0:
        raise SystemExit(f"{name} failed; see {directory / 'train.log'}")
    progress.update(task, completed=body["optimization"]["steps"])
    return config


def score(config: run_config.RunConfig, batches: int) -> dict:
    latest = checkpoint.find_latest(config.checkpoint_root)
    assert latest is not None
    return evaluate.evaluate(config, latest, batches)


def ddk_weights(config: run_config.RunConfig) -> list[dict]:
    lines = (Path(config.run_dir) / run_config.STEPS_FILE).read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == "ddk"]


def plot(results: dict, weights: list[dict], path: Path, title: str) -> None:
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    width = 0.26
    for i, variant in enumerate(VARIANTS):
        losses = [results[variant]["sources"][s] for s in SOURCES]
        left.bar([x + (i - 1) * width for x in range(len(SOURCES))], losses, width, label=variant)
    left.set_xticks(range(len(SOURCES)), SOURCES)
    left.set_ylabel("validation loss (nats/byte)")
    lowest = min(min(r["sources"].values()) for r in results.values())
    left.set_ylim(lowest - 0.15, None)
    left.legend()
    left.set_title("per-source validation loss of each student", fontsize=9)
    for j, source in enumerate(SOURCES):
        right.plot([e["step"] for e in weights], [e["weights"][j] for e in weights], marker="o",
                   markersize=3, label=source)
    right.set_xlabel("step")
    right.set_ylabel("DDK's sampling weight")
    right.set_title("DDK's mix over the run", fontsize=9)
    right.grid(alpha=0.3)
    right.legend()
    trainer_runs.save_figure(figure, title, path)


def parse_args() -> argparse.Namespace:
    parser = trainer_runs.argument_parser(__doc__, "ddk_distill")
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--student-steps", type=int, default=200)
    parser.add_argument("--reweight-steps", type=int, default=20, help="DDK's K")
    parser.add_argument("--kl-weight", type=float, default=0.2, help="DDK's γ")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-batches", type=int, default=16)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    data_dir = trainer_runs.build_corpora(args.work)
    big = {"layers": 4, "width": 96, "heads": 4, "context": 64}
    small = {"layers": 2, "width": 48, "heads": 2, "context": 64}
    results, configs = {}, {}
    with Progress() as progress:
        teacher = train("teacher", spec(args, teacher=None, steps=args.teacher_steps, model=big, ddk=False),
                        args.work, data_dir, progress)
        results["teacher"] = score(teacher, args.eval_batches)
        root = teacher.checkpoint_root
        plans = {"alone": (None, False), "kd-even": (root, False), "ddk": (root, True)}
        for variant, (source, auto) in plans.items():
            body = spec(args, teacher=source, steps=args.student_steps, model=small, ddk=auto)
            configs[variant] = train(variant, body, args.work, data_dir, progress)
            results[variant] = score(configs[variant], args.eval_batches)
    summary = {}
    for name, result in results.items():
        losses = [result["sources"][s] for s in SOURCES]
        summary[name] = {"sources": {s: round(result["sources"][s], 4) for s in SOURCES},
                         "mean": round(sum(losses) / len(losses), 4), "worst": round(max(losses), 4),
                         "worst_source": SOURCES[losses.index(max(losses))]}
    ratios = {f"ddk/{base}": {k: round(summary["ddk"][k] / summary[base][k], 4) for k in ("mean", "worst")}
              for base in ("alone", "kd-even")}
    weights = ddk_weights(configs["ddk"])
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "teacher_model": big, "student_model": small, "summary": summary, "ratios": ratios,
              "ddk_weights": [{"step": e["step"], "weights": [round(w, 4) for w in e["weights"]],
                               "ratios": [round(r, 4) for r in e["ratios"]]} for e in weights],
              "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot({v: results[v] for v in VARIANTS}, weights, args.png,
         f"teacher {big['layers']}x{big['width']} ({args.teacher_steps} steps), students "
         f"{small['layers']}x{small['width']} ({args.student_steps} steps), K={args.reweight_steps}")
    print(f"{'':10}" + "".join(f"{s:>10}" for s in [*SOURCES, "mean", "worst"]))
    for name, row in summary.items():
        print(f"{name:10}" + "".join(f"{row['sources'][s]:10.4f}" for s in SOURCES)
              + f"{row['mean']:10.4f}{row['worst']:10.4f}")
    print(json.dumps(ratios))
    print(f"wrote {args.out} and {args.png} in {report['seconds']} s")


if __name__ == "__main__":
    main()
