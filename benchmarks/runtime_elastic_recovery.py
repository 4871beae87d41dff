"""Elastic recovery times of Huorn's torchrun settings against torchrun's default timeouts.

Both runs use the same real setup (stand-alone rendezvous store, one loopback address per
replica, store sharing off: without these torchrun does not survive losing the rank-0 replica at
all) and the same scenario on CPU:

    2 replicas train -> a 3rd joins -> one is SIGTERMed (graceful shrink) -> the rank-0 replica
    is SIGKILLed (hard failure) -> the last one finishes the job.

For each event it reports the time from the event to the first step at the new world size and
the steps lost, then the ratio baseline/Huorn. Writes a JSON summary and a PNG (step vs time).

    .venv/bin/python benchmarks/runtime_elastic_recovery.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
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

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from huorn.runtime import config as run_config  # noqa: E402
from huorn.runtime import launcher, steplog  # noqa: E402
from huorn.runtime.data import build  # noqa: E402

SETTINGS = {
    "torchrun defaults": {"monitor_interval": 0.1, "last_call_timeout": 30, "keep_alive_interval": 5,
                          "keep_alive_max_attempt": 3},
    "huorn": {},  # ElasticSettings' own defaults
}
STEPS = 100


def _wait(predicate: Callable[[], object], timeout: float, what: str) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out waiting for {what}")


def run_scenario(name: str, overrides: dict, data_dir: Path, workdir: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    spec = {
        "virtualCluster": "bench", "elasticity": {"minReplicas": 1, "maxReplicas": 3},
        "model": {"layers": 2, "width": 32, "heads": 2, "context": 32},
        "data": {"sources": [{"name": "general"}, {"name": "code"}, {"name": "math"}], "seed": 7},
        "optimization": {"globalBatch": 12, "microBatch": 2, "steps": STEPS, "warmupSteps": 3},
        "checkpoint": {"intervalSteps": 5},
    }
    config = run_config.write_run_config(run_config.RunConfig.model_validate({
        "jobName": "bench", "spec": spec, "runDir": str(workdir / "run"),
        "checkpointDir": str(workdir / "ckpt"),
        "dataDir": str(data_dir), "telemetryHost": "127.0.0.1",
        "faults": [{"kind": "slow-compute", "ms": 100}]}), workdir / "config.json")
    store, port = launcher.start_store(workdir, env=env)
    run_dir = workdir / "run"

    def settings(replica: int) -> launcher.ElasticSettings:
        return launcher.ElasticSettings(min_nodes=1, max_nodes=3, rdzv_endpoint=f"127.0.0.1:{port}",
                                        rdzv_id=name.replace(" ", "-"),
                                        local_addr=launcher.replica_address(replica), **overrides)

    def start(replica: int) -> subprocess.Popen:
        log = workdir / f"agent{replica}.log"
        return launcher.start_agent(config, settings(replica), f"r{replica}", log, env)

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
    agents = {0: start(0), 1: start(1)}
    began = time.time()
    try:
        _wait(lambda: current_world() == 2 and steplog.last_step(run_dir) >= 8, 300, "8 steps at 2")
        for kind, target_world in (("join", 3), ("graceful shrink", 2), ("SIGKILL rank-0 replica", 1)):
            at, step = time.time(), steplog.last_step(run_dir)
            if kind == "join":
                agents[2] = start(2)
            elif kind == "graceful shrink":
                victim = next(r for r in agents if r != rank_owner(0) and agents[r].poll() is None)
                agents[victim].send_signal(signal.SIGTERM)
            else:
                victim = rank_owner(0)
                launcher.kill_process_tree(agents[victim].pid)
            done = _wait(lambda w=target_world, t=at: steplog.first_step_after(run_dir, t, w), 300, kind)
            attempt = steplog.split_attempts(steplog.read_events(run_dir))[-1]
            events.append({"event": kind, "at": at - began, "seconds": done - at,
                           "lost_steps": max(0, step - attempt["start"]["resumed_from"])})
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
            "complete": sorted(history) == list(range(1, STEPS + 1)),
            "curve": [(e["time"] - began, e["step"]) for e in steplog.steps_of(steplog.read_events(run_dir))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.gettempdir()) / f"huorn-test-data-{os.getuid()}"
    for corpus in ("code", "general", "math"):
        build.ensure_corpus(corpus, data_dir)
    results = []
    for name, overrides in SETTINGS.items():
        with tempfile.TemporaryDirectory(prefix="huorn-bench-") as workdir:
            print(f"running: {name}", file=sys.stderr, flush=True)
            results.append(run_scenario(name, overrides, data_dir, Path(workdir)))
    baseline, huorn = results
    print("| event | torchrun defaults (s) | huorn (s) | ratio | steps lost (huorn) |")
    print("|---|---|---|---|---|")
    for b, h in zip(baseline["events"], huorn["events"], strict=True):
        ratio = b["seconds"] / h["seconds"]
        print(f"| {h['event']} | {b['seconds']:.1f} | {h['seconds']:.1f} | {ratio:.2f}x "
              f"| {h['lost_steps']} |")
    print(f"| whole run ({STEPS} steps) | {baseline['wall_seconds']:.1f} | {huorn['wall_seconds']:.1f} | "
          f"{baseline['wall_seconds'] / huorn['wall_seconds']:.2f}x | complete: {huorn['complete']} |")
    (args.out / "runtime_elastic_recovery.json").write_text(json.dumps(results, indent=2) + "\n")
    figure, axis = plt.subplots(figsize=(8, 4))
    for result in results:
        xs, ys = zip(*result["curve"], strict=True)
        line = axis.plot(xs, ys, ".", markersize=3, label=result["name"])[0]
        for event in result["events"]:
            axis.axvline(event["at"], color=line.get_color(), alpha=0.3, linestyle="--")
    axis.set_xlabel("seconds since start")
    axis.set_ylabel("global step logged")
    axis.set_title("Join, graceful shrink, SIGKILL of the rank-0 replica (dashed lines)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(args.out / "runtime_elastic_recovery.png", dpi=120)
    return 0 if all(r["complete"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
