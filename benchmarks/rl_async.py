"""RL with async generation against synchronous RL, side by side in one run: the same pretrained
policy, algorithm (Lite PPO), prompts and seed, once with `spec.rollout.asyncSteps: 0` (rollout,
then update, in turn: the baseline) and once with 1 (step t+1's responses generated with step t's
weights while step t trains, ROLL's async generation). Each run is the real controller over a
local Ray cluster of two CPUs: one rollout worker and the training actor, so on this 2-core VM the
overlap has a core of its own to use, as a rollout GPU would beside a training GPU.

    .venv/bin/python benchmarks/rl_async.py                  # ~10 min on the 2-core VM
    .venv/bin/python benchmarks/rl_async.py --base-steps 100 --rl-steps 4 --eval-prompts 32  # smoke

It reports wall seconds per RL step (from the step log's timestamps, so the overlap counts), how
long each step stood waiting for its responses, and greedy accuracy on held-out prompts before
and after, with the async/sync ratios; and plots reward and seconds per step
(docs/figures/rl_async.png).
"""

from __future__ import annotations

import itertools
import json
import statistics
import time
from pathlib import Path

import matplotlib
import rl_algorithms
import trainer_runs

matplotlib.use("Agg")
from matplotlib import pyplot  # after choosing the headless backend

MODES = {"sync": 0, "async": 1}


def step_seconds(events: list[dict]) -> list[float]:
    """Wall seconds of each RL step after the first: the gaps between their log records."""
    times = [e["time"] for e in events if e["event"] == "rl"]
    return [b - a for a, b in itertools.pairwise(times)]


def summarise(events: list[dict]) -> dict:
    steps = [e for e in events if e["event"] == "rl"]
    evals = [e for e in events if e["event"] == "eval"]
    gaps = step_seconds(events)
    last = steps[-10:]
    return {
        "seconds_per_step": round(statistics.mean(gaps), 3),
        "seconds_per_step_median": round(statistics.median(gaps), 3),
        "rollout_seconds": round(statistics.mean(e["rollout_seconds"] for e in steps), 3),
        "update_seconds": round(statistics.mean(e.get("update_seconds", 0.0) for e in steps), 3),
        "rollout_wait_seconds": round(statistics.mean(e["rollout_wait_seconds"] for e in steps[1:]), 3),
        "accuracy_before": evals[0]["accuracy"], "accuracy_after": evals[-1]["accuracy"],
        "eval_prompts": evals[-1]["prompts"],
        "train_reward_last_10": round(statistics.mean(e["reward_mean"] for e in last), 4),
        # an async step's ratio is against the policy that sampled, one update behind
        "mean_clip_fraction": round(statistics.mean(e.get("clip_fraction", 0.0) for e in steps), 5),
    }


def plot(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    figure, (left, right) = pyplot.subplots(1, 2, figsize=(11, 4.2))
    for name, events in runs.items():
        steps = [e for e in events if e["event"] == "rl"]
        rewards = [e["reward_mean"] for e in steps]
        smooth = [statistics.mean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
        left.plot([e["step"] for e in steps], smooth, label=name)
        right.plot([e["step"] for e in steps[1:]], step_seconds(events), label=name)
    left.set_ylabel("mean reward of the step's samples (5-step mean)")
    right.set_ylabel("wall seconds per step")
    trainer_runs.finish_axes((left, right), "RL step")
    trainer_runs.save_figure(figure, title, path)


def main() -> None:
    args = rl_algorithms.parse_args(__doc__, "rl_async", rl_steps=40)
    started = time.perf_counter()
    runs = rl_algorithms.run_from_base(args, {
        name: rl_algorithms.lite_ppo(args, {"rollout": {"replicas": 1}}, {"asyncSteps": lag})
        for name, lag in MODES.items()})
    summary = {name: summarise(events) for name, events in runs.items()}
    sync, fast = summary["sync"], summary["async"]
    ratios = {
        "async/sync seconds per step": round(fast["seconds_per_step"] / sync["seconds_per_step"], 3),
        "sync/async steps per second": round(sync["seconds_per_step"] / fast["seconds_per_step"], 3),
        "async/sync accuracy after": (round(fast["accuracy_after"] / sync["accuracy_after"], 3)
                                      if sync["accuracy_after"] else None),
    }
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "summary": summary, "ratios": ratios, "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    plot(runs, args.png, f"Lite PPO, {args.rl_steps} steps x {args.prompts} prompts x {args.group} samples; "
         "sync: rollout then update; async: next rollout during the update")
    for name, row in summary.items():
        print(f"{name:6} {row['seconds_per_step']:.2f} s/step (rollout {row['rollout_seconds']:.2f} s, "
              f"update {row['update_seconds']:.2f} s, waiting {row['rollout_wait_seconds']:.2f} s); accuracy "
              f"{row['accuracy_before']:.3f} -> {row['accuracy_after']:.3f}")
    print(json.dumps(ratios))
    print(f"wrote {args.out} and {args.png} in {report['seconds']} s")


if __name__ == "__main__":
    main()
