"""RL on CPU, side by side in one run: GRPO, DAPO and Lite PPO from the same pretrained policy,
against that policy without RL (the baseline), on verifiable arithmetic (`arithmetic-small`).
The base is the real trainer (`python -m huorn.runtime.train`) on the shipped math corpus;
each RL run is the real controller (`python -m huorn.runtime.rl.controller`) over a local Ray
cluster with two rollout workers and a reward worker (and a reference worker for GRPO's KL).

    .venv/bin/python benchmarks/rl_algorithms.py                 # ~10 min on the 2-core VM
    .venv/bin/python benchmarks/rl_algorithms.py --base-steps 100 --rl-steps 4 --eval-prompts 32  # smoke

It reports greedy accuracy on held-out prompts before and after, the ratios against the
baseline and between the algorithms, and plots the training reward per step
(docs/figures/rl_algorithms.png).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import matplotlib
import trainer_runs
from rich.progress import Progress

from huorn.runtime.rl import controller

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

ROOT = Path(__file__).resolve().parents[1]
ALGORITHMS = ["grpo", "dapo", "lite-ppo"]


def base_spec(args: argparse.Namespace) -> dict:
    return {"virtualCluster": "bench", "model": args.model,
            "data": {"sources": [{"name": "math", "weight": 1}], "seed": args.seed},
            "optimization": {"globalBatch": 16, "microBatch": 16, "learningRate": 3e-3,
                             "warmupSteps": max(1, args.base_steps // 20), "steps": args.base_steps},
            "checkpoint": {"path": "/checkpoints", "intervalSteps": args.base_steps}}


def rl_spec(args: argparse.Namespace, algorithm: str, init: Path) -> dict:
    return {"virtualCluster": "bench", "model": args.model, "initCheckpoint": str(init),
            "steps": args.rl_steps,
            "algorithm": {"name": algorithm, "groupSize": args.group},
            "reward": {"type": "math-exact", "dataset": "arithmetic-small"},
            "rollout": {"maxNewTokens": 8, "temperature": 1.0},
            "optimization": {"learningRate": args.lr, "promptsPerStep": args.prompts, "miniBatches": 2,
                             "seed": args.seed},
            "roles": {"rollout": {"replicas": 2}, "reward": {"replicas": 1}},
            "checkpoint": {"path": "/checkpoints", "intervalSteps": args.rl_steps}}


def run_rl(name: str, spec: dict, args: argparse.Namespace, progress: Progress) -> list[dict]:
    directory = args.work / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    config = directory / "config.json"
    config.write_text(json.dumps({"jobName": name, "spec": spec, "runDir": str(directory / "run"),
                                  "checkpointDir": str(directory / "ckpt"), "evalPrompts": args.eval_prompts,
                                  "rayCpus": 2}))
    steps_file = directory / "run" / controller.STEPS_FILE
    task = progress.add_task(name, total=args.rl_steps)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(directory / "rl.log", "wb") as log:
        command = [sys.executable, "-m", "huorn.runtime.rl.controller", "--config", str(config)]
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        while process.poll() is None:
            time.sleep(0.5)
            done = steps_file.read_text().count('"event": "rl"') if steps_file.exists() else 0
            progress.update(task, completed=done)
    if process.returncode != 0:
        raise SystemExit(f"{name} failed; see {directory / 'rl.log'}")
    return [json.loads(line) for line in steps_file.read_text().splitlines()]


def plot(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    for name, events in runs.items():
        steps = [e for e in events if e["event"] == "rl"]
        rewards = [e["reward_mean"] for e in steps]
        windows = [rewards[max(0, i - 4):i + 1] for i in range(len(rewards))]  # 5-step means
        smooth = [sum(w) / len(w) for w in windows]
        left.plot([e["step"] for e in steps], smooth, label=name)
        evals = [e for e in events if e["event"] == "eval"]
        right.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], marker="o", label=name)
    left.set_xlabel("RL step")
    left.set_ylabel("mean reward of the step's samples (5-step mean)")
    right.set_xlabel("RL step")
    right.set_ylabel("greedy accuracy, held-out prompts")
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    trainer_runs.save_figure(figure, title, path)


def parse_args(doc: str | None = __doc__, name: str = "rl_algorithms",
               rl_steps: int = 60) -> argparse.Namespace:
    """The RL benchmarks' arguments and policy (benchmarks/rl_async.py shares them)."""
    parser = trainer_runs.argument_parser(doc, name)
    parser.add_argument("--base-steps", type=int, default=1500)
    parser.add_argument("--rl-steps", type=int, default=rl_steps)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    parser.add_argument("--group", type=int, default=8, help="responses per prompt")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--eval-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.model = {"layers": 4, "width": 96, "heads": 4, "context": 64}
    return args


