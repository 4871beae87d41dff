"""Process trees on this machine: start one in its own session, stop it gracefully, kill it whole.

A torchrun agent starts its workers in their own sessions, so killing the agent alone leaves a
worker running inside the collective (notes/torchrun-elastic.md). A replica is therefore stopped
by walking its tree with psutil, and the pids seen under it are remembered, because once the
agent is dead its orphans are re-parented to init and no tree walk finds them any more.

Those processes are kept as psutil.Process objects, never as bare pids: an object remembers its
process's start time and refuses to signal another process that got the same pid later. A
finished eval's pid, reaped and then reused, was once walked every tick and killed by stop().
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

from huorn.runtime import launcher


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
    root: psutil.Process | None = None  # the root as it was started (None: gone before we looked)
    known: dict[int, psutil.Process] = field(default_factory=dict)  # every process seen under it
    stopping: bool = False  # we asked it to stop, so its exit is not a failure
    log_offset: int = 0
    in_place: bool = False

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def known_pids(self) -> set[int]:
        return set(self.known)

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def remember_descendants(self) -> set[int]:
        """Record the processes under the root now, so they can be killed after the root is gone.
        Once the root has exited and been reaped its pid may be another process's, so nothing is
        looked up by it any more: the orphans seen before are what remains to kill."""
        if self.root is None or self.popen.poll() is not None:
            return set()
        try:
            children = self.root.children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        for child in children:
            self.known.setdefault(child.pid, child)
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
    session keeps a Ctrl-C at the terminal away from it: `huorn run` decides how it stops. If
    this process dies without stopping it (SIGKILL, an OOM kill), the kernel sends it SIGTERM
    (launcher.dies_with_parent): a store once served on, holding its port, and trainers trained
    on unsupervised."""
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
            preexec_fn=launcher.dies_with_parent(),
        )
    try:  # not reaped before we wait for it, so the pid is still this process's
        root: psutil.Process | None = psutil.Process(popen.pid)
    except psutil.NoSuchProcess:
        root = None
    return ManagedProcess(name, vertex, role, popen, log_path, time.time(), root)


def _alive(candidates: list[psutil.Process]) -> list[psutil.Process]:
    """Those still running: is_running() compares start times, so a process whose pid now names
    another one is not."""
    out = []
    for process in candidates:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                out.append(process)
        except psutil.NoSuchProcess:
            continue
    return out


def kill_tree(proc: ManagedProcess, timeout: float = 10.0) -> list[int]:
    """SIGKILL the root, every descendant and every process ever seen under it; reap the root."""
    proc.stopping = True
    proc.remember_descendants()
    victims = _alive([*proc.known.values(), *([proc.root] if proc.root is not None else [])])
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
