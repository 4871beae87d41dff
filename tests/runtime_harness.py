"""Builders and process helpers shared by the runtime tests: a small run config, the
stand-alone rendezvous store, torchrun agents as "replicas", and readers of the step log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from huorn.runtime import config as run_config
from huorn.runtime import launcher

REPO = Path(__file__).resolve().parents[1]


def build_spec(steps: int = 20, interval_steps: int | None = 5, global_batch: int = 12, micro_batch: int = 2,
               min_replicas: int = 1, max_replicas: int = 3, seed: int = 7, **optimization: object) -> dict:
    """A TrainingJob spec (wire form) small enough to train on a loaded 2-core machine."""
    return {
        "virtualCluster": "test",
        "elasticity": {"minReplicas": min_replicas, "maxReplicas": max_replicas},
        "model": {"layers": 2, "width": 32, "heads": 2, "context": 32},
        "data": {"sources": [{"name": "general", "weight": 2}, {"name": "code", "weight": 1},
                             {"name": "math", "weight": 1}], "seed": seed},
        "optimization": {"globalBatch": global_batch, "microBatch": micro_batch, "learningRate": 0.003,
                         "warmupSteps": 3, "steps": steps, **optimization},
        "checkpoint": {"path": "/checkpoints",
                       **({"intervalSteps": interval_steps} if interval_steps else {})},
    }


def write_config(tmp: Path, data_dir: Path, spec: dict | None = None, **fields: object) -> Path:
    config = run_config.RunConfig.model_validate({
        "jobName": "test", "spec": spec or build_spec(), "runDir": str(tmp / "run"),
        "checkpointDir": str(tmp / "ckpt"), "dataDir": str(data_dir), "telemetryHost": "127.0.0.1",
        **fields,
    })
    return run_config.write_run_config(config, tmp / "config.json")


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def start_trainer(config: Path, log: Path) -> subprocess.Popen:
    """The trainer without torchrun: a world of one."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "huorn.runtime.train", "--config", str(config)],
                                cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)


def start_store(tmp: Path) -> tuple[subprocess.Popen, int]:
    port_file = tmp / "store.port"
    with open(tmp / "store.log", "ab") as out:
        process = subprocess.Popen(launcher.build_store_command("127.0.0.1", 0, port_file), cwd=REPO,
                                   env=child_env(), stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    wait_for(port_file.exists, 60, "the rendezvous store to write its port")
    return process, int(port_file.read_text())


def start_agent(config: Path, settings: launcher.ElasticSettings, replica: str,
                log: Path) -> subprocess.Popen:
    """One torchrun agent in its own session, like a pod: killing it means killing its tree."""
    command = launcher.build_torchrun_command(config, settings)
    env = launcher.build_agent_env(replica, child_env())
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def read_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / run_config.STEPS_FILE
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def steps_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("event") == "step"]


def split_attempts(events: list[dict]) -> list[dict]:
    """Group the log by worker start: each attempt has its resume step and the steps it logged."""
    attempts: list[dict] = []
    for event in events:
        if event.get("event") == "start":
            attempts.append({"start": event, "steps": []})
        elif event.get("event") == "step" and attempts:
            attempts[-1]["steps"].append(event)
    return attempts


def effective_steps(events: list[dict]) -> dict[int, dict]:
    """The step history that counts: a later attempt that resumed from step k overrides whatever
    an earlier attempt logged after k (that work was lost with the crash)."""
    history: dict[int, dict] = {}
    for attempt in split_attempts(events):
        resumed = attempt["start"]["resumed_from"]
        history = {k: v for k, v in history.items() if k <= resumed}
        for step in attempt["steps"]:
            history[step["step"]] = step
    return history


def wait_for(predicate: Callable[[], object], timeout: float, what: str, period: float = 0.2) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def shared_data_dir() -> Path:
    """Corpora built once per machine for all runtime tests: the build is idempotent and atomic,
    so parallel test processes may all call this."""
    from huorn.runtime.data import build, corpora

    directory = Path(os.environ.get("HUORN_TEST_DATA_DIR", f"/tmp/huorn-test-data-{os.getuid()}"))
    for corpus in corpora.CORPORA:
        build.ensure_corpus(corpus, directory)
    return directory