def lite_ppo(args: argparse.Namespace, roles: dict, rollout: dict | None = None) -> Callable[[Path], dict]:
    """A variant for `run_from_base`: Lite PPO with these roles (and rollout fields). Without a
    reward role the controller scores in its own process."""
    def build(init: Path) -> dict:
        spec = rl_spec(args, "lite-ppo", init)
        spec["rollout"].update(rollout or {})
        spec["roles"] = roles
        return spec
    return build


def run_from_base(args: argparse.Namespace, variants: Mapping[str, Callable[[Path], dict]]
                  ) -> dict[str, list[dict]]:
    """The base policy pretrained once by the real trainer, then one RL run per variant: each
    builds its spec from the base's checkpoint root. Returns each run's step log."""
    data_dir = trainer_runs.build_corpora(args.work)
    runs: dict[str, list[dict]] = {}
    with Progress() as progress:
        base = trainer_runs.run_all({"base": base_spec(args)}, args.work, data_dir, progress, 1)["base"]
        for name, build in variants.items():
            runs[name] = run_rl(name.replace(" ", "-"), build(base.checkpoint_root), args, progress)
    return runs


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    runs = run_from_base(args, {algorithm: functools.partial(rl_spec, args, algorithm)
                                for algorithm in ALGORITHMS})
    summary = {}
    for name, events in runs.items():
        evals = [e for e in events if e["event"] == "eval"]
        steps = [e for e in events if e["event"] == "rl"]
        last = steps[-10:]
        summary[name] = {
            "accuracy_before": evals[0]["accuracy"], "accuracy_after": evals[-1]["accuracy"],
            "eval_prompts": evals[-1]["prompts"],
            "train_reward_first_10": round(sum(e["reward_mean"] for e in steps[:10]) / len(steps[:10]), 4),
            "train_reward_last_10": round(sum(e["reward_mean"] for e in last) / len(last), 4),
            "seconds_per_step": round(sum(e.get("rollout_seconds", 0) + e.get("update_seconds", 0)
                                          for e in steps) / len(steps), 3),
            "groups_dropped": sum(e["groups_dropped"] for e in steps),
            "mean_clip_fraction": round(sum(e.get("clip_fraction", 0) for e in steps) / len(steps), 4),
            "examples": evals[-1]["examples"],
        }
    baseline = summary[ALGORITHMS[0]]["accuracy_before"]  # the same policy and prompts for all three
    ratios = {f"{name}/baseline": round(row["accuracy_after"] / baseline, 3) if baseline else None
              for name, row in summary.items()}
    for other in ("grpo", "dapo"):
        mine, theirs = summary["lite-ppo"]["accuracy_after"], summary[other]["accuracy_after"]
        ratios[f"lite-ppo/{other}"] = round(mine / theirs, 3) if theirs else None
    report = trainer_runs.write_report(args, started, baseline_accuracy=baseline, summary=summary,
                                       ratios=ratios)
    plot(runs, args.png, f"{args.model['layers']}x{args.model['width']} policy pretrained "
         f"{args.base_steps} steps on the math corpus; RL {args.rl_steps} steps x {args.prompts} prompts "
         f"x {args.group} samples")
    print(f"baseline (no RL) greedy accuracy: {baseline:.3f}")
    for name, row in summary.items():
        print(f"{name:10} accuracy {row['accuracy_before']:.3f} -> {row['accuracy_after']:.3f}; train reward "
              f"{row['train_reward_first_10']:.3f} -> {row['train_reward_last_10']:.3f}")
    print(json.dumps(ratios))
    print(f"wrote {args.out} and {args.png} in {report['seconds']} s")


if __name__ == "__main__":
    main()
