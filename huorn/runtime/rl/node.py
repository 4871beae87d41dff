"""The processes of an RLJob's pods in a cluster: the head and the Ray worker nodes.

    python -m huorn.runtime.rl.node head --config /etc/huorn/config.json --cpus 4
    python -m huorn.runtime.rl.node worker --address JOB-ray.NS.svc:6379 --gpus 8 --cpus 32

The single controller (huorn.runtime.rl.controller) places the roles as Ray actors itself, so a
cluster needs what KubeRay gives a Ray job: one Ray cluster per job. The head pod starts Ray's
head node (`ray start --head`, no GPU) and runs the controller against it (RAY_ADDRESS), and its
exit code is the controller's, which is what the operator judges the job by. Each worker pod
waits for the head's GCS port to answer, then runs a Ray worker node with its pod's GPUs in the
foreground (`ray start --block`) until the head goes away. The actors that ask for GPUs can only
land on the workers, and the controller starts them within its `startTimeoutS`, so a worker that
comes up late costs time, not the run.

The head's Ray node runs as `ray start --block` in a process group of its own, which the head
ends whatever way the controller ends, so a head run on a workstation leaves nothing behind.

A controller that fails (exit 1: an actor lost to an OOM kill, an exception; or killed) is run
again on the same Ray cluster, up to the spec's `controllerRetries` (read from the config file
each time, so the operator can change it), and resumes from the last checkpoint: the workers and
their Ray nodes stay (KubeRay's users ask for retries that reuse the cluster). A refused config
(exit 2) or a stop (SIGTERM/SIGINT, forwarded to the controller, which checkpoints) ends the pod
with the controller's code, as does the last failure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from huorn.runtime import launcher

RAY = [sys.executable, "-m", "ray.scripts.scripts"]  # Ray's own CLI, from this interpreter's install
_COMMON = ["--disable-usage-stats"]


def wait_for_head(address: str, timeout_s: float, period_s: float = 1.0,
                  alive: subprocess.Popen | None = None) -> None:
    """Block until HOST:PORT accepts a TCP connection; TimeoutError naming it otherwise (and
    RuntimeError at once if `alive`, the process that should open it, has ended). A worker pod
    often starts before the head's Ray does, and `ray start --address` gives up at once."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address: {address!r} is not HOST:PORT of the job's Ray head")
    deadline = time.monotonic() + timeout_s
    while True:
        if alive is not None and alive.poll() is not None:
            raise RuntimeError(f"`ray start` exited with code {alive.returncode} before {address} answered")
        try:
            with socket.create_connection((host, int(port)), timeout=period_s):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the Ray head at {address} did not answer within {timeout_s:.0f} s "
                                   f"({error}); is the job's head pod running?") from None
        time.sleep(period_s)


def start_head(port: int, cpus: int, temp_dir: str, timeout_s: float = 120.0) -> subprocess.Popen:
    """Ray's head node (no GPU: the actors that need one go to the workers) as a child in a
    process group of its own, once its GCS answers.

    NB: `ray start --block` and a group, not a daemonised `ray start` and `ray stop`: `ray stop`
    ends every Ray process of the host, which on a workstation or a CI runner may be somebody
    else's cluster. And a temp dir of its own: `ray start` records its address in the temp dir's
    `ray_current_cluster`, and a later plain `ray.init()` on the host (`huorn run` of an RLJob)
    would try to join that cluster, long gone, instead of starting its own."""
    head = subprocess.Popen([*RAY, "start", "--head", f"--port={port}", f"--num-cpus={cpus}", "--num-gpus=0",
                             f"--temp-dir={temp_dir}", "--include-dashboard=false", "--block", *_COMMON],
                            stdout=sys.stderr, start_new_session=True)
    try:
        wait_for_head(f"127.0.0.1:{port}", timeout_s, period_s=0.2, alive=head)
    except (TimeoutError, RuntimeError):
        stop_group(head)
        raise
    return head


def stop_group(process: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the process's group (`ray start --block` then ends its node's processes), then
    SIGKILL to whatever is left after the grace period. NB: short, because it runs once the
    controller has returned (its checkpoint is saved): on SIGTERM Ray drains the node for up to
    30 s, which made every head pod and every local run linger half a minute for nothing."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait)
            return


