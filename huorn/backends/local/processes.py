"""Process trees on this machine: start one in its own session, stop it gracefully, kill it whole.

A torchrun agent starts its workers in their own sessions, so killing the agent alone leaves a
worker running inside the collective (notes/torchrun-elastic.md). A replica is therefore stopped
by walking its tree with psutil, and the pids seen under it are remembered, because once the
agent is dead its orphans are re-parented to init and no tree walk finds them any more.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil


@dataclass
class ManagedProcess:
    """One process tree the local backend started: a store, a torchrun agent and its workers, or
    a trainer that resizes in place (`in_place`: the root is the worker itself, with no agent
    to restart it or to log its death, and a SIGTERM makes it leave the gang, not checkpoint)."""

    name: str
    vertex: str
    role: str
    popen: subprocess.Popen
    log_path: Path
    started_at: float
    known_pids: set[int] = field(default_factory=set)
    stopping: bool = False  # we asked it to stop, so its exit is not a failure
    log_offset: int = 0
    in_place: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def remember_descendants(self) -> set[int]:
        """Record the pids under the root now, so they can be killed after the root is gone."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        self.known_pids.update(c.pid for c in children)
        return {c.pid for c in children}

    def read_new_log(self) -> str:
        """Log text written since the previous call."""
        try:
            with open(self.log_path, "rb") as handle:
                handle.seek(self.log_offset)
                data = handle.read()
        except OSError:
            return ""
        self.log_offset += len(data)
        return data.decode(errors="replace")


def start_process(
    name: str, vertex: str, role: str, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
) -> ManagedProcess:
    """Start `argv` in a new session with stdout and stderr appended to `log_path`. The new
    session keeps a Ctrl-C at the terminal away from it: `huorn run` decides how it stops."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    return ManagedProcess(name, vertex, role, popen, log_path, time.time())


def _alive(pids: set[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                out.append(process)
        except psutil.NoSuchProcess:
            continue
    return out


def kill_tree(proc: ManagedProcess, timeout: float = 10.0) -> list[int]:
    """SIGKILL the root, every descendant and every pid ever seen under it; reap the root."""
    proc.stopping = True
    proc.remember_descendants()
    victims = _alive({*proc.known_pids, proc.pid})
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(victims, timeout=timeout)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.popen.wait(timeout=timeout)
    return sorted(v.pid for v in victims)


def send_terminate(proc: ManagedProcess) -> None:
    """SIGTERM the root only: a torchrun agent forwards it to its workers, which checkpoint; an
    in-place trainer leaves the gang at its next step boundary (or, when the whole gang got
    it, checkpoints with the others)."""
    proc.stopping = True
    proc.remember_descendants()
    if proc.exit_code() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)


def wait_exit(proc: ManagedProcess, timeout: float) -> int | None:
    try:
        return proc.popen.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
