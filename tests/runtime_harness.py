"""Builders and process helpers shared by the runtime tests: a small run config, the
stand-alone rendezvous store, torchrun agents as "replicas", and readers of the step log."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
from aiohttp import web

from huorn.backends.local import commands
from huorn.runtime import config as run_config
from huorn.runtime import launcher, steplog

REPO = Path(__file__).resolve().parents[1]


def build_spec(steps: int = 20, interval_steps: int | None = 5, global_batch: int = 12, micro_batch: int = 2,
               min_replicas: int = 1, max_replicas: int = 3, seed: int = 7, task: dict | None = None,
               **optimization: object) -> dict:
    """A TrainingJob spec (wire form) small enough to train on a loaded 2-core machine."""
    return {
        **({"task": task} if task else {}),
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


def trainer_command(config: Path, nproc: int) -> list[str]:
    """The trainer under torchrun on `nproc` local ranks (no restarts), or alone for one."""
    return launcher.build_standalone_command(config, nproc)


def start_trainer(config: Path, log: Path) -> subprocess.Popen:
    """The trainer without torchrun: a world of one."""
    with open(log, "ab") as out:
        return subprocess.Popen(launcher.build_standalone_command(config, 1),
                                cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)


def start_store(tmp: Path) -> tuple[subprocess.Popen, int]:
    return launcher.start_store(tmp, env=child_env())


def start_agent(config: Path, settings: launcher.ElasticSettings, replica: str,
                log: Path) -> subprocess.Popen:
    """One torchrun agent in its own session, like a pod: killing it means killing its tree."""
    return launcher.start_agent(config, settings, replica, log, env=child_env())


read_events = steplog.read_events
steps_of = steplog.steps_of
split_attempts = steplog.split_attempts
effective_steps = steplog.effective_steps


def run_members(script: str, config: Path, world: int = 2, timeout: float = 120) -> list[tuple[str, str]]:
    """`python -c script CONFIG` as ranks 0..world-1 of one process group (env:// on a free
    port, as a pod's in-place trainers form theirs); each rank's (stdout, stderr) once all end."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    members = [
        subprocess.Popen([sys.executable, "-c", script, str(config)], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=child_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port))
        for rank in range(world)
    ]
    try:
        return [member.communicate(timeout=timeout) for member in members]
    finally:
        for member in members:
            member.kill()


def sigterm_and_time(process: subprocess.Popen, timeout: float = 60) -> float:
    """Seconds from a SIGTERM to `process` until it has exited (a gang's agent: how long its
    stop took)."""
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=timeout)
    return time.monotonic() - signalled


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


PACE_MS = 100  # injected compute per step of a paced gang
HELD_PACE_MS = 1500  # the same while a joining replica starts


def _set_pace(run_dir: Path, ms: float) -> None:
    """Every rank's injected compute per step, through the control file the trainers re-read at
    each step (written whole, then renamed, so no trainer reads half of it)."""
    commands.write_json_atomically(run_dir / run_config.FAULTS_FILE, [{"kind": "slow-compute", "ms": ms}])


def start_paced_gang(tmp: Path, spec: dict) -> tuple[Path, subprocess.Popen, int]:
    """The config of an elastic scenario, every step paced by PACE_MS of injected compute so that
    the scenario fits in the run on any machine, and its stand-alone store: (config, store, port)."""
    config = write_config(tmp, shared_data_dir(), spec)
    _set_pace(tmp / "run", PACE_MS)
    store, port = start_store(tmp)
    return config, store, port


@contextlib.contextmanager
def held_back(run_dir: Path) -> Iterator[None]:
    """A paced gang slowed to HELD_PACE_MS a step for the block: while a joining replica starts.
    Its start is an interpreter importing torch, which on a loaded CI host took long enough for
    the gang to finish all its steps before the join (the test then waited for steps at the new
    size that could never come)."""
    _set_pace(run_dir, HELD_PACE_MS)
    try:
        yield
    finally:
        _set_pace(run_dir, PACE_MS)


def start_uninterrupted(tmp: Path, spec: dict) -> subprocess.Popen:
    """The same job run uninterrupted, in one process, with the same seed, in tmp/reference.
    A scenario can start it first: its gang is paced by sleeps, so the CPU is mostly idle, and
    the reference then costs the suite nothing."""
    reference_dir = tmp / "reference"
    reference_dir.mkdir()
    reference_config = write_config(reference_dir, shared_data_dir(), spec)
    return start_trainer(reference_config, reference_dir / "train.log")


def loss_gaps_to_uninterrupted(tmp: Path, spec: dict, history: dict[int, dict],
                               started: subprocess.Popen | None = None) -> dict[int, float]:
    """|Δloss| per step between `history` and the uninterrupted run (`started`, or one started
    now)."""
    reference = started if started is not None else start_uninterrupted(tmp, spec)
    assert reference.wait(timeout=300) == 0, (tmp / "reference" / "train.log").read_text()[-3000:]
    reference = effective_steps(read_events(tmp / "reference" / "run"))
    return {s: abs(history[s]["loss"] - reference[s]["loss"]) for s in sorted(reference)}


@contextlib.asynccontextmanager
async def serving_app(app: web.Application,
                      handler_cancellation: bool = False) -> AsyncIterator[aiohttp.ClientSession]:
    """`app` served on a free loopback port, and a client session to it, for as long as the block;
    `handler_cancellation` as the serving processes run (huorn.runtime.serve.run_until_signal)."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as session:
            yield session
    finally:
        await runner.cleanup()


def serving_decoder(mode: str, context: int, layers: int = 4) -> object:
    """A small byte-vocabulary decoder as a replica serves it (eval, no gradients), its FusedKV
    fusion weights moved off their Lite init so that FusedKV is really fused."""
    import torch

    from huorn import models

    torch.manual_seed(0)
    cfg = models.ModelConfig(layers=layers, width=64, heads=4, kv_heads=2, vocabulary=256, context=context,
                             kv_sharing=mode)
    model = models.build_model(cfg).eval().requires_grad_(False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("k_fuse", "v_fuse")):
                param.uniform_(-1.0, 1.5)
    return model
