"""The local backend against real processes: failure detection from the agents' own log lines,
the store as its own process, and killing whole trees including orphans."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from huorn import graph
from huorn.api import manifests
from huorn.backends.local import backend as local_backend
from huorn.backends.local import processes
from huorn.graph import model, mutate

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def build_graph() -> model.Graph:
    return graph.compile(manifests.load_manifest(QUICKSTART))


def start_python(tmp_path: Path, name: str, role: str, code: str) -> processes.ManagedProcess:
    return processes.start_process(
        name,
        "trainer" if role == "trainer" else "rendezvous",
        role,
        [sys.executable, "-c", code],
        {"PATH": "/usr/bin:/bin"},
        tmp_path / "logs" / f"{name}.log",
        tmp_path,
    )


def wait_exit(proc: processes.ManagedProcess) -> None:
    proc.popen.wait(timeout=60)


def test_signal_deaths_are_failures_but_sigterm_and_clean_exits_are_not(tmp_path: Path) -> None:
    g = build_graph()
    mutate.resize(g, "trainer", 2, reason="two agents")
    backend = local_backend.LocalBackend(g, tmp_path)
    line = "[E] failed (exitcode: {code}) local_rank: 0 (pid: {pid}) of binary: python"
    killed = start_python(
        tmp_path,
        "trainer-0",
        "trainer",
        f"print({line.format(code=-9, pid=4242)!r}, flush=True); import time; time.sleep(60)",
    )
    stopped = start_python(tmp_path, "trainer-1", "trainer", f"print({line.format(code=-15, pid=4343)!r})")
    backend.processes = {"quickstart-trainer-0": killed, "quickstart-trainer-1": stopped}
    try:
        observe_signal_deaths(backend, killed, stopped)
    finally:
        backend.stop(graceful=False)
    assert killed.exit_code() is not None


def observe_signal_deaths(
    backend: local_backend.LocalBackend, killed: processes.ManagedProcess, stopped: processes.ManagedProcess
) -> None:
    wait_exit(stopped)
    deadline = time.monotonic() + 30
    while "4242" not in killed.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    seen = backend.observe()
    assert seen.instances["trainer-0"].failed and seen.instances["trainer-0"].alive
    assert seen.instances["trainer-0"].reason == "worker pid 4242 of trainer-0 was killed by SIGKILL"
    assert not seen.instances["trainer-1"].failed  # SIGTERM is how workers are stopped on purpose
    assert not seen.finished  # trainer-0 still runs
    # The log is read incrementally: the same line is not reported twice.
    assert not backend.observe().instances["trainer-0"].failed


def test_an_agent_exiting_nonzero_fails_and_all_zero_exits_finish(tmp_path: Path) -> None:
    backend = local_backend.LocalBackend(build_graph(), tmp_path)
    bad = start_python(tmp_path, "trainer-0", "trainer", "raise SystemExit(1)")
    backend.processes = {"quickstart-trainer-0": bad}
    wait_exit(bad)
    state = backend.observe().instances["trainer-0"]
    assert state.failed and state.reason == "trainer process of trainer-0 exited with code 1"
    good = start_python(tmp_path, "trainer-0-g1", "trainer", "pass")
    backend.processes = {"quickstart-trainer-0-g1": good}
    wait_exit(good)
    assert backend.observe().finished


def test_an_in_place_replica_is_judged_by_its_own_exit(tmp_path: Path) -> None:
    """No agent logs an in-place worker's death: its own exit code says it. A signal death is a
    failure, a SIGTERM this backend sent (a leave) is not, and all-zero exits finish the run."""
    backend = local_backend.LocalBackend(build_graph(), tmp_path)
    killed = start_python(tmp_path, "trainer-0", "trainer", "import os, signal; os.kill(os.getpid(), 9)")
    leaving = start_python(tmp_path, "trainer-1", "trainer", "import time; time.sleep(60)")
    for proc in (killed, leaving):
        proc.in_place = True
    backend.processes = {"quickstart-trainer-0": killed, "quickstart-trainer-1": leaving}
    try:
        processes.send_terminate(leaving)
        wait_exit(killed)
        wait_exit(leaving)
        seen = backend.observe()
        state = seen.instances["trainer-0"]
        assert state.failed and state.reason == f"worker pid {killed.pid} of trainer-0 was killed by SIGKILL"
        assert not seen.instances["trainer-1"].failed and not seen.finished
        done = start_python(tmp_path, "trainer-0-g1", "trainer", "pass")
        done.in_place = True
        backend.processes = {"quickstart-trainer-0-g1": done, "quickstart-trainer-1": leaving}
        wait_exit(done)
        assert backend.observe().finished  # the leaver is not waited for
    finally:
        backend.stop(graceful=False)


def test_a_refused_config_stops_the_run_instead_of_replacing_forever(tmp_path: Path) -> None:
    """Exit code 2 is the runtime refusing its config: a new replica would be refused the same
    way (at once, in place), so the backend gives up rather than replace it in a loop."""
    backend = local_backend.LocalBackend(build_graph(), tmp_path)
    refused = start_python(tmp_path, "trainer-0", "trainer", "raise SystemExit(2)")
    refused.in_place = True
    backend.processes = {"quickstart-trainer-0": refused}
    wait_exit(refused)
    with pytest.raises(local_backend.LocalBackendError, match="refused its config"):
        backend.observe()


def test_store_runs_as_its_own_process_and_stop_removes_it(tmp_path: Path) -> None:
    g = build_graph()
    mutate.set_active(g, "trainer", False, reason="only the store for this test")
    backend = local_backend.LocalBackend(g, tmp_path)
    try:
        check_store_serves(backend, backend.apply(g))
    finally:
        backend.stop()


def check_store_serves(backend: local_backend.LocalBackend, done: list[str]) -> None:
    pid = backend.processes["quickstart-rendezvous-0"].pid
    assert f"started rendezvous store rendezvous-0 on {backend.store_endpoint} (pid {pid})" in done
    host, port = str(backend.store_endpoint).split(":")
    from datetime import timedelta

    from torch.distributed import TCPStore

    client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
    client.set("probe", "1")
    assert client.get("probe") == b"1"
    store = backend.processes["quickstart-rendezvous-0"]
    assert backend.stop() == [f"killed rendezvous-0 (process tree [{store.pid}])"]
    assert not psutil.pid_exists(store.pid) or psutil.Process(store.pid).status() == psutil.STATUS_ZOMBIE


def test_kill_tree_reaches_orphans_of_a_dead_root(tmp_path: Path) -> None:
    # The root starts a child in its own session (as torchrun does with workers) and waits.
    code = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        "time.sleep(120)\n"
    )
    root = start_python(tmp_path, "trainer-0", "trainer", code)
    deadline = time.monotonic() + 30
    while not root.remember_descendants() and time.monotonic() < deadline:
        time.sleep(0.1)
    (child,) = root.known_pids
    psutil.Process(root.pid).kill()  # the agent dies first; its worker is re-parented away
    root.popen.wait(timeout=30)
    assert psutil.pid_exists(child)
    assert child in processes.kill_tree(root)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_other_kinds_are_refused_by_the_local_backend(tmp_path: Path) -> None:
    rl = graph.compile(manifests.load_manifest(QUICKSTART.parent / "rl-job.yaml"))
    try:
        local_backend.LocalBackend(rl, tmp_path)
    except local_backend.LocalBackendError as error:
        assert "run it through the operator" in str(error)
    else:
        raise AssertionError("an RLJob graph must be refused")


def test_replaced_instances_are_killed_at_once_unless_drained(tmp_path: Path) -> None:
    g = build_graph()
    mutate.resize(g, "trainer", 2, reason="two agents")
    backend = local_backend.LocalBackend(g, tmp_path)
    backend.apply(g)  # starts the store and two real agents; replace both before they matter
    try:
        mutate.replace_instance(g, "trainer-0", reason="hung: remediation S4")
        mutate.replace_instance(g, "trainer-1", reason="store moved", drain=True)
        done = backend.apply(g)
        assert done[0].startswith("killed quickstart-trainer-0 (process tree")
        assert done[1].startswith("stopped quickstart-trainer-1 with SIGTERM")
    finally:
        backend.stop(graceful=False)


def test_a_finished_eval_does_not_reach_the_process_that_got_its_pid(tmp_path: Path) -> None:
    """A finished eval was never marked stopping: every tick walked the tree under its reaped pid,
    and stop() killed that pid and all seen under it, whoever had them by then."""
    backend = local_backend.LocalBackend(build_graph(), tmp_path)
    done = processes.start_process("eval-0", "eval", "eval", [sys.executable, "-c", "pass"],
                                   {"PATH": "/usr/bin:/bin"}, tmp_path / "logs" / "eval-0.log", tmp_path)
    done.popen.wait(timeout=60)
    # The kernel hands the reaped pid to an unrelated process, which has a child of its own.
    stranger = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
                                 "time.sleep(120)\n"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not psutil.Process(stranger.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        (child,) = psutil.Process(stranger.pid).children()
        done.popen.pid = stranger.pid  # how a reused pid looks from here
        backend.processes = {"quickstart-eval-0": done}
        for _ in range(2):
            state = backend.observe().instances["eval-0"]
            assert state.completed and not state.alive and not state.failed
        assert done.known_pids == set()
        backend.stop(graceful=False)
        assert stranger.poll() is None and child.is_running()
    finally:
        if stranger.poll() is None:
            for process in psutil.Process(stranger.pid).children():
                process.kill()
        stranger.kill()
        stranger.wait(timeout=30)
