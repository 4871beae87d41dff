"""The processes of an RLJob's pods (huorn.runtime.rl.node), for real on this machine: a worker
waits for its head, and a head with one GPU worker runs a whole RL job whose model actors can
only be placed on the worker (the head holds no GPU; the worker declares one to Ray, which on
a CPU machine is only a resource count, so the actors compute on the CPU). The training actor,
the rollout worker and the reference share that GPU: the first two are one colocation group,
and the reference spec.roles leaves out joins the training actor's."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import runtime_harness as harness

from huorn.backends.kubernetes import rl_manifests
from huorn.runtime import launcher
from huorn.runtime.rl import node

MODEL = {"layers": 2, "width": 32, "heads": 2, "context": 64}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_worker_waits_for_the_head_and_names_it_when_it_never_comes() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        node.wait_for_head(f"127.0.0.1:{port}", timeout_s=5)  # answers: returns at once
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"Ray head at 127.0.0.1:{port} did not answer within 0 s"):
        node.wait_for_head(f"127.0.0.1:{port}", timeout_s=0.4, period_s=0.1)
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="--address: 'head-without-port'"):
        node.wait_for_head("head-without-port", 1)
    # the pod's command: exit 2 for an address that cannot be one, 1 for a head that never answers
    assert node.main(["worker", "--address", "head-without-port"]) == 2
    assert node.main(["worker", "--address", f"127.0.0.1:{port}", "--wait", "0.3"]) == 1


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        node.stop_group(process)  # what the head does with its own Ray node


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_head_and_a_gpu_worker_run_an_rl_job_with_its_actors_on_the_worker(tmp_path: Path) -> None:
    port = _free_port()
    spec = {"virtualCluster": "x", "model": MODEL, "steps": 2, "gpus": 1,
            "algorithm": {"name": "grpo", "groupSize": 2},
            "reward": {"type": "format", "dataset": "arithmetic-small"},
            "rollout": {"maxNewTokens": 4},
            "optimization": {"promptsPerStep": 2},
            # the API counts one GPU: the group's largest role (the reward worker takes none)
            "roles": {"actorTrain": {"colocationGroup": "policy"},
                      "rollout": {"replicas": 1, "colocationGroup": "policy"},
                      "reward": {"replicas": 1, "gpusPerReplica": 0}}}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"jobName": "rl", "spec": spec, "runDir": str(tmp_path / "run"),
                                  "checkpointDir": str(tmp_path / "ckpt"), "evalPrompts": 2,
                                  "startTimeoutS": 240}))
    # Ray's token authentication, as spec.env turns it on for every pod of a job: one token
    env = harness.child_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=uuid.uuid4().hex)
    env.pop("RAY_ADDRESS", None)
    # where the head makes its Ray temp dir (short: Ray's socket paths must fit 107 bytes)
    temp_root = Path(tempfile.mkdtemp(prefix="hr-"))
    env["TMPDIR"] = str(temp_root)
    logs = {name: open(tmp_path / f"{name}.log", "wb") for name in ("worker", "head")}  # noqa: SIM115
    # The head pod starts first, told by the operator that its worker pods bring one GPU; its
    # controller waits for it. Read at once, it ran the model roles on the head's CPUs.
    head = subprocess.Popen(launcher.build_rl_head_command(config, 2, port=port),
                            env={**env, rl_manifests.WAIT_GPUS_ENV: "1"}, cwd=harness.REPO,
                            stdout=logs["head"], stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while "waiting for the worker pods' GPUs: 0 of 1" not in (said := (tmp_path / "head.log").read_text()):
        assert head.poll() is None and time.monotonic() < deadline, said[-3000:]
        time.sleep(0.2)
    worker = subprocess.Popen(launcher.build_rl_worker_command(f"127.0.0.1:{port}", 1, 1), env=env,
                              cwd=harness.REPO, stdout=logs["worker"], stderr=subprocess.STDOUT,
                              start_new_session=True)
    try:
        code = head.wait(timeout=360)
        head_log = (tmp_path / "head.log").read_text()
        assert code == 0, head_log[-4000:] + (tmp_path / "worker.log").read_text()[-2000:]
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]  # still a Ray node
    finally:
        _stop(head)
        _stop(worker)
        for log in logs.values():
            log.close()
    events = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events if e["event"] in ("start", "rl", "done")]
    assert kinds == ["start", "rl", "rl", "done"]
    assert events[0]["reference"]  # GRPO's KL term: trainer, rollout and reference shared one "GPU"
    assert events[0]["model_roles_on_gpus"]  # the worker that joined late is used
    # what `kubectl logs` of the head pod shows, one line a step
    assert head_log.count("huorn-rl rl: step=") == 2 and "huorn-rl done: step=2" in head_log
    # the head's Ray node went with the head: nothing of its process group is left, and no
    # address of it is left where a later plain ray.init() on this host would look for one
    assert not _group_alive(head.pid)
    assert not Path("/tmp/ray/ray_current_cluster").exists() or \
        f":{port}" not in Path("/tmp/ray/ray_current_cluster").read_text()
    # nor Ray's temp dir, once the job succeeded (each run left one under /tmp before)
    leftover = [p for p in temp_root.iterdir() if p.name.startswith("huorn-ray-")]
    shutil.rmtree(temp_root, ignore_errors=True)
    assert leftover == []


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_failed_head_keeps_rays_temp_dir_and_names_it(tmp_path: Path) -> None:
    """After a failure Ray's logs are what a user reads, so the temp dir stays, and is named."""
    config = tmp_path / "config.json"  # a spec the controller refuses (exit 2) once Ray is up
    config.write_text(json.dumps({"jobName": "rl", "spec": {"virtualCluster": "x", "steps": 0},
                                  "runDir": str(tmp_path / "run"), "checkpointDir": str(tmp_path / "ckpt")}))
    temp_root = Path(tempfile.mkdtemp(prefix="hr-"))
    env = harness.child_env(RAY_AUTH_MODE="disabled", TMPDIR=str(temp_root))
    env.pop("RAY_ADDRESS", None)
    try:
        done = subprocess.run(launcher.build_rl_head_command(config, 1, port=_free_port()), env=env,
                              cwd=harness.REPO, capture_output=True, text=True, timeout=180)
        kept = [p for p in temp_root.iterdir() if p.name.startswith("huorn-ray-")]
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)
    assert done.returncode == 2, done.stderr[-3000:]
    assert len(kept) == 1 and f"Ray's logs are kept in {kept[0]}/session_latest/logs" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_failed_controller_runs_again_on_the_same_ray_cluster(tmp_path: Path) -> None:
    """A rollout worker's process SIGKILLed (what an OOM kill does) fails the controller; the
    head runs it again on the Ray cluster it already has (spec.controllerRetries), from the last
    checkpoint, and the run ends as an uninterrupted one would: exit 0, every step done."""
    import psutil

    port = _free_port()
    spec = {"virtualCluster": "x", "model": MODEL, "steps": 30, "gpus": 0, "controllerRetries": 1,
            "algorithm": {"name": "lite-ppo", "groupSize": 2},
            "reward": {"type": "format", "dataset": "arithmetic-small"},
            "rollout": {"maxNewTokens": 4}, "optimization": {"promptsPerStep": 2},
            "roles": {"rollout": {"replicas": 1, "gpusPerReplica": 0},
                      "actorTrain": {"gpusPerReplica": 0}},
            "checkpoint": {"path": "/checkpoints", "intervalSteps": 2}}
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"jobName": "rl", "spec": spec, "runDir": str(tmp_path / "run"),
                                  "checkpointDir": str(tmp_path / "ckpt"), "evalPrompts": 0}))
    env = harness.child_env(RAY_AUTH_MODE="disabled")  # as the operator's pods set it
    env.pop("RAY_ADDRESS", None)
    log = tmp_path / "run" / "steps.jsonl"
    command = launcher.build_rl_head_command(config, 2, port=port)
    with open(tmp_path / "head.log", "wb") as out:
        head = subprocess.Popen(command, env=env, cwd=harness.REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + 240
            while not log.exists() or log.read_text().count('"event": "checkpoint"') < 2:
                assert head.poll() is None, (tmp_path / "head.log").read_text()[-4000:]
                assert time.monotonic() < deadline, "no two checkpoints within 240 s"
                time.sleep(0.2)
            victims = [p for p in psutil.Process(head.pid).children(recursive=True)
                       if "RolloutWorker" in " ".join(p.cmdline())]
            assert victims, [p.cmdline() for p in psutil.Process(head.pid).children(recursive=True)]
            for victim in victims:
                victim.kill()
            code = head.wait(timeout=300)
        finally:
            _stop(head)
    head_log = (tmp_path / "head.log").read_text()
    assert code == 0, head_log[-4000:]
    assert "running it again on the same Ray cluster" in head_log and "retry 1 of 1" in head_log
    events = [json.loads(line) for line in log.read_text().splitlines()]
    starts = [e for e in events if e["event"] == "start"]
    assert [s["attempt"] for s in starts] == [1, 2] and starts[1]["resumed_from"] >= 4
    assert events[-1] == {**events[-1], "event": "done", "step": 30}
    done = {e["step"] for e in events if e["event"] == "rl"}
    assert done == set(range(30))  # every step, the ones after the last checkpoint done again