ATTEMPT_ENV = "HUORN_CONTROLLER_ATTEMPT"  # 1 for the first run of the controller in this pod


def controller_retries(config: str) -> int:
    """spec.controllerRetries of the config file as it reads now; 0 when it cannot be read."""
    try:
        with open(config) as handle:
            return max(0, int(json.load(handle)["spec"].get("controllerRetries", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def run_head(config: str, port: int, cpus: int, temp_dir: str | None = None) -> int:
    """Ray's head node, then the controller on it (again, up to spec.controllerRetries). A temp
    dir made here is removed once the job succeeded: each run otherwise left Ray's logs and
    sockets behind under /tmp (hundreds of KB a run); after a failure it stays, and is named, for
    its logs."""
    own = temp_dir is None
    temp = temp_dir or tempfile.mkdtemp(prefix="huorn-ray-")
    code = 1
    try:
        code = _run_head(config, port, cpus, temp)
        return code
    finally:
        if own and code == 0:
            shutil.rmtree(temp, ignore_errors=True)
        elif own:
            print(f"huorn-rl: Ray's logs are kept in {temp}/session_latest/logs", file=sys.stderr)


def _run_head(config: str, port: int, cpus: int, temp_dir: str) -> int:
    try:
        head = start_head(port, cpus, temp_dir)
    except (TimeoutError, RuntimeError) as error:
        print(f"error: Ray's head node did not start: {error}", file=sys.stderr)
        return 1
    stopping: list[int] = []
    child: list[subprocess.Popen] = []

    def forward(signum: int, frame: object) -> None:
        stopping.append(signum)
        if child and child[-1].poll() is None:
            child[-1].send_signal(signum)  # the controller ends its step and checkpoints

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    try:
        attempt = 1
        while True:
            if stopping:  # stopped between two runs: nothing to checkpoint
                return 128 + stopping[0]
            env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}", ATTEMPT_ENV: str(attempt)}
            child.append(subprocess.Popen(launcher.build_rl_controller_command(config), env=env))
            code = child[-1].wait()
            retries = controller_retries(config)
            if code in (0, 2) or stopping or attempt > retries or head.poll() is not None:
                return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number
            print(f"huorn-rl: the controller exited {code}; running it again on the same Ray cluster, from "
                  f"the last checkpoint (retry {attempt} of {retries}, spec.controllerRetries)",
                  file=sys.stderr, flush=True)
            attempt += 1
    finally:
        stop_group(head)


def run_worker(address: str, gpus: int, cpus: int, timeout_s: float) -> int:
    wait_for_head(address, timeout_s)
    command = [*RAY, "start", f"--address={address}", f"--num-gpus={gpus}", f"--num-cpus={cpus}",
               "--block", *_COMMON]
    os.execv(command[0], command)  # the pod's process is Ray's node itself: its exit is the pod's


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.rl.node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    roles = parser.add_subparsers(dest="role", required=True)
    head = roles.add_parser("head", help="Ray's head node and the single controller")
    head.add_argument("--config", required=True, help="the controller's run config")
    head.add_argument("--port", type=int, default=6379, help="the GCS port the workers join")
    head.add_argument("--cpus", type=int, default=1, help="CPUs Ray may use on this node")
    head.add_argument("--temp-dir", default=None, help="Ray's temp dir (default: a new one under /tmp)")
    worker = roles.add_parser("worker", help="a Ray worker node holding this pod's GPUs")
    worker.add_argument("--address", required=True, help="HOST:PORT of the head's GCS")
    worker.add_argument("--gpus", type=int, default=0)
    worker.add_argument("--cpus", type=int, default=1)
    worker.add_argument("--wait", type=float, default=600.0, help="seconds to wait for the head")
    args = parser.parse_args(argv)
    if args.role == "head":
        return run_head(args.config, args.port, max(1, args.cpus), args.temp_dir)
    try:
        return run_worker(args.address, args.gpus, max(1, args.cpus), args.wait)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except TimeoutError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
