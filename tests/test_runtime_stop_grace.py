"""How long a torchrun agent lets its workers stop, and what `huorn run` says when a stop was cut.

A stop is one agreed step and one collective checkpoint. torch's agent SIGKILLs workers 30 s
after its SIGTERM, and when a join restarts them (restart mode) it used 30 s whatever its
--shutdown-timeout said; the local backend never set one. A step plus a checkpoint longer than
that lost every step since the last checkpoint, and `huorn run` still printed "interrupted
(checkpointed and stopped)".

Also here, one more thing `huorn run` said nothing about: a --scale-at past the run's last step."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import runtime_harness as harness
import yaml
from typer.testing import CliRunner

from huorn import graph
from huorn.api import manifests
from huorn.backends.local import backend as local_backend
from huorn.backends.local import commands, processes, report
from huorn.cli import main
from huorn.cli import run as run_cli
from huorn.graph import desired, model
from huorn.runtime import agent, launcher

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def _settings(port: int, **knobs: object) -> launcher.ElasticSettings:
    return launcher.ElasticSettings(min_nodes=1, max_nodes=2, rdzv_endpoint=f"127.0.0.1:{port}",
                                    rdzv_id="grace", local_addr="127.0.0.2", **knobs)  # type: ignore[arg-type]


def test_a_join_gives_workers_the_agents_shutdown_timeout_not_torchs_30_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent a join restarts (its _stop_workers) is built from the command line the launcher
    writes, as huorn.runtime.agent builds it; its workers get the timeout that line names."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.launcher import api as launcher_api

    monkeypatch.setattr(launcher_api, "LocalElasticAgent", launcher_api.LocalElasticAgent)  # restored after
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    argv = launcher.build_agent_command("/cfg.json", _settings(29400, shutdown_timeout=7))
    assert "--shutdown-timeout=7" in argv
    config, _, _ = torchrun.config_from_args(torchrun.parse_args(argv[3:]))  # past `python -m module`
    agent._count_leaves_as_membership_changes()
    rendezvous = SimpleNamespace(get_backend=lambda: "c10d", get_run_id=lambda: "grace")
    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=rendezvous, entrypoint=print)
    elastic = launcher_api.LocalElasticAgent(spec, config.logs_specs, start_method="fork",
                                             shutdown_timeout=config.shutdown_timeout)
    closed: list[tuple[signal.Signals, int]] = []
    elastic._pcontext = SimpleNamespace(close=lambda sig, timeout: closed.append((sig, timeout)))
    elastic._stop_workers(elastic.get_worker_group())
    assert closed == [(signal.SIGTERM, 7)]


def test_a_shutdown_timeout_below_a_second_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="shutdown_timeout must be >= 1 second, got 0"):
        _settings(29400, shutdown_timeout=0)


def _restart_graph(tmp_path: Path) -> model.Graph:
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["elasticity"]["resize"] = "restart"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return graph.compile(manifests.load_manifest(path))


def test_the_local_backend_gives_its_agents_its_stop_grace_less_a_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The backend waits stop_grace_s for an agent before it SIGKILLs the tree; the agent must
    give its workers most of that, keeping some to exit itself."""
    g = _restart_graph(tmp_path)
    backend = local_backend.LocalBackend(g, tmp_path, local_backend.LocalSettings(stop_grace_s=50))
    backend.store_endpoint = "127.0.0.1:29400"
    started: list[list[str]] = []

    def start_process(name: str, vertex: str, role: str, argv: list[str], *_: object) -> SimpleNamespace:
        started.append(argv)
        return SimpleNamespace(name=name, pid=1, in_place=False)

    monkeypatch.setattr(processes, "start_process", start_process)
    trainer = next(r for r in desired.build_desired(g) if r.kind == "instance" and r.role == "trainer")
    backend._start_agent(g, trainer)
    assert "--shutdown-timeout=40" in started[0]
    assert [commands.agent_shutdown_timeout(s) for s in (90, 50, 8, 0.5)] == [80, 40, 6, 1]


class _Interrupted:
    """The monitor loop as Ctrl-C leaves it."""

    def start(self) -> None:
        pass

    def run(self, **_: object) -> None:
        raise KeyboardInterrupt


class _StoppedBackend:
    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.stopped: list[bool] = []

    def stop(self, graceful: bool = True) -> list[str]:
        self.stopped.append(graceful)
        return []

    def observe(self) -> None:
        return None


