"""`huorn run` on this machine: a fixed single replica against Huorn's goodput policy, in one run.

    .venv/bin/python benchmarks/local_elastic.py --steps 100 --output benchmarks/results/local_elastic

Three scenarios run one after another through the real CLI (store process, torchrun agents, the
real trainer), each on the quickstart TrainingJob:

1. baseline: `--policy fixed` keeps minReplicas (1), what a non-elastic launcher would do;
2. huorn: `--policy goodput`, the allocator grows the job when its model predicts a gain;
3. huorn-kill9: starts at 2 replicas, one worker is SIGKILLed mid-run; Huorn replaces the replica.

Run directories (with their report.md) go to runs/local_elastic/<scenario>; the summary and the
plot go to --output.

It reports wall time to the last step, tokens/s, the ratio huorn / baseline, the pause of the
resize (last step at 1 replica → first step at 2) and the recovery time after the kill (kill →
first step of the restarted gang), and plots tokens/s over time for the three runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
HUORN = [sys.executable, "-c", "from huorn.cli.main import app; app()"]


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def run_scenario(name: str, out: Path, steps: int, extra: list[str], kill_at: int | None = None) -> dict:
    run_dir = ROOT / "runs" / "local_elastic" / name  # runs/ is git-ignored: checkpoints stay out of git
    argv = [
        *HUORN,
        "run",
        str(ROOT / "examples" / "quickstart.yaml"),
        "--steps",
        str(steps),
        "--run-dir",
        str(run_dir),
        "--no-watch",
        "--interval",
        "0.5",
        *extra,
    ]
    started = time.time()
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(run_dir.parent / f"{name}.out", "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        killed_at = None
        while proc.poll() is None:
            time.sleep(0.3)
            if kill_at is None or killed_at is not None:
                continue
            recs = [r for r in read_records(run_dir) if r.get("event") == "step"]
            if recs and recs[-1]["step"] >= kill_at and recs[-1]["world_size"] == 2:
                pid = json.loads((run_dir / "endpoints" / "trainer-1-0.json").read_text())["pid"]
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
    records = read_records(run_dir)
    step_recs = [r for r in records if r.get("event") == "step"]
    result = {
        "name": name,
        "exit_code": proc.returncode,
        "wall_seconds": time.time() - started,
        "first_step_time": step_recs[0]["time"] - started if step_recs else None,
        "seconds_first_to_last_step": step_recs[-1]["time"] - step_recs[0]["time"] if step_recs else None,
        "mean_tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in step_recs),
        "world_sizes": sorted({r["world_size"] for r in step_recs}),
        "last_step": max(r["step"] for r in step_recs),
        "records": step_recs,
    }
    ones = [r for r in step_recs if r["world_size"] == 1]
    twos = [r for r in step_recs if r["world_size"] == 2]
    if ones and twos and name == "huorn":
        result["resize_pause_seconds"] = twos[0]["time"] - ones[-1]["time"]
    if killed_at is not None:
        after = [r for r in step_recs if r["time"] > killed_at]
        result["recovery_seconds"] = after[0]["time"] - killed_at if after else None
        result["recomputed_steps"] = len(step_recs) - len({r["step"] for r in step_recs})
    return result


def plot(results: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in results:
        recs = r["records"]
        t0 = recs[0]["time"]
        ax.plot(
            [x["time"] - t0 for x in recs],
            [x["tokens_per_second"] for x in recs],
            ".-",
            ms=3,
            lw=1,
            label=f"{r['name']} ({r['mean_tokens_per_second']:.0f} tok/s mean)",
        )
    ax.set_xlabel("seconds since the first step")
    ax.set_ylabel("tokens / s")
    ax.set_title("huorn run on a 2-core CPU VM: fixed 1 replica vs goodput vs kill -9")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results" / "local_elastic")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    results = [
        run_scenario("baseline", args.output, args.steps, ["--policy", "fixed"]),
        run_scenario("huorn", args.output, args.steps, ["--policy", "goodput"]),
        run_scenario(
            "huorn-kill9",
            args.output,
            args.steps,
            ["--replicas", "2", "--policy", "fixed"],
            kill_at=args.steps // 2,
        ),
    ]
    plot(results, args.output / "tokens_per_second.png")
    base, huorn = results[0], results[1]
    summary = {
        "steps": args.steps,
        "results": [{k: v for k, v in r.items() if k != "records"} for r in results],
        "wall_ratio_baseline_over_huorn": base["wall_seconds"] / huorn["wall_seconds"],
        "tokens_per_second_ratio_huorn_over_baseline": huorn["mean_tokens_per_second"]
        / base["mean_tokens_per_second"],
    }
    (args.output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        "| scenario | exit | wall s | first step at s | mean tokens/s | world sizes | resize pause s | "
        "recovery s | recomputed steps |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in summary["results"]:
        print(
            f"| {r['name']} | {r['exit_code']} | {r['wall_seconds']:.1f} | {r['first_step_time']:.1f} | "
            f"{r['mean_tokens_per_second']:.0f} | {r['world_sizes']} | "
            f"{r.get('resize_pause_seconds', float('nan')):.1f} | "
            f"{r.get('recovery_seconds') or float('nan'):.1f} | "
            f"{r.get('recomputed_steps', '-')} |"
        )
    print(
        f"\nwall time baseline / huorn: {summary['wall_ratio_baseline_over_huorn']:.2f}x; "
        f"tokens/s huorn / baseline: {summary['tokens_per_second_ratio_huorn_over_baseline']:.2f}x"
    )


if __name__ == "__main__":
    main()
