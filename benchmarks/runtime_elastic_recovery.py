"""Elastic recovery of the runtime: torchrun's default timeouts, Huorn's torchrun settings with
torchrun's own agent (each worker a fresh interpreter) and with Huorn's (workers forked from a warm
interpreter, huorn.runtime.agent), and Huorn's in-place resizing (huorn.runtime.membership), side
by side in one run.

All three use the same real setup (stand-alone rendezvous store, one loopback address per
replica, store sharing off: without these torchrun does not survive losing the rank-0 replica at
all) and the same scenario:

    2 replicas train -> a 3rd joins -> one is SIGTERMed (graceful shrink) -> the rank-0 replica
    is SIGKILLed (hard failure) -> the last one finishes the job.

For each event it reports
- the time from the event to the first step at the new world size,
- the training time lost: that wall time less the steps the gang still made in it at its median
  step time (a joiner's start-up costs nothing where the gang keeps training through it),
- the steps lost (recomputed),
then ratios against torchrun's defaults. Writes a JSON summary and a PNG (step vs time).

    .venv/bin/python benchmarks/runtime_elastic_recovery.py [--out benchmarks/results]

With `--device cuda --width 1024 --layers 24` on a machine with 2 GPUs, one GPU per replica,
NCCL, the scenario is 1 replica -> a 2nd joins -> one is SIGTERMed -> a 3rd joins on the freed GPU
-> the rank-0 replica is SIGKILLed (`--gpu-kill`; without it the run ends after the SIGTERM, as
measured before NCCL peers were watched in place: huorn.runtime.peer_watch).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from huorn.runtime import config as run_config  # noqa: E402
from huorn.runtime import launcher, steplog  # noqa: E402
from huorn.runtime.data import build  # noqa: E402

SETTINGS: dict[str, tuple[dict, bool]] = {  # name: (ElasticSettings overrides, in place)
    "torchrun defaults": ({"monitor_interval": 0.1, "last_call_timeout": 30, "keep_alive_interval": 5,
                           "keep_alive_max_attempt": 3, "fork_workers": False}, False),
    # Huorn's timeouts, but torchrun's own agent: each worker (re)start is a fresh interpreter
    "huorn torchrun, fresh workers": ({"fork_workers": False}, False),
    "huorn torchrun": ({}, False),  # ElasticSettings' own defaults: workers fork (huorn.runtime.agent)
    "huorn in place": ({}, True),
}


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def _ended_before(run_dir: Path, what: str, steps: int) -> bool:
    """Never true: raises once the run has finished, since `what` can then never be seen (a
    joiner still importing torch when the gang ran out of steps, on a slow host)."""
    if any(e["event"] == "done" for e in steplog.read_events(run_dir)):
        raise RuntimeError(f"the run finished all {steps} steps before the {what}: give it more "
                           f"(--steps) or pace it slower (--pace-ms)")
    return False


def lost_seconds(steps: list[dict], at: float, done: float) -> float:
    """Wall time from `at` to `done` that did not turn into steps, at the run's median step time."""
    gaps = sorted(b["time"] - a["time"] for a, b in itertools.pairwise(steps))
    median = gaps[len(gaps) // 2] if gaps else 0.0
    made = sum(1 for s in steps if at < s["time"] < done)
    return max(0.0, done - at - made * median)


def run_scenario(name: str, overrides: dict, in_place: bool, data_dir: Path, workdir: Path,
                 args: argparse.Namespace) -> dict:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    gpu = args.device == "cuda"
    max_replicas = 2 if gpu else 3
    spec = {
        "virtualCluster": "bench", "elasticity": {"minReplicas": 1, "maxReplicas": max_replicas},
        "model": {"layers": args.layers, "width": args.width, "heads": max(2, args.width // 64),
                  "context": args.context},
        "data": {"sources": [{"name": "general"}, {"name": "code"}, {"name": "math"}], "seed": 7},
        "optimization": {"globalBatch": 12, "microBatch": 2, "steps": args.steps, "warmupSteps": 3},
        "checkpoint": {"intervalSteps": args.checkpoint_steps},
    }
    config = run_config.write_run_config(run_config.RunConfig.model_validate({
        "jobName": "bench", "spec": spec, "runDir": str(workdir / "run"),
        "checkpointDir": str(workdir / "ckpt"), "device": args.device,
        "dataDir": str(data_dir), "telemetryHost": "127.0.0.1",
        "faults": [{"kind": "slow-compute", "ms": args.pace_ms}]}), workdir / "config.json")
    store, port = launcher.start_store(workdir, env=env)
    run_dir = workdir / "run"

    def settings(replica: int) -> launcher.ElasticSettings:
        return launcher.ElasticSettings(min_nodes=1, max_nodes=max_replicas,
                                        rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=name.replace(" ", "-"),
                                        local_addr=launcher.replica_address(replica), **overrides)

    def start(replica: int) -> subprocess.Popen:
        log = workdir / f"agent{replica}.log"
        if gpu:
            free = _wait(lambda: set(range(2)) - {gpu_of[r] for r in agents if agents[r].poll() is None},
                         60, "a free GPU")
            gpu_of[replica] = min(free)
        replica_env = dict(env, CUDA_VISIBLE_DEVICES=str(gpu_of[replica])) if gpu else env
        return launcher.start_agent(config, settings(replica), f"r{replica}", log, replica_env,
                                    in_place=in_place)

    def rank_owner(rank: int) -> int:
        for path in (run_dir / "endpoints").glob("*.json"):
            info = json.loads(path.read_text())
            if info["rank"] == rank and info["world_size"] == current_world():
                return int(info["replica"].removeprefix("r"))
        raise RuntimeError(f"no endpoint for rank {rank}")

    def current_world() -> int:
        attempts = steplog.split_attempts(steplog.read_events(run_dir))
        return attempts[-1]["start"]["world_size"] if attempts else 0

    events: list[dict] = []
    agents: dict[int, subprocess.Popen] = {}
    gpu_of: dict[int, int] = {}  # replica: its GPU; a joiner takes the one a leaver freed
    for replica in (0,) if gpu else (0, 1):
        agents[replica] = start(replica)
    first = len(agents)
    if not gpu:
        scenario = [("join", 3), ("graceful shrink", 2), ("SIGKILL rank-0 replica", 1)]
    elif args.gpu_kill:
        scenario = [("join", 2), ("graceful shrink", 1), ("join", 2), ("SIGKILL rank-0 replica", 1)]
    else:
        scenario = [("join", 2), ("graceful shrink", 1)]
    began = time.time()
    try:
        _wait(lambda: current_world() == first and steplog.last_step(run_dir) >= 8, 600,
              f"8 steps at {first}")
        for kind, target_world in scenario:
            at, step = time.time(), steplog.last_step(run_dir)
            if kind == "join":
                agents[len(agents)] = start(len(agents))
            elif kind == "graceful shrink":
                victim = next(r for r in agents if r != rank_owner(0) and agents[r].poll() is None)
                agents[victim].send_signal(signal.SIGTERM)
            else:
                victim = rank_owner(0)
                launcher.kill_process_tree(agents[victim].pid)
            done = _wait(lambda w=target_world, t=at, k=kind: _ended_before(run_dir, k, args.steps)
                         or steplog.first_step_after(run_dir, t, w), 600, kind)
            attempt = steplog.split_attempts(steplog.read_events(run_dir))[-1]
            events.append({"event": kind, "at": at - began, "seconds": done - at,
                           "lost_steps": max(0, step - attempt["start"]["resumed_from"])})
            events[-1]["lost_seconds"] = lost_seconds(
                steplog.steps_of(steplog.read_events(run_dir)), at, done)
            if kind != "SIGKILL rank-0 replica":
                reached = steplog.last_step(run_dir)
                _wait(lambda s=reached: steplog.last_step(run_dir) >= s + 8, 300, "8 steps")
        _wait(lambda: any(e["event"] == "done" for e in steplog.read_events(run_dir)), 600, "the end")
    finally:
        for agent in agents.values():
            launcher.kill_process_tree(agent.pid)
        launcher.kill_process_tree(store.pid)
    history = steplog.effective_steps(steplog.read_events(run_dir))
    return {"name": name, "events": events, "wall_seconds": time.time() - began,
            "complete": sorted(history) == list(range(1, args.steps + 1)),
            "curve": [(e["time"] - began, e["step"]) for e in steplog.steps_of(steplog.read_events(run_dir))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--pace-ms", type=int, default=100, help="injected compute per step")
    parser.add_argument("--checkpoint-steps", type=int, default=5, help="periodic checkpoint interval")
    parser.add_argument("--name", default="runtime_elastic_recovery", help="stem of the output files")
    parser.add_argument("--only", nargs="*", choices=list(SETTINGS), help="run only these configurations")
    parser.add_argument("--workdir", type=Path, default=None, help="keep each run's logs here")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps of the job")
    parser.add_argument("--gpu-kill", action="store_true",
                        help="on cuda: a 3rd replica joins after the SIGTERM, then rank 0's is SIGKILLed")
    parser.add_argument("--merge", nargs="+", type=Path, default=None,
                        help="JSONs of earlier runs to merge into OUT/NAME.json and .png; runs nothing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merge(args.merge, args.out / f"{args.name}.json")
        return 0
    data_dir = Path(tempfile.gettempdir()) / f"huorn-test-data-{os.getuid()}"
    for corpus in ("code", "general", "math"):
        build.ensure_corpus(corpus, data_dir)
    results = []
    for name, (overrides, in_place) in SETTINGS.items():
        if args.only and name not in args.only:
            continue
        with tempfile.TemporaryDirectory(prefix="huorn-bench-") as scratch:
            workdir = args.workdir / name.replace(" ", "-") if args.workdir else Path(scratch)
            workdir.mkdir(parents=True, exist_ok=True)
            print(f"running: {name}", file=sys.stderr, flush=True)
            results.append(run_scenario(name, overrides, in_place, data_dir, workdir, args))
        partial = {"device": args.device, "results": results}  # kept if a later configuration hangs
        (args.out / f"{args.name}.json").write_text(json.dumps(partial, indent=2) + "\n")
    baseline = results[0]
    names = [r["name"] for r in results]
    print("| event | " + " | ".join(f"{n}: to a step (s) / lost (s)" for n in names)
          + " | lost, defaults ÷ in place | steps lost (in place) |")
    print("|---|" + "---|" * len(names) + "---|---|")
    for index, event in enumerate(baseline["events"]):
        cells = [f"{r['events'][index]['seconds']:.1f} / {r['events'][index]['lost_seconds']:.1f}"
                 for r in results]
        in_place = results[-1]["events"][index]
        ratio = event["lost_seconds"] / max(in_place["lost_seconds"], 0.1)
        print(f"| {event['event']} | " + " | ".join(cells) + f" | {ratio:.1f}x | {in_place['lost_steps']} |")
    print(f"| whole run ({args.steps} steps) | " + " | ".join(f"{r['wall_seconds']:.1f}" for r in results)
          + f" | {baseline['wall_seconds'] / results[-1]['wall_seconds']:.2f}x | "
          f"complete: {all(r['complete'] for r in results)} |")
    (args.out / f"{args.name}.json").write_text(json.dumps(
        {"device": args.device, "model": {"layers": args.layers, "width": args.width,
                                          "context": args.context}, "results": results}, indent=2) + "\n")
    try:
        plot(results, args.device == "cuda" and not args.gpu_kill, args.out / f"{args.name}.png")
    except ImportError:  # the GPU machine's image may lack it; the JSON is plotted elsewhere
        print("matplotlib is not installed: no PNG", file=sys.stderr)
    return 0 if all(r["complete"] for r in results) else 1


def plot(results: list[dict], no_kill: bool, path: Path) -> None:
    """Step against time per configuration, each event a dashed line in its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(8, 4))
    for result in results:
        xs, ys = zip(*result["curve"], strict=True)
        line = axis.plot(xs, ys, ".", markersize=3, label=result["name"])[0]
        for event in result["events"]:
            axis.axvline(event["at"], color=line.get_color(), alpha=0.3, linestyle="--")
    axis.set_xlabel("seconds since start")
    axis.set_ylabel("global step logged")
    axis.set_title("Join, graceful shrink" + ("" if no_kill else ", SIGKILL of the rank-0 replica")
                   + " (dashed lines)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def merge(paths: list[Path], out: Path) -> None:
    """Runs of single configurations (one device call each) as one JSON and one plot."""
    runs = [json.loads(p.read_text()) for p in paths]
    merged = {**runs[0], "results": [r for run in runs for r in run["results"]]}
    out.write_text(json.dumps(merged, indent=2) + "\n")
    plot(merged["results"], False, out.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
