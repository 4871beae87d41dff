"""huorn.runtime.agent: torchrun's elastic agent whose workers fork from a warm interpreter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import runtime_harness as harness

from huorn.runtime import agent, launcher


def test_the_agent_runs_only_the_trainer_and_says_what_to_use_instead() -> None:
    with pytest.raises(SystemExit) as refused:
        agent.main(["--standalone", "--nproc-per-node=1", "train.py", "--config", "c.json"])
    message = str(refused.value)
    assert "-m huorn.runtime.train --config FILE" in message and "'train.py'" in message
    assert "torchrun" in message


def test_a_config_the_trainer_would_refuse_stops_the_agent_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker's refusal (exit 2) is a failure to torch's agent, which restarted the gang on it up
    to --max-restarts (100) times, so the run only stalled; the agent refuses first, with 2."""
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # main() sets it; restored after
    spec = harness.build_spec(steps=2)
    spec["data"]["sources"] = [{"name": "general"}, {"name": "mine", "path": str(tmp_path)}]
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec)
    with pytest.raises(SystemExit) as refused:
        agent.main(["--standalone", "--nproc-per-node=1", "-m", agent.TRAINER, "--config", str(config)])
    assert refused.value.code == 2
    error = capsys.readouterr().err
    assert "error: spec.data.sources[1].path" in error and "train.bin" in error


def test_the_fork_probe_reports_a_child_that_could_not_use_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an H100 the first forked worker failed with "Cannot re-initialize CUDA in forked
    subprocess": torch's LaunchConfig had asked the CUDA runtime whether CUDA is available. The
    agent now asks through NVML and probes a fork first; a poisoned fork makes it start workers as
    torchrun does. The probe is a real fork, asking torch in the child."""
    import torch

    assert agent._fork_is_clean()
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert not agent._fork_is_clean()


def test_a_worker_that_finished_ends_at_the_next_sigterm(tmp_path: Path) -> None:
    """A forked worker whose trainer returned waits for its agent to collect the result; if the
    agent is stopping the gang instead (a peer failed), its SIGTERM must end the worker, which the
    trainer's own handler would only have noted (the agent SIGKILLs 30 s later). Run in a child,
    a world of one training two steps."""
    config = harness.write_config(tmp_path, harness.shared_data_dir(), harness.build_spec(steps=2))
    probe = ("import signal, sys; from huorn.runtime import agent; "
             "agent.run_trainer('--config', sys.argv[1]); "
             "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)")
    done = subprocess.run([sys.executable, "-c", probe, str(config)], cwd=harness.REPO,
                          env=harness.child_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().splitlines()[-1] == "True", done.stderr[-3000:]
    assert harness.steps_of(harness.read_events(tmp_path / "run"))[-1]["step"] == 2


@pytest.mark.slow
def test_workers_fork_from_the_agent_and_a_sigterm_stops_them_at_once(tmp_path: Path) -> None:
    """Two ranks: each worker is a fork of the agent (same command line, no fresh interpreter), and
    a SIGTERM to the agent checkpoints and ends the gang well within torch's 30 s shutdown timeout.
    A forked worker that returned normally waited for its agent to collect its result, which a
    stopping agent never does: it was SIGKILLed after 30 s (a join took 40 s instead of 11)."""
    spec = harness.build_spec(steps=10_000, interval_steps=None)
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec,
                                  faults=[{"kind": "slow-compute", "ms": 50}])
    with open(tmp_path / "agent.log", "ab") as log:
        gang = subprocess.Popen(harness.trainer_command(config, 2), cwd=harness.REPO, env=harness.child_env(),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        harness.wait_for(lambda: len(harness.steps_of(harness.read_events(tmp_path / "run"))) >= 3, 180,
                         "three steps")
        workers = psutil.Process(gang.pid).children()
        assert len(workers) == 2 and all(w.cmdline() == psutil.Process(gang.pid).cmdline() for w in workers)
        stopped_in = harness.sigterm_and_time(gang)
    finally:
        launcher.kill_process_tree(gang.pid)
    assert stopped_in < 20, (stopped_in, (tmp_path / "agent.log").read_text()[-3000:])
    events = harness.read_events(tmp_path / "run")
    assert events[-1]["event"] == "checkpoint" and events[-1]["reason"] == "sigterm", events[-3:]
    assert events[-1]["step"] == harness.steps_of(events)[-1]["step"]
    assert not any(w.is_running() for w in workers)
