"""How Huorn starts an elastic gang: the torchrun command line, the agents' environment, the
stand-alone rendezvous store, and killing a whole replica.

Measured on torch 2.13 (see the team note on torchrun elastic), three choices make a gang on one
host survive the loss of any replica, and they are all made here so every backend inherits them:

1. The c10d rendezvous store runs in its own process (`python -m huorn.runtime.store`), not in
   an agent, because the agent that hosts it is a single point of failure; agents connect with
   `is_host=false` so none of them ever tries to host it.
2. Each replica gets its own loopback address (`--local-addr 127.0.0.N`), so rank-0 bootstrap
   addresses differ per replica exactly as they would on separate hosts.
3. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: with store sharing on, an agent that was not rank 0
   keeps the bootstrap MASTER_ADDR/PORT of the first round forever, so after the old rank 0 dies
   the survivors are told different MASTER_PORTs and hang in init_process_group. With sharing off,
   rank 0 publishes a fresh address in every rendezvous round and everybody reads that one.

Recovery time is governed by `monitor_interval` (how often an agent looks at its workers and at
waiting nodes), the keep-alive settings (a dead agent leaves the rendezvous after interval ×
attempts) and `last_call_timeout` (how long a round waits for latecomers once min is reached).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass(frozen=True)
class ElasticSettings:
    """Rendezvous and restart knobs of one agent; the defaults favour fast recovery on one host."""

    min_nodes: int
    max_nodes: int
    rdzv_endpoint: str
    rdzv_id: str
    nproc_per_node: int = 1
    local_addr: str | None = None
    monitor_interval: float = 0.5
    last_call_timeout: int = 2
    join_timeout: int = 300
    close_timeout: int = 10
    keep_alive_interval: int = 1
    keep_alive_max_attempt: int = 3
    read_timeout: int = 60
    max_restarts: int = 100
    # seconds an agent gives its workers to stop (their agreed stop step and checkpoint) before
    # it SIGKILLs them, on a join as on its own SIGTERM; None: torch's, TORCH_ELASTIC_SHUTDOWN_TIMEOUT
    # or 30 s. Set it below whatever grace the agent itself is given (a pod's, the local backend's).
    shutdown_timeout: int | None = None
    # workers fork from the agent's warm interpreter (huorn.runtime.agent); False: torchrun's own
    # agent, which starts each worker as a fresh interpreter (the benchmarks' baseline)
    fork_workers: bool = True
    extra_rdzv_conf: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"min_nodes ({self.min_nodes}) must be >= 1 and <= max_nodes ({self.max_nodes})")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.shutdown_timeout is not None and self.shutdown_timeout < 1:
            raise ValueError(f"shutdown_timeout must be >= 1 second, got {self.shutdown_timeout}")
        if ":" not in self.rdzv_endpoint:
            raise ValueError(f"rdzv_endpoint {self.rdzv_endpoint!r} must be HOST:PORT of the rendezvous "
                             "store")


def rdzv_conf(settings: ElasticSettings) -> dict[str, str]:
    """The c10d rendezvous handler's options, as torchrun's --rdzv-conf and the in-place trainer
    pass them."""
    return {
        "is_host": "false",
        "last_call_timeout": str(settings.last_call_timeout),
        "join_timeout": str(settings.join_timeout),
        "close_timeout": str(settings.close_timeout),
        "keep_alive_interval": str(settings.keep_alive_interval),
        "keep_alive_max_attempt": str(settings.keep_alive_max_attempt),
        "read_timeout": str(settings.read_timeout),
        **settings.extra_rdzv_conf,
    }


def build_rdzv_conf(settings: ElasticSettings) -> str:
    return ",".join(f"{k}={v}" for k, v in rdzv_conf(settings).items())


def build_standalone_command(config_path: Path | str, nproc: int, python: str = sys.executable) -> list[str]:
    """argv of the trainer on `config_path` alone (a world of one), or of `nproc` local ranks under
    the agent with a rendezvous of its own and no restarts: a run on one host, no gang to join."""
    if nproc == 1:
        return [python, "-m", "huorn.runtime.train", "--config", str(config_path)]
    return [python, "-m", "huorn.runtime.agent", "--standalone", f"--nproc-per-node={nproc}",
            "--max-restarts=0", "-m", "huorn.runtime.train", "--config", str(config_path)]


def build_agent_command(config_path: Path | str, settings: ElasticSettings,
                        python: str = sys.executable) -> list[str]:
    """argv of one agent (one replica) that runs the Huorn trainer on `config_path`: torchrun's
    command line, run by huorn.runtime.agent so that workers fork from a warm interpreter."""
    command = [
        python, "-m", "huorn.runtime.agent" if settings.fork_workers else "torch.distributed.run",
        f"--nnodes={settings.min_nodes}:{settings.max_nodes}",
        f"--nproc-per-node={settings.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={settings.rdzv_endpoint}",
        f"--rdzv-id={settings.rdzv_id}",
        f"--rdzv-conf={build_rdzv_conf(settings)}",
        f"--monitor-interval={settings.monitor_interval}",
        f"--max-restarts={settings.max_restarts}",
    ]
    if settings.local_addr:
        command.append(f"--local-addr={settings.local_addr}")
    if settings.shutdown_timeout is not None:
        command.append(f"--shutdown-timeout={settings.shutdown_timeout}")
    return [*command, "-m", "huorn.runtime.train", "--config", str(config_path)]


def build_in_place_command(config_path: Path | str, settings: ElasticSettings,
                           python: str = sys.executable) -> list[str]:
    """argv of one replica that resizes in place (huorn.runtime.membership): the trainer itself,
    no torchrun agent, taking part in the same c10d rendezvous with the same settings."""
    if settings.nproc_per_node != 1:
        raise ValueError("in-place resizing runs one trainer process per replica: nproc_per_node "
                         f"must be 1, got {settings.nproc_per_node}")
    command = [python, "-m", "huorn.runtime.train", "--config", str(config_path), "--in-place",
               f"--nnodes={settings.min_nodes}:{settings.max_nodes}",
               f"--rdzv-endpoint={settings.rdzv_endpoint}", f"--rdzv-id={settings.rdzv_id}",
               f"--rdzv-conf={build_rdzv_conf(settings)}"]
    return command + ([f"--local-addr={settings.local_addr}"] if settings.local_addr else [])


def parse_in_place_arguments(nnodes: str, endpoint: str | None, rdzv_id: str, local_addr: str | None,
                             conf: str) -> ElasticSettings:
    """The trainer's in-place flags back into ElasticSettings; errors name the flag."""
    if endpoint is None:
        raise ValueError("--in-place needs --rdzv-endpoint HOST:PORT (the stand-alone rendezvous store)")
    try:
        low, high = (int(part) for part in nnodes.split(":", 1)) if ":" in nnodes else (int(nnodes),) * 2
    except ValueError:
        raise ValueError(f"--nnodes must be MIN:MAX or N, got {nnodes!r}") from None
    knobs = {"last_call_timeout": "last_call_timeout", "join_timeout": "join_timeout",
             "close_timeout": "close_timeout", "keep_alive_interval": "keep_alive_interval",
             "keep_alive_max_attempt": "keep_alive_max_attempt", "read_timeout": "read_timeout"}
    values: dict[str, int] = {}
    extra: dict[str, str] = {}
    for item in filter(None, conf.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--rdzv-conf entries are KEY=VALUE, got {item!r}")
        if key in knobs:
            try:
                values[knobs[key]] = int(value)
            except ValueError:
                raise ValueError(f"--rdzv-conf {key} must be a whole number of seconds, "
                                 f"got {value!r}") from None
        elif key != "is_host":
            extra[key] = value
    return ElasticSettings(min_nodes=low, max_nodes=high, rdzv_endpoint=endpoint, rdzv_id=rdzv_id,
                           local_addr=local_addr, extra_rdzv_conf=extra, **values)


def build_agent_env(replica: str, base_env: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of one agent: the replica's name (fault targeting, endpoint files) and the
    store-sharing opt-out explained in the module docstring."""
    env = dict(os.environ if base_env is None else base_env)
    env.update({
        "HUORN_REPLICA": replica,
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
    })
    return env


def build_store_command(host: str, port: int, port_file: Path | str | None = None,
                        python: str = sys.executable) -> list[str]:
    """argv of the stand-alone rendezvous store; port 0 picks a free one and writes it to port_file."""
    command = [python, "-m", "huorn.runtime.store", "--host", host, "--port", str(port)]
    if port_file is not None:
        command += ["--port-file", str(port_file)]
    return command


def build_eval_command(config_path: Path | str, checkpoint: Path | str, python: str = sys.executable,
                       batches: int | None = None, result_file: Path | str | None = None) -> list[str]:
    """The eval vertex's process (huorn.runtime.evaluate): one checkpoint, no process group.
    `result_file` is where a pod's kubelet picks up the result (its termination message)."""
    argv = [python, "-m", "huorn.runtime.evaluate", "--config", str(config_path),
            "--checkpoint", str(checkpoint)]
    argv += ["--batches", str(batches)] if batches is not None else []
    return argv + (["--result-file", str(result_file)] if result_file is not None else [])


def build_serve_command(config_path: Path | str, python: str = sys.executable) -> list[str]:
    """An InferenceJob replica's process (huorn.runtime.serve): one model behind HTTP."""
    return [python, "-m", "huorn.runtime.serve", "--config", str(config_path)]


def build_activator_command(config_path: Path | str, upstream: str,
                            python: str = sys.executable) -> list[str]:
    """A scaled-to-zero InferenceJob's activator (huorn.runtime.activator): holds requests while
    no replica is ready, forwarding them to `upstream` once one is."""
    return [python, "-m", "huorn.runtime.activator", "--config", str(config_path), "--upstream", upstream]


def build_router_command(config_path: Path | str, replicas_dns: str | None = None,
                         replicas: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """An InferenceJob's prefix router (the activator process given the replicas themselves):
    the addresses of a headless Service's name, or fixed replica URLs."""
    where = (["--replicas-dns", replicas_dns] if replicas_dns
             else [arg for url in replicas for arg in ("--replica", url)])
    if not where:
        raise ValueError("a router needs replicas: give replicas_dns or replicas")
    return [python, "-m", "huorn.runtime.activator", "--config", str(config_path), *where]


RAY_PORT = 6379  # Ray's GCS on an RLJob's head pod, behind the job's headless Service


def build_rl_head_command(config_path: Path | str, cpus: int, port: int = RAY_PORT,
                          python: str = sys.executable) -> list[str]:
    """An RLJob's head (huorn.runtime.rl.node): Ray's head node, then the single controller on it."""
    return [python, "-m", "huorn.runtime.rl.node", "head", "--config", str(config_path),
            "--port", str(port), "--cpus", str(cpus)]


def build_rl_controller_command(config_path: Path | str, python: str = sys.executable) -> list[str]:
    """An RLJob's single controller (huorn.runtime.rl.controller), on a Ray cluster that
    RAY_ADDRESS names or on a local one: what the head node and `huorn run` start."""
    return [python, "-m", "huorn.runtime.rl.controller", "--config", str(config_path)]


def build_rl_worker_command(head_address: str, gpus: int, cpus: int,
                            python: str = sys.executable) -> list[str]:
    """One Ray worker node of an RLJob, joining the head at HOST:PORT with its pod's GPUs."""
    return [python, "-m", "huorn.runtime.rl.node", "worker", "--address", head_address,
            "--gpus", str(gpus), "--cpus", str(cpus)]


def replica_address(index: int) -> str:
    """Loopback address of replica `index` (0-based): 127.0.0.2, 127.0.0.3, ... Linux routes the
    whole 127/8 to the loopback device, so these need no setup."""
    if not 0 <= index < 250:
        raise ValueError(f"replica index {index} is outside 0..249")
    return f"127.0.0.{index + 2}"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _find_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


# Looked up here, in the parent: a forked child about to exec must not load libraries.
_PRCTL = _find_prctl()


def dies_with_parent(death_signal: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A preexec_fn that has the kernel send `death_signal` to the child when this process dies.

    Processes started in sessions of their own get no signal from a terminal and, when their
    parent was SIGKILLed (an OOM kill, `timeout -s KILL`), none from it either: the rendezvous
    store served forever and the trainers trained on with nobody to stop them. SIGTERM is what
    the parent would have sent: trainers checkpoint at an agreed step, an agent stops its workers,
    the store exits.

    The kernel sends it when the *thread* that forked exits, so it is set only from the main
    thread (a worker thread's end would stop the child with the run still going); from another
    thread, and off Linux, this returns None and the child outlives a killed parent as before.
    A parent that died between the fork and the prctl call is caught by comparing getppid()."""
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent, number = _PRCTL, os.getpid(), int(death_signal)

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, number, 0, 0, 0)
        if os.getppid() != parent:  # already gone: the signal would never come
            os._exit(128 + number)

    return preexec


def kill_process_tree(pid: int, timeout: float = 10.0) -> list[int]:
    """SIGKILL `pid` and every descendant, children first gathered so none escapes by re-parenting.
    Killing only a torchrun agent leaves its worker running in its own session, still in the
    collective; a replica is gone only when its whole tree is."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return []
    victims = [*root.children(recursive=True), root]
    for process in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(victims, timeout=timeout)
    return [p.pid for p in victims]


def start_store(directory: Path, host: str = "127.0.0.1", env: dict[str, str] | None = None,
                timeout: float = 60.0, port: int = 0) -> tuple[subprocess.Popen, int]:
    """Start the stand-alone rendezvous store in its own session (on `port`, 0: a free one),
    ending with this process (dies_with_parent); returns it and its port."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    port_file = directory / "store.port"
    port_file.unlink(missing_ok=True)
    with open(directory / "store.log", "ab") as log:
        process = subprocess.Popen(build_store_command(host, port, port_file), env=env, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=dies_with_parent())
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            kill_process_tree(process.pid)
            raise RuntimeError(f"the rendezvous store did not start; see {directory / 'store.log'}")
        time.sleep(0.1)
    return process, int(port_file.read_text())


def start_agent(config_path: Path | str, settings: ElasticSettings, replica: str, log_path: Path | str,
                env: dict[str, str] | None = None, in_place: bool = False) -> subprocess.Popen:
    """Start one replica in its own session, as a pod would be: a torchrun agent, or with
    `in_place` the trainer itself; stop it with kill_process_tree (hard) or SIGTERM (graceful).
    It gets SIGTERM if this process dies (dies_with_parent)."""
    build = build_in_place_command if in_place else build_agent_command
    with open(log_path, "ab") as log:
        return subprocess.Popen(build(config_path, settings),
                                env=build_agent_env(replica, env), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=dies_with_parent())
