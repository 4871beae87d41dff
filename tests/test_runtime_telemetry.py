"""Telemetry endpoints and fault injection: unit level, then a real two-rank gang under torchrun
whose hangs are injected through the control file and read back from /telemetry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import prometheus_client
import pytest
import runtime_harness as harness

from huorn.runtime import comm, faults, launcher, telemetry
from huorn.runtime import config as run_config


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, ""


@pytest.fixture
def served() -> tuple[telemetry.Telemetry, int]:
    tel = telemetry.Telemetry("job", rank=1, world_size=2, replica="r1", history=3)
    port = tel.serve("127.0.0.1", 0)
    yield tel, port
    tel.close()


def test_metrics_endpoint_serves_every_series(served: tuple[telemetry.Telemetry, int]) -> None:
    tel, port = served
    for _ in range(2):
        tel.complete_collective(tel.enter_collective("allreduce"))
    tel.complete_collective(tel.enter_collective("stats"))
    tel.record_step(1, step_seconds=0.5, comm_seconds=0.2, loss=3.25, tokens_per_second=1000.0,
                    noise_scale=42.0)
    status, body = _get(port, "/metrics")
    assert status == 200
    for line in ('huorn_collectives_total{op="allreduce"} 2.0', 'huorn_collectives_total{op="stats"} 1.0',
                 'huorn_collective_seconds_count{op="allreduce"} 2.0', "huorn_step_seconds_count 1.0",
                 "huorn_loss 3.25", "huorn_tokens_per_second 1000.0", "huorn_gradient_noise_scale 42.0",
                 "huorn_collective_seq_entered 3.0", "huorn_collective_seq_completed 3.0",
                 "huorn_world_size 2.0",
                 'huorn_rank_info{job="job"'):
        assert line in body, line
    heartbeat = next(v for v in body.splitlines() if v.startswith("huorn_heartbeat_timestamp_seconds "))
    assert abs(float(heartbeat.split()[1]) - time.time()) < 60


def test_telemetry_endpoint_shows_in_flight_collectives_and_recent_steps(
        served: tuple[telemetry.Telemetry, int]) -> None:
    tel, port = served
    done = tel.enter_collective("allreduce")
    tel.complete_collective(done)
    before = time.time()
    stuck = tel.enter_collective("allreduce")
    for step in range(1, 5):
        tel.record_step(step, step_seconds=1.0, comm_seconds=2.0, loss=1.0, tokens_per_second=1.0,
                        noise_scale=None)
    status, body = _get(port, "/telemetry")
    view = json.loads(body)
    assert status == 200 and (view["rank"], view["world_size"], view["replica"]) == (1, 2, "r1")
    assert view["collective"]["entered"] == stuck and view["collective"]["completed"] == done
    assert [c["seq"] for c in view["collective"]["in_flight"]] == [stuck]
    # when the sequence numbers last changed (the stuck entry): a late hang detector's clock
    assert before <= view["collective"]["changed"] <= time.time()
    assert [s["step"] for s in view["steps"]] == [2, 3, 4]  # the last N (history=3)
    assert view["steps"][-1]["comm_seconds"] == 1.0 and view["steps"][-1]["compute_seconds"] == 0.0  # capped
    assert _get(port, "/nothing")[0] == 404 and _get(port, "/healthz") == (200, "ok\n")


def test_a_wait_on_a_known_peer_is_served_as_waiting_on() -> None:
    """A pipeline stage's receive names the neighbour it waits for; the oldest such wait is what
    the rank waits on. Its seconds stay out of the step's communication time when the caller
    counts them itself."""
    tel = telemetry.Telemetry("job", rank=3, world_size=4, replica="r1")
    reduce = tel.enter_collective("grad-allreduce")
    receive = tel.enter_collective("recv-activations", peer=2)
    tel.enter_collective("send-drain", peer=1)
    view = tel.snapshot()["collective"]
    assert [(f["op"], f.get("peer")) for f in view["in_flight"]] == [
        ("grad-allreduce", None), ("recv-activations", 2), ("send-drain", 1)]
    assert view["waiting_on"] == 2
    tel.complete_collective(receive, count_seconds=False)
    tel.complete_collective(reduce, count_seconds=False)
    assert tel.snapshot()["collective"]["waiting_on"] == 1 and tel.take_comm_seconds() == 0.0
    assert telemetry.Telemetry("job", 0, 1, None).snapshot()["collective"]["waiting_on"] is None


def test_the_step_ledger_pads_every_phase_to_its_allotment() -> None:
    """Stages issue different numbers of operations; padded to one allotment per phase, every
    rank's sequence numbers agree at phase ends, which the hang detector's comparison needs."""
    ranks = [telemetry.Telemetry("job", rank, 2, None) for rank in range(2)]
    ledgers = [comm.StepLedger(t) for t in ranks]
    for ledger, operations in zip(ledgers, (1, 4), strict=True):
        ledger.begin(4)
        for _ in range(operations):
            ledger.run("recv-gradients", 1, lambda: None)
        ledger.end()
        ledger.once("grad-allreduce", None, lambda: None)
    assert [(t.snapshot()["collective"]["entered"], t.snapshot()["collective"]["completed"]) for t in ranks] \
        == [(5, 5), (5, 5)]
    ledgers[0].begin(1)
    ledgers[0].run("recv-gradients", 1, lambda: None)
    with pytest.raises(RuntimeError, match="allotted 1"):
        ledgers[0].run("recv-gradients", 1, lambda: None)
    # a wait that fails still completes its operation: nothing is left in flight
    with pytest.raises(ValueError):
        ledgers[1].once("grad-allreduce", None, _raise)
    assert ranks[1].snapshot()["collective"]["in_flight"] == []
    calls: list[int] = []
    comm.StepLedger(None).once("grad-allreduce", None, lambda: calls.append(1))  # no telemetry: just runs
    assert calls == [1]


def _raise() -> None:
    raise ValueError("peer lost")


def test_endpoint_file_tells_a_supervisor_where_to_look(tmp_path: Path) -> None:
    path = telemetry.write_endpoint_file(tmp_path, "r2", 0, {"port": 1234, "rank": 5})
    assert path == tmp_path / "endpoints" / "r2-0.json"
    assert json.loads(path.read_text()) == {"port": 1234, "rank": 5}


def test_faults_select_ranks_replicas_and_step_windows() -> None:
    fault = run_config.Fault(kind="slow-compute", ms=10, from_step=3, until_step=5, rank=1)
    assert [fault.applies(s, 1, None) for s in range(2, 7)] == [False, True, True, False, False]
    assert not fault.applies(3, 0, None)
    assert run_config.Fault(kind="hang-compute", replica="b").applies(0, 7, "b")
    with pytest.raises(ValueError, match="ms > 0"):
        run_config.Fault(kind="slow-comm")


def test_control_file_drives_faults_and_a_cleared_hang_releases(tmp_path: Path) -> None:
    injector = faults.FaultInjector([], tmp_path, rank=0, replica=None)
    control = tmp_path / run_config.FAULTS_FILE
    control.write_text(json.dumps({"faults": [{"kind": "hang-collective"}]}))
    injector.refresh()
    released = threading.Event()
    worker = threading.Thread(target=lambda: (injector.inside_collective(), released.set()), daemon=True)
    worker.start()
    assert not released.wait(1.5)  # hung
    control.write_text("{not json")  # a harness caught mid-write must not release it by accident
    assert not released.wait(1.5)
    control.write_text(json.dumps({"faults": []}))
    assert released.wait(30)
    control.write_text(json.dumps([{"kind": "slow-compute", "ms": 300}]))
    injector.refresh()
    started = time.monotonic()
    injector.before_compute()
    assert time.monotonic() - started >= 0.3


def _telemetry(tmp: Path, rank: int) -> dict:
    for path in (tmp / "run" / "endpoints").glob("*.json"):
        info = json.loads(path.read_text())
        if info["rank"] == rank:
            return json.loads(_get(info["port"], "/telemetry")[1])
    raise AssertionError(f"no endpoint file for rank {rank}")


def _stalled(tmp: Path, rank: int, seconds: float = 2.0) -> dict:
    """Views of `rank` taken `seconds` apart; equal sequence numbers mean it stopped."""
    before = _telemetry(tmp, rank)["collective"]
    time.sleep(seconds)
    after = _telemetry(tmp, rank)["collective"]
    return after if (before["entered"], before["completed"]) == (after["entered"], after["completed"]) else {}


@pytest.mark.serial
@pytest.mark.slow
def test_injected_hangs_show_in_sequence_numbers_of_a_real_gang(tmp_path: Path) -> None:
    config = harness.write_config(tmp_path, harness.shared_data_dir(), harness.build_spec(steps=100_000),
                                  faults=[{"kind": "slow-compute", "ms": 30}])
    command = [sys.executable, "-m", "huorn.runtime.agent", "--standalone", "--nproc-per-node=2",
               "--max-restarts=2", "-m", "huorn.runtime.train", "--config", str(config)]
    with open(tmp_path / "gang.log", "ab") as log:
        gang = subprocess.Popen(command, cwd=harness.REPO, stdout=log, stderr=subprocess.STDOUT,
                                env=launcher.build_agent_env("g", harness.child_env()),
                                start_new_session=True)
    try:
        harness.wait_for(lambda: len(harness.steps_of(harness.read_events(tmp_path / "run"))) >= 3, 240,
                         "three steps")
        view = _telemetry(tmp_path, 0)
        assert view["world_size"] == 2 and view["steps"][-1]["comm_seconds"] >= 0
        # the batch and rate each step trained with, as its log line says (status.batchSize, learningRate)
        logged = {e["step"]: e for e in harness.steps_of(harness.read_events(tmp_path / "run"))}
        started = next(e for e in harness.read_events(tmp_path / "run") if e.get("event") == "start")
        seen = [s for s in view["steps"] if s["step"] in logged]
        assert seen and all(s["global_batch"] == started["global_batch"] > 0 for s in seen)
        assert all(s["learning_rate"] == logged[s["step"]]["lr"] > 0 for s in seen)
        # Two ranks give two batch sizes, so the gradient noise scale gets a value.
        noise = harness.wait_for(lambda: [s["gradient_noise_scale"] for s in _telemetry(tmp_path, 0)["steps"]
                                          if s["gradient_noise_scale"]], 120, "a gradient noise scale")
        assert all(0 < value < 1e6 for value in noise)
        assert {s.get("gradient_noise_reading") for s in _telemetry(tmp_path, 0)["steps"]} == {"ranks"}
        control = tmp_path / "run" / run_config.FAULTS_FILE

        # hang-compute on rank 1: it stops entering collectives; rank 0 waits inside the next one.
        control.write_text(json.dumps([{"kind": "hang-compute", "rank": 1}]))
        hung = harness.wait_for(lambda: _stalled(tmp_path, 1), 120, "rank 1 to stall")
        assert hung["entered"] == hung["completed"] and not hung["in_flight"]
        waiting = _telemetry(tmp_path, 0)["collective"]
        assert waiting["entered"] == hung["entered"] + 1 and len(waiting["in_flight"]) == 1

        # Clearing the control file releases it and the gang trains on.
        control.write_text("[]")
        harness.wait_for(lambda: _telemetry(tmp_path, 1)["collective"]["completed"] > hung["completed"], 120,
                         "rank 1 to resume")

        # hang-collective on rank 1: it enters the all-reduce and never completes it.
        control.write_text(json.dumps([{"kind": "hang-collective", "rank": 1}]))
        stuck = harness.wait_for(lambda: _stalled(tmp_path, 1), 120, "rank 1 to hang in a collective")
        assert stuck["entered"] == stuck["completed"] + 1
        assert stuck["in_flight"][0]["op"] == "allreduce" and stuck["in_flight"][0]["seconds"] >= 2
        control.write_text("[]")
        harness.wait_for(lambda: _telemetry(tmp_path, 1)["collective"]["completed"] > stuck["completed"], 120,
                         "the collective to complete")

        # slow-comm on rank 0 shows as communication time on rank 0.
        control.write_text(json.dumps([{"kind": "slow-comm", "ms": 400, "rank": 0}]))
        harness.wait_for(lambda: _telemetry(tmp_path, 0)["steps"][-1]["comm_seconds"] >= 0.4, 120,
                         "slow communication on rank 0")
        control.write_text("[]")

        # SIGTERM to one worker only: both ranks agree on the step, checkpoint together, the
        # signalled rank exits 0 and its peer asks its agent for a restart, which resumes there.
        os.kill(_telemetry(tmp_path, 1)["pid"], signal.SIGTERM)
        stopped = harness.wait_for(lambda: [e for e in harness.read_events(tmp_path / "run")
                                            if e["event"] == "checkpoint" and e["reason"] != "periodic"],
                                   120, "the agreed checkpoint")[0]
        assert stopped["reason"] == "peer-stop"  # logged by rank 0, which was not signalled
        restarted = harness.wait_for(
            lambda: harness.split_attempts(harness.read_events(tmp_path / "run"))[1:], 180, "the restart")[0]
        assert restarted["start"]["resumed_from"] == stopped["step"]
        assert restarted["start"]["restart_count"] == 1
    finally:
        launcher.kill_process_tree(gang.pid)


def test_a_regroup_restarts_the_collective_timeline_for_every_member() -> None:
    """After an in-place regroup a joiner starts counting collectives at 0; the members must too,
    or the hang detector would see the joiner as far behind its peers."""
    from huorn.scheduler.remediation import hang

    member, joiner = (telemetry.Telemetry("job", 0, 2, "r0"), telemetry.Telemetry("job", 2, 3, "r2"))
    for _ in range(40):
        member.complete_collective(member.enter_collective("allreduce"))
    member.rejoin(1, 3)
    assert member.snapshot()["rank"] == 1 and member.snapshot()["world_size"] == 3
    for rank in (member, joiner):
        rank.complete_collective(rank.enter_collective("broadcast"))
    now = time.time()
    samples = [hang.parse_runtime_telemetry(t.snapshot(), now) for t in (member, joiner)]
    assert [(s.seq_entered, s.seq_completed) for s in samples] == [(1, 1), (1, 1)]
    exported = prometheus_client.generate_latest(member.registry).decode()
    assert "huorn_world_size 3.0" in exported and 'rank="1"' in exported
