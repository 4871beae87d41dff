"""Elastic training under real torchrun agents: the launcher's command line, killing a replica's
whole process tree, and the acceptance scenario (2 replicas, a third joins, the rank-0 replica is
SIGKILLed; training resumes from the last checkpoint with no gap or repeat and the loss curve of
an uninterrupted run)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import runtime_harness as harness

from huorn.runtime import launcher, steplog

LOSS_TOLERANCE = 1e-4  # max |Δloss| per step against the uninterrupted single-process run


def _settings(port: int, replica: int, min_nodes: int = 2) -> launcher.ElasticSettings:
    return launcher.ElasticSettings(min_nodes=min_nodes, max_nodes=3, rdzv_endpoint=f"127.0.0.1:{port}",
                                    rdzv_id="acceptance", local_addr=launcher.replica_address(replica))


def test_torchrun_command_carries_the_recovery_settings() -> None:
    command = launcher.build_agent_command("/cfg.json", _settings(29400, 1), python="py")
    assert command[:3] == ["py", "-m", "huorn.runtime.agent"]
    assert "--nnodes=2:3" in command and "--rdzv-backend=c10d" in command
    assert "--rdzv-endpoint=127.0.0.1:29400" in command and "--local-addr=127.0.0.3" in command
    rdzv_conf = next(c for c in command if c.startswith("--rdzv-conf=")).removeprefix("--rdzv-conf=")
    conf = dict(kv.split("=") for kv in rdzv_conf.split(","))
    assert conf["is_host"] == "false" and conf["last_call_timeout"] == "2"
    assert conf["keep_alive_interval"] == "1" and conf["keep_alive_max_attempt"] == "3"
    assert command[-4:] == ["-m", "huorn.runtime.train", "--config", "/cfg.json"]
    env = launcher.build_agent_env("b", {"PATH": "/bin"})
    assert env["HUORN_REPLICA"] == "b" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    with pytest.raises(ValueError, match="min_nodes"):
        launcher.ElasticSettings(min_nodes=3, max_nodes=2, rdzv_endpoint="h:1", rdzv_id="x")
    with pytest.raises(ValueError, match="HOST:PORT"):
        launcher.ElasticSettings(min_nodes=1, max_nodes=2, rdzv_endpoint="h", rdzv_id="x")


def test_killing_a_replica_kills_its_whole_tree() -> None:
    # The child starts its own session, as torchrun's workers do, and would outlive its parent.
    parent = subprocess.Popen([sys.executable, "-c",
                               "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                               "'import time; time.sleep(300)'], start_new_session=True); time.sleep(300)"])
    harness.wait_for(lambda: psutil.Process(parent.pid).children(), 60, "the grandchild to start")
    child = psutil.Process(parent.pid).children()[0]
    killed = launcher.kill_process_tree(parent.pid)
    assert set(killed) == {parent.pid, child.pid}
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert launcher.kill_process_tree(parent.pid) == []


_last_step = steplog.last_step
_first_step_after = steplog.first_step_after


@pytest.mark.slow
def test_a_joining_and_a_killed_replica_keep_the_run_exact(tmp_path: Path) -> None:
    steps = 60
    spec = harness.build_spec(steps=steps, interval_steps=5, min_replicas=2)
    config, store, port = harness.start_paced_gang(tmp_path, spec)
    uninterrupted = harness.start_uninterrupted(tmp_path, spec)  # meanwhile, on idle CPU
    run_dir = tmp_path / "run"
    agents: dict[int, subprocess.Popen] = {}
    try:
        for replica in (0, 1):
            agents[replica] = harness.start_agent(config, _settings(port, replica), f"r{replica}",
                                                  tmp_path / f"agent{replica}.log")
        harness.wait_for(lambda: _last_step(run_dir) >= 8, 240, "8 steps at world size 2")

        joined_at = time.time()
        with harness.held_back(run_dir):
            agents[2] = harness.start_agent(config, _settings(port, 2), "r2", tmp_path / "agent2.log")
            harness.wait_for(lambda: _first_step_after(run_dir, joined_at, 3), 240,
                             "the third replica to join")
        at_three = _last_step(run_dir)
        harness.wait_for(lambda: _last_step(run_dir) >= at_three + 8, 240, "8 steps at world size 3")

        # Kill the replica that holds rank 0 (the one a shared-store setup could not lose).
        ranks = {json.loads(p.read_text())["rank"]: json.loads(p.read_text())["replica"]
                 for p in (run_dir / "endpoints").glob("*.json")}
        victim = int(ranks[0].removeprefix("r"))
        killed_at, killed_step = time.time(), _last_step(run_dir)
        assert launcher.kill_process_tree(agents[victim].pid)
        recovered = harness.wait_for(lambda: _first_step_after(run_dir, killed_at, 2), 240, "recovery at 2")
        for replica, agent in agents.items():
            if replica != victim:
                assert agent.wait(timeout=300) == 0, (tmp_path / f"agent{replica}.log").read_text()[-3000:]
    finally:
        for agent in agents.values():
            launcher.kill_process_tree(agent.pid)
        launcher.kill_process_tree(store.pid)

    events = harness.read_events(run_dir)
    attempts = harness.split_attempts(events)
    assert [a["start"]["world_size"] for a in attempts] == [2, 3, 2]
    # The join is a graceful hand-over: a SIGTERM checkpoint at the last step, nothing lost.
    assert attempts[1]["start"]["resumed_from"] == attempts[0]["steps"][-1]["step"]
    # The kill loses the steps since the last periodic checkpoint, and only those.
    resumed = attempts[2]["start"]["resumed_from"]
    assert resumed % 5 == 0 and killed_step - 5 <= resumed <= attempts[1]["steps"][-1]["step"]
    for attempt in attempts:  # within an attempt: consecutive from the resume point, no gap, no repeat
        numbers = [s["step"] for s in attempt["steps"]]
        assert numbers == list(range(attempt["start"]["resumed_from"] + 1, attempt["start"]["resumed_from"]
                                     + 1 + len(numbers)))
    history = harness.effective_steps(events)
    assert sorted(history) == list(range(1, steps + 1))

    worst = max(harness.loss_gaps_to_uninterrupted(tmp_path, spec, history, uninterrupted).values())
    assert worst < LOSS_TOLERANCE
    print(f"\njoin: {attempts[1]['steps'][0]['time'] - joined_at:.1f} s from agent start to a step at 3; "
          f"recovery: {recovered - killed_at:.1f} s from SIGKILL to a step at 2; "
          f"lost steps: {killed_step - resumed}; max |Δloss| vs uninterrupted: {worst:.2e}")


@pytest.mark.slow
def test_a_peers_graceful_leave_spends_none_of_the_survivors_restarts(tmp_path: Path) -> None:
    """The survivors of a leave exit RESTART_EXIT to re-rendezvous; torch's agent counts that as a
    failure. With no restarts to spare, the survivor's agent then failed (its pod Failed on a
    routine shrink). A leave is a membership change, like a join, and must cost nothing."""
    import dataclasses
    import signal

    steps = 30
    spec = harness.build_spec(steps=steps, interval_steps=5, min_replicas=1)
    config, store, port = harness.start_paced_gang(tmp_path, spec)
    run_dir = tmp_path / "run"
    agents: dict[int, subprocess.Popen] = {}
    try:
        for replica in (0, 1):
            settings = dataclasses.replace(_settings(port, replica, min_nodes=1), max_restarts=0)
            log = tmp_path / f"agent{replica}.log"
            agents[replica] = harness.start_agent(config, settings, f"r{replica}", log)
        harness.wait_for(lambda: _last_step(run_dir) >= 4 and harness.split_attempts(
            harness.read_events(run_dir))[-1]["start"]["world_size"] == 2, 240, "steps at world size 2")
        agents[1].send_signal(signal.SIGTERM)
        assert agents[1].wait(timeout=120) != 0  # a pod deleted by someone: see train.LEFT_EXIT
        assert agents[0].wait(timeout=300) == 0, (tmp_path / "agent0.log").read_text()[-3000:]
    finally:
        for agent in agents.values():
            launcher.kill_process_tree(agent.pid)
        launcher.kill_process_tree(store.pid)

    attempts = harness.split_attempts(harness.read_events(run_dir))
    assert [a["start"]["world_size"] for a in attempts][-2:] == [2, 1]
    assert attempts[-1]["start"]["resumed_from"] == attempts[-2]["steps"][-1]["step"], "nothing lost"
    assert sorted(harness.effective_steps(harness.read_events(run_dir))) == list(range(1, steps + 1))


def test_effective_history_drops_steps_lost_with_a_crash() -> None:
    def step(n: int, loss: float) -> dict:
        return {"event": "step", "step": n, "loss": loss}

    events = [{"event": "start", "resumed_from": 0}, step(1, 9.0), step(2, 8.0), step(3, 7.5),
              {"event": "start", "resumed_from": 2}, step(3, 7.0), step(4, 6.0)]
    history = steplog.effective_steps(events)
    assert sorted(history) == [1, 2, 3, 4] and history[3]["loss"] == 7.0
    assert [a["start"]["resumed_from"] for a in steplog.split_attempts(events)] == [0, 2]
