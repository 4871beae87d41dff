"""Data-parallel training actors against one, side by side in one run: the same pretrained policy,
algorithm (Lite PPO), prompts and seed, with `roles.actorTrain.replicas` 1 (the baseline) and 2
(two trainers, one gloo group, each taking half of every mini-batch). Each run is the real
controller over a local Ray cluster of two CPUs with one rollout worker, so on this 2-core VM the
second trainer has a core to use while the update runs, as a second GPU would.

    .venv/bin/python benchmarks/rl_data_parallel.py                  # ~2.5 min on the 2-core VM
    .venv/bin/python benchmarks/rl_data_parallel.py --base-steps 100 --rl-steps 4 --eval-prompts 16  # smoke

It reports the update's seconds a step (what a second trainer can shorten) and wall seconds per
step, with the ratios, and how far apart the two runs' losses and rewards are step by step: the
group makes the update one trainer makes, so they should differ only by float rounding (which
can change a sampled token late in a run, and from there the samples). It plots both
(docs/figures/rl_data_parallel.png).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import matplotlib
import rl_algorithms
import rl_async
import trainer_runs

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

TRAINERS = {"1 trainer": 1, "2 trainers": 2}


def summarise(events: list[dict]) -> dict:
    steps = [e for e in events if e["event"] == "rl"]
    evals = [e for e in events if e["event"] == "eval"]
    return {
        "update_seconds_median": round(statistics.median(e["update_seconds"] for e in steps[1:]), 3),
        "seconds_per_step_median": round(statistics.median(rl_async.step_seconds(events)), 3),
        "rollout_seconds_median": round(statistics.median(e["rollout_seconds"] for e in steps[1:]), 3),
        "trainers": sorted({e["trainers"] for e in steps}),
        "accuracy_before": evals[0]["accuracy"], "accuracy_after": evals[-1]["accuracy"],
    }


def agreement(one: list[dict], two: list[dict]) -> dict:
    """Step by step: the first step whose sampled rewards differ, and the largest loss gap before it."""
    a = [e for e in one if e["event"] == "rl"]
    b = [e for e in two if e["event"] == "rl"]
    same = 0
    while same < min(len(a), len(b)) and a[same]["reward_mean"] == b[same]["reward_mean"]:
        same += 1
    gaps = [abs(x["loss"] - y["loss"]) for x, y in zip(a[:same], b[:same], strict=True)]
    return {"steps_with_identical_samples": same, "steps": len(a),
            "max_loss_gap_while_identical": max(gaps) if gaps else None,
            "max_grad_norm_gap_while_identical": max((abs(x["grad_norm"] - y["grad_norm"])
                                                      for x, y in zip(a[:same], b[:same], strict=True)),
                                                     default=None)}


def plot(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    for name, events in runs.items():
        steps = [e for e in events if e["event"] == "rl"]
        left.plot([e["step"] for e in steps], [e["loss"] for e in steps], label=name, alpha=0.8)
        right.plot([e["step"] for e in steps], [e["update_seconds"] for e in steps], label=name)
    left.set_ylabel("the step's loss")
    right.set_ylabel("update seconds")
    trainer_runs.finish_axes((left, right), "RL step")
    trainer_runs.save_figure(figure, title, path)


def main() -> None:
    args = rl_algorithms.parse_args(__doc__, "rl_data_parallel", rl_steps=20)
    started = time.perf_counter()
    # one rollout worker beside the trainers
    runs = rl_algorithms.run_from_base(args, {
        name: rl_algorithms.lite_ppo(args, {"actorTrain": {"replicas": n}, "rollout": {"replicas": 1}})
        for name, n in TRAINERS.items()})
    summary = {name: summarise(events) for name, events in runs.items()}
    one, two = summary["1 trainer"], summary["2 trainers"]
    ratios = {
        "update seconds, 1 / 2 trainers": round(one["update_seconds_median"]
                                                / two["update_seconds_median"], 3),
        "seconds per step, 1 / 2 trainers": round(one["seconds_per_step_median"]
                                                  / two["seconds_per_step_median"], 3),
    }
    agree = agreement(runs["1 trainer"], runs["2 trainers"])
    report = trainer_runs.write_report(args, started, summary=summary, ratios=ratios, agreement=agree)
    plot(runs, args.png, f"Lite PPO, {args.rl_steps} steps x {args.prompts} prompts x {args.group} samples, "
         "one training actor against two (gloo, CPU)")
    for name, row in summary.items():
        print(f"{name:10} update {row['update_seconds_median']:.2f} s, "
              f"step {row['seconds_per_step_median']:.2f} s (rollout {row['rollout_seconds_median']:.2f} s); "
              f"accuracy {row['accuracy_before']:.3f} -> {row['accuracy_after']:.3f}")
    print(json.dumps(ratios))
    print(json.dumps(agree))
    print(f"wrote {args.out} and {args.png} in {report['seconds']} s")


if __name__ == "__main__":
    main()