class _View:
    def __enter__(self) -> _View:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def update_final(self, _: object) -> None:
        pass


def _write_log(run_dir: Path, events: list[dict]) -> None:
    (run_dir / commands.STEPS_FILE).write_text("".join(
        f'{{"event": "{e["event"]}", "step": {e["step"]}}}\n' for e in events))


@pytest.mark.parametrize(("events", "said"), [
    ([{"event": "step", "step": s} for s in range(1, 13)] + [{"event": "checkpoint", "step": 12}],
     "interrupted (checkpointed and stopped)"),
    ([{"event": "step", "step": s} for s in range(1, 13)],
     "interrupted (stopped without a stop checkpoint: no checkpoint was written, so steps 1-12 are lost)"),
    ([{"event": "step", "step": s} for s in range(1, 28)] + [{"event": "checkpoint", "step": 25}],
     "interrupted (stopped without a stop checkpoint: the last checkpoint is step 25, so steps 26-27 "
     "are lost)"),
    ([], "interrupted (stopped before the first step)"),
])
def test_huorn_run_says_checkpointed_only_when_the_step_log_shows_it(
    tmp_path: Path, events: list[dict], said: str
) -> None:
    _write_log(tmp_path, events)
    backend = _StoppedBackend(tmp_path)
    outcome = run_cli._drive(_Interrupted(), backend, _View(), 1.0, 600.0)  # type: ignore[arg-type]
    assert outcome == said and backend.stopped == [True]


@pytest.mark.timeout(240)
def test_an_agent_stops_its_workers_within_the_grace_it_was_given(tmp_path: Path) -> None:
    """A SIGTERM in the middle of an 8 s step, with a grace of 2 s: the worker is SIGKILLed after
    2 s (not torch's 30 s), no stop checkpoint is written, and what huorn run would say names
    the steps lost. Measured on the 2-core VM: the agent gone 2.7-3.5 s after its SIGTERM."""
    spec = harness.build_spec(steps=1000, interval_steps=None, max_replicas=2)
    slow_step = {"kind": "slow-compute", "fromStep": 3, "untilStep": 4, "ms": 8000}
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec, faults=[slow_step])
    store, port = harness.start_store(tmp_path)
    gang = harness.start_agent(config, _settings(port, shutdown_timeout=2), "r0", tmp_path / "agent.log")
    run_dir = tmp_path / "run"
    try:
        harness.wait_for(lambda: len(harness.steps_of(harness.read_events(run_dir))) >= 3, 180, "three steps")
        time.sleep(1.0)  # inside step 4's 8 s
        stopped_in = harness.sigterm_and_time(gang)
    finally:
        launcher.kill_process_tree(gang.pid)
        launcher.kill_process_tree(store.pid)
    log = (tmp_path / "agent.log").read_text()
    assert stopped_in < 6, (stopped_in, log[-3000:])
    assert "forcefully exiting via" in log, log[-3000:]
    events = report.read_records(run_dir)
    assert [e["step"] for e in events if e.get("event") == "step"][-1] == 3
    assert not [e for e in events if e.get("event") == "checkpoint"]
    assert run_cli.stop_outcome(run_dir) == (
        "interrupted (stopped without a stop checkpoint: no checkpoint was written, so steps 1-3 are lost)")


@pytest.mark.parametrize(("args", "message"), [
    (("--steps", "3", "--scale-at", "10:2"), "--scale-at 10:2: step 10 is not before the run's last step, 3 "
                                             "(--steps 3)"),
    (("--steps", "12", "--scale-at", "4:2", "--scale-at", "12:1"), "--scale-at 12:1: step 12 is not before"),
    (("--scale-at", "300:2"), "the run's last step, 300 (spec.optimization.steps 300)"),
])
def test_a_scale_at_the_run_never_reaches_is_refused_naming_both(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    """`--steps 3 --scale-at 10:2` ran three steps at one replica and said nothing of the resize."""
    run_dir = tmp_path / "never"
    result = CliRunner().invoke(main.app, ["run", str(QUICKSTART), "--run-dir", str(run_dir), "--no-watch",
                                           *args])
    assert result.exit_code == 2 and message in result.stderr, result.stderr
    assert "--steps" in result.stderr and not run_dir.exists()
