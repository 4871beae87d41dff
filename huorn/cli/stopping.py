"""How `huorn run` stops: Ctrl-C, SIGTERM and SIGHUP all mean "stop cleanly", and the cleanup
itself is not cut short by a second one.

The processes a run starts live in sessions of their own, so that a terminal's Ctrl-C reaches
`huorn run` alone and it decides the order of the stop (trainers checkpoint first, the store
last). The price: a signal that ended `huorn run` outright (`kill`, `timeout`, a closed terminal
or a lost ssh session) left them running, a server still holding --port. Signal handlers can
only be set from the main thread; elsewhere (tests drive the CLI in threads) both are no-ops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

from huorn.runtime import launcher

STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _install(handlers: dict[int, object]) -> dict[int, object] | None:
    if threading.current_thread() is not threading.main_thread():
        return None
    return {number: signal.signal(number, handler) for number, handler in handlers.items()}  # type: ignore[arg-type]


def _restore(previous: dict[int, object] | None) -> None:
    for number, handler in (previous or {}).items():
        signal.signal(number, handler)  # type: ignore[arg-type]


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """Every stop signal raises KeyboardInterrupt, as Ctrl-C does. NB: SIGINT too, explicitly: a
    shell starts background jobs with SIGINT ignored, and Python leaves it ignored."""
    previous = _install({signal.SIGINT: signal.default_int_handler, signal.SIGTERM: raise_interrupt,
                         signal.SIGHUP: raise_interrupt})
    try:
        yield
    finally:
        _restore(previous)


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Stop signals ignored while a stop is carried out: a second Ctrl-C must not cut a
    checkpoint short, nor leave a child unwaited for."""
    previous = _install(dict.fromkeys(STOPS, signal.SIG_IGN))
    try:
        yield
    finally:
        _restore(previous)


def wait_or_kill(process: subprocess.Popen, seconds: float) -> int:
    """A stopped child's exit code once it has finished its stop; its whole session (it runs in one
    of its own, with whatever it started) is killed after `seconds`: a stop is shielded from
    signals, so a child that hung would otherwise hang huorn run for good."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def start_in_own_session(command: list[str], log: Path) -> subprocess.Popen:
    """`command` in a session of its own (a terminal's Ctrl-C reaches `huorn run` alone, which
    stops it in order), its output into `log`; and should `huorn run` be SIGKILLed (an OOM kill,
    `timeout -s KILL`), the kernel sends it SIGTERM: a server left behind held its port, and an
    RL controller trained on with its Ray cluster, with nobody to stop them."""
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=launcher.dies_with_parent())
