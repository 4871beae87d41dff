"""In-place resizing (huorn.runtime.membership): replicas that join, leave and die while the
others keep their processes, their state and their step; the run stays exact."""

from __future__ import annotations

import itertools
import json
import subprocess
import time
from pathlib import Path

import pytest
import runtime_harness as harness

from huorn.runtime import launcher, steplog, train

LOSS_TOLERANCE = 1e-4  # max |Δloss| per step against the uninterrupted single-process run


def _settings(port: int, replica: int) -> launcher.ElasticSettings:
    return launcher.ElasticSettings(min_nodes=1, max_nodes=3, rdzv_endpoint=f"127.0.0.1:{port}",
                                    rdzv_id="in-place", local_addr=launcher.replica_address(replica))


def test_in_place_command_is_the_trainer_itself_with_the_rendezvous_settings() -> None:
    command = launcher.build_in_place_command("/cfg.json", _settings(29400, 1), python="py")
    assert command[:5] == ["py", "-m", "huorn.runtime.train", "--config", "/cfg.json"]
    assert "--in-place" in command and "--nnodes=1:3" in command
    assert "--rdzv-endpoint=127.0.0.1:29400" in command and "--local-addr=127.0.0.3" in command
    conf = next(c for c in command if c.startswith("--rdzv-conf=")).removeprefix("--rdzv-conf=")
    parsed = launcher.parse_in_place_arguments("1:3", "127.0.0.1:29400", "in-place", "127.0.0.3", conf)
    assert parsed == _settings(29400, 1)  # the flags carry every setting there and back
    with pytest.raises(ValueError, match="nproc_per_node"):
        launcher.build_in_place_command("/cfg.json", launcher.ElasticSettings(
            min_nodes=1, max_nodes=2, rdzv_endpoint="h:1", rdzv_id="x", nproc_per_node=2))


@pytest.mark.parametrize(("arguments", "message"), [
    (("1:3", None, "x", None, ""), "--rdzv-endpoint"),
    (("one:3", "h:1", "x", None, ""), "--nnodes"),
    (("1:3", "h:1", "x", None, "last_call_timeout"), "KEY=VALUE"),
    (("1:3", "h:1", "x", None, "join_timeout=soon"), "join_timeout"),
])
def test_bad_in_place_flags_name_the_flag(arguments: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        launcher.parse_in_place_arguments(*arguments)


def test_a_pipeline_job_refuses_to_resize_in_place(tmp_path: Path) -> None:
    spec = harness.build_spec(steps=2)
    spec["parallelism"] = {"pipelineStages": 2}
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec)
    done = subprocess.run([*launcher.build_in_place_command(config, _settings(1, 0))], cwd=harness.REPO,
                          env=harness.child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "pipelineStages" in done.stderr


def test_a_leaver_stops_its_heartbeat_thread_before_it_exits() -> None:
    """The rendezvous's keep-alive thread calls into the store's C++ client; one still beating at
    interpreter shutdown aborted a leaver (SIGABRT, "terminate called without an active
    exception") instead of letting it exit LEFT_EXIT. `leave()` must end it, and only it."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from huorn.runtime import membership

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30))
    settings = launcher.ElasticSettings(min_nodes=1, max_nodes=1, rdzv_endpoint=f"127.0.0.1:{master.port}",
                                        rdzv_id="leave", local_addr="127.0.0.1")

    def beating() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name.startswith("RendezvousKeepAliveTimer")]

    gang = membership.Membership(settings)
    before = beating()
    round_ = gang.next_round()
    assert (round_.rank, round_.world) == (0, 1)
    assert len(beating()) == len(before) + 1
    gang.leave()
    assert beating() == before
    gang.leave()  # a second leave, as close() after an earlier one, is harmless
    gang.close()


def _start_replica(config: Path, port: int, replica: int, tmp_path: Path) -> subprocess.Popen:
    """One in-place trainer, as its pod runs it, logging to r<replica>.log."""
    return launcher.start_agent(config, _settings(port, replica), f"r{replica}", tmp_path / f"r{replica}.log",
                                env=harness.child_env(), in_place=True)


def _regroups(run_dir: Path) -> list[dict]:
    return [e for e in steplog.read_events(run_dir) if e["event"] == "regroup"]


def _resizes(run_dir: Path) -> list[dict]:
    """The regroups but for missed joins (steplog.missed_join), which lose nothing."""
    return [r for r in _regroups(run_dir) if not steplog.missed_join(r)]


def _each_exits_cleanly(replicas: dict[int, subprocess.Popen], tmp_path: Path) -> None:
    for replica, process in replicas.items():
        assert process.wait(timeout=300) == 0, (tmp_path / f"r{replica}.log").read_text()[-3000:]


def _stop_all(replicas: dict[int, subprocess.Popen], store: subprocess.Popen) -> None:
    """Whatever a scenario left running, the store last."""
    for process in replicas.values():
        launcher.kill_process_tree(process.pid)
    launcher.kill_process_tree(store.pid)

@pytest.mark.slow
def test_join_leave_and_kill_keep_the_processes_and_the_run_exact(tmp_path: Path) -> None:
    steps = 60
    # A checkpoint at every step: every resize lands on a save, which the joiner must take part in.
    spec = harness.build_spec(steps=steps, interval_steps=1, min_replicas=1)
    config, store, port = harness.start_paced_gang(tmp_path, spec)
    uninterrupted = harness.start_uninterrupted(tmp_path, spec)  # meanwhile, on idle CPU
    run_dir = tmp_path / "run"
    replicas: dict[int, subprocess.Popen] = {}

    def start(replica: int) -> None:
        replicas[replica] = _start_replica(config, port, replica, tmp_path)

    def log(replica: int) -> str:
        return (tmp_path / f"r{replica}.log").read_text()[-3000:]

    try:
        start(0)
        start(1)
        harness.wait_for(lambda: steplog.last_step(run_dir) >= 8, 240, "8 steps at world size 2")
        joined_at = time.time()
        with harness.held_back(run_dir):
            start(2)
            harness.wait_for(lambda: steplog.first_step_after(run_dir, joined_at, 3), 240, "the join")
        at_three = steplog.last_step(run_dir)
        harness.wait_for(lambda: steplog.last_step(run_dir) >= at_three + 6, 240, "6 steps at 3")

        replicas[1].terminate()  # graceful: it leaves at the next step boundary
        assert replicas[1].wait(timeout=120) == train.LEFT_EXIT, log(1)
        harness.wait_for(lambda: len(_resizes(run_dir)) >= 2, 240, "the gang to re-form without r1")
        at_two = steplog.last_step(run_dir)
        harness.wait_for(lambda: steplog.last_step(run_dir) >= at_two + 4, 240, "4 steps at 2")

        endpoints = {json.loads(p.read_text())["replica"]: json.loads(p.read_text())
                     for p in (run_dir / "endpoints").glob("*.json")}
        victim = next(int(name.removeprefix("r")) for name, e in endpoints.items()
                      if e["rank"] == 0 and name != "r1")
        killed_step = steplog.last_step(run_dir)
        assert launcher.kill_process_tree(replicas[victim].pid)
        survivor = ({0, 2} - {victim}).pop()
        assert replicas[survivor].wait(timeout=300) == 0, log(survivor)
    finally:
        _stop_all(replicas, store)

    events = steplog.read_events(run_dir)
    # No worker process was ever restarted: one gang start, then three in-place regroups, and the
    # survivor's telemetry endpoint still names the process that was started first.
    assert [e["event"] for e in events].count("start") == 1
    regroups = _regroups(run_dir)
    resizes = _resizes(run_dir)
    assert [(r["reason"].split(":")[0], r["from_world_size"], r["world_size"]) for r in resizes] == [
        ("join", 2, 3), ("leave", 3, 2), ("peer-lost", 2, 1)]
    missed = [r for r in regroups if r not in resizes]
    assert len(missed) <= 10, f"the joiner missed {len(missed)} rounds"
    survivor_endpoint = json.loads((run_dir / "endpoints" / f"r{survivor}-0.json").read_text())
    assert survivor_endpoint["pid"] == replicas[survivor].pid and survivor_endpoint["world_size"] == 1
    # Join and leave lose nothing; the kill loses at most the step in flight, never back to a
    # checkpoint.
    attempts = [a for a in steplog.split_attempts(events) if a["steps"]]  # a missed join may log none
    for before, after in itertools.pairwise(attempts):
        last = before["steps"][-1]["step"]
        assert after["start"]["resumed_from"] == last or (
            after["start"]["reason"].startswith("peer-lost") and last - 1 <= after["start"]["resumed_from"])
    assert resizes[-1]["resumed_from"] >= killed_step
    history = steplog.effective_steps(events)
    assert sorted(history) == list(range(1, steps + 1))

    gaps = harness.loss_gaps_to_uninterrupted(tmp_path, spec, history, uninterrupted)
    worst = max(gaps.values())
    assert worst < LOSS_TOLERANCE, (f"first step off the uninterrupted run: "
                                     f"{min(s for s, gap in gaps.items() if gap >= LOSS_TOLERANCE)}; "
                                     f"regroups: {regroups}")
    print("\nregroup pauses: " + ", ".join(f"{r['reason']} {r['seconds']:.1f} s" for r in regroups)
          + f"; max |Δloss| vs uninterrupted: {worst:.2e}")


@pytest.mark.slow
def test_a_gang_re_forms_on_a_restarted_store_and_a_joiner_meets_it_there(tmp_path: Path) -> None:
    """The store restarted in place (its container, behind the same Service) comes back empty and
    never answers the gang's old connections. Before, the gang trained on blind, and a replica
    that joined the new store formed a second gang beside it, the two writing and pruning one
    checkpoint directory. Now the gang re-forms on the new store within a step, one process each,
    and the joiner joins that gang."""
    steps = 40
    spec = harness.build_spec(steps=steps, interval_steps=5, min_replicas=1)
    config, store, port = harness.start_paced_gang(tmp_path, spec)
    run_dir = tmp_path / "run"
    replicas: dict[int, subprocess.Popen] = {}

    def start(replica: int) -> None:
        replicas[replica] = _start_replica(config, port, replica, tmp_path)

    try:
        start(0)
        start(1)
        harness.wait_for(lambda: steplog.last_step(run_dir) >= 6, 240, "6 steps at world size 2")
        with harness.held_back(run_dir):
            launcher.kill_process_tree(store.pid)
            store, _ = launcher.start_store(tmp_path / "store-2", env=harness.child_env(), port=port)
            harness.wait_for(lambda: any(r["reason"] == "store reconnected" for r in _regroups(run_dir)),
                             120, "the gang re-formed on the new store")
            start(2)
            harness.wait_for(lambda: any(r["world_size"] == 3 for r in _regroups(run_dir)), 240,
                             "the joiner in the same gang")
        _each_exits_cleanly(replicas, tmp_path)
    finally:
        _stop_all(replicas, store)

    events = steplog.read_events(run_dir)
    assert [e["event"] for e in events].count("start") == 1, "one gang, started once"
    again = next(r for r in _regroups(run_dir) if r["reason"] == "store reconnected")
    assert (again["from_world_size"], again["world_size"]) == (2, 2)
    assert sorted(steplog.effective_steps(events)) == list(range(1, steps + 1)), "every step once"


@pytest.mark.slow
def test_a_plan_rejected_just_before_a_join_is_taken_by_the_gang_it_was_written_for(tmp_path: Path) -> None:
    """The operator writes a micro-batch plan for the gang it is growing, and the plan can reach
    the trainers a step before the joiner does: the old gang rejects it (one count per rank, and
    it has fewer ranks). The new gang must read it again, not keep the old gang's verdict."""
    from huorn.runtime import microbatches

    spec = harness.build_spec(steps=30, interval_steps=10, min_replicas=1)
    config, store, port = harness.start_paced_gang(tmp_path, spec)
    run_dir = tmp_path / "run"
    replicas: dict[int, subprocess.Popen] = {}

    def plans(event: str) -> list[dict]:
        return [e for e in steplog.read_events(run_dir) if e["event"] == event]

    try:
        replicas[0] = _start_replica(config, port, 0, tmp_path)
        harness.wait_for(lambda: steplog.last_step(run_dir) >= 3, 240, "3 steps at world size 1")
        with harness.held_back(run_dir):
            microbatches.write_control_file(run_dir, [4, 2], "written for the gang of two", version=1)
            harness.wait_for(lambda: plans("microbatch-plan-rejected"), 60, "the gang of one's rejection")
            replicas[1] = _start_replica(config, port, 1, tmp_path)
            harness.wait_for(lambda: any(r["world_size"] == 2 for r in _regroups(run_dir)), 240,
                             "the join")
            harness.wait_for(lambda: plans("microbatch-plan"), 60, "the plan taken by the gang of two")
        _each_exits_cleanly(replicas, tmp_path)
    finally:
        _stop_all(replicas, store)

    taken = plans("microbatch-plan")
    assert [p["counts"] for p in taken] == [[4, 2]]
    joined = next(r for r in _regroups(run_dir) if r["world_size"] == 2)
    assert taken[0]["step"] >= joined["resumed_from"]
    after = [e for e in steplog.read_events(run_dir) if e["event"] == "step" and e["step"] > taken[0]["step"]]
    assert after and all(e["microbatches"] == [4, 2] for e in after)


def test_a_regroup_after_the_store_restarted_joins_on_a_new_connection(tmp_path: Path) -> None:
    """Any regroup (a leave, a lost peer, a join) may be the first to meet a store that restarted
    in place: the seat's old connection never answers again, and the regroup must form its round
    on a new one rather than fail the replica."""
    from huorn.runtime import membership

    store, port = harness.start_store(tmp_path / "store-1")
    try:
        gang = membership.Membership(launcher.ElasticSettings(
            min_nodes=1, max_nodes=1, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="restarted",
            local_addr="127.0.0.1"))
        first = gang.next_round()
        assert (first.rank, first.world) == (0, 1)
        launcher.kill_process_tree(store.pid)
        store, _ = launcher.start_store(tmp_path / "store-2", env=harness.child_env(), port=port)
        seat, again = membership.join_next_round(gang, probe_timeout_s=5.0)
        assert seat is not gang, "formed on the broken connection"
        assert (again.rank, again.world) == (0, 1)
        again.store.set("written", b"on the new store")
        assert again.store.get("written") == b"on the new store"
        seat.close()
    finally:
        launcher.kill_process_tree(store.pid)


def test_a_save_a_lost_peer_cut_short_stays_due_for_the_next_round() -> None:
    """take_pending_save cleared the flag before the save: a peer lost inside it (gloo's
    RuntimeError) dropped the save, the final one too, and the survivor ended at an older
    checkpoint with exit 0 (a reviewer's run: step-20 newest of 30). Now it stays due, and the
    next round (share_state hands it on) takes it."""
    saved: list[tuple[int, str]] = []

    class Gang:
        pending_save: str | None = "final"
        failing = True

        def save(self, step: int, reason: str) -> None:
            if self.failing:
                raise RuntimeError("[gloo] Connection closed by peer")
            saved.append((step, reason))

    gang = Gang()
    with pytest.raises(RuntimeError):
        train.Trainer.take_pending_save(gang, 30)  # type: ignore[arg-type]
    assert gang.pending_save == "final" and saved == []
    gang.failing = False
    train.Trainer.take_pending_save(gang, 30)  # type: ignore[arg-type]
    assert gang.pending_save is None and saved == [(30, "final")]


@pytest.mark.slow
def test_a_joiner_that_becomes_rank_0_logs_the_regroup_and_keeps_the_gangs_checkpoint_clock(
        tmp_path: Path) -> None:
    """c10d numbers a round's ranks by address: r0 (127.0.0.2) joining r1 (127.0.0.3) is rank 0
    of the new round, and only rank 0 logs and times checkpoints. The joiner logged `start`
    alone (no regroup: the members are not rank 0) and started the checkpoint interval over at
    the join (a reviewer's run: 16.4 s between checkpoints of a 10 s interval)."""
    interval = 15.0
    spec = harness.build_spec(steps=1000, interval_steps=None, min_replicas=1)
    spec["checkpoint"]["interval"] = f"{interval:g}s"
    config, store, port = harness.start_paced_gang(tmp_path, spec)
    run_dir = tmp_path / "run"
    replicas: dict[int, subprocess.Popen] = {}

    def checkpoints() -> list[float]:
        return [e["time"] for e in steplog.read_events(run_dir) if e["event"] == "checkpoint"]

    def at_two() -> list[dict]:
        return [e for e in steplog.read_events(run_dir) if e["event"] == "step" and e["world_size"] == 2]

    try:
        replicas[1] = _start_replica(config, port, 1, tmp_path)
        harness.wait_for(lambda: len(checkpoints()) >= 1, 240, "r1's first checkpoint")
        time.sleep(3)  # the join well inside the interval: its clock must not start over there
        replicas[0] = _start_replica(config, port, 0, tmp_path)
        harness.wait_for(at_two, 240, "steps at world size 2")
        first_at_two = at_two()[0]["time"]
        harness.wait_for(lambda: any(t > first_at_two for t in checkpoints()), 240,
                         "a checkpoint after the join")
    finally:
        _stop_all(replicas, store)
    joins = [r for r in _regroups(run_dir) if r["world_size"] == 2]
    assert [(r["reason"], r["from_world_size"]) for r in joins] == [("join", 1)], "the join, logged once"
    before = max(t for t in checkpoints() if t < first_at_two)
    after = min(t for t in checkpoints() if t > first_at_two)
    # due at the gang's last checkpoint + the interval (or at once, if that passed during the
    # join), not at the join + the interval; 2.5 s for the step in flight and the save
    assert after - before < max(interval, first_at_two - before) + 2.5, (before, first_at_two, after)


@pytest.mark.slow
def test_a_joiner_trains_the_gangs_goodput_batch(tmp_path: Path) -> None:
    """batchRule goodput: a gang of one takes the allocator's batch of 8 (globalBatch 4), then a
    replica joins in place. The joiner must plan its steps from the gang's batch: it planned
    them at start, for globalBatch, and trained 2 micro-batches where the gang split 4 (a
    micro-batch never trained, another progress count), reached the budget later than rank 0,
    and the gang hung on its last collective until the 120 s timeout."""
    from huorn.runtime import batch_control

    spec = harness.build_spec(steps=40, interval_steps=None, global_batch=4, micro_batch=2, min_replicas=1,
                              max_replicas=3, batchRule="goodput", warmupSteps=0, schedule="constant")
    config, store, port = harness.start_paced_gang(tmp_path, spec)
    run_dir = tmp_path / "run"
    replicas: dict[int, subprocess.Popen] = {}
    try:
        replicas[0] = _start_replica(config, port, 0, tmp_path)
        harness.wait_for(lambda: steplog.last_step(run_dir) >= 2, 240, "2 steps at globalBatch")
        (run_dir / batch_control.CONTROL_FILE).write_text(
            json.dumps({"globalBatch": 8, "reason": "test", "version": 1}))
        harness.wait_for(lambda: steplog.last_step(run_dir) >= 6, 240, "steps at the batch of 8")
        joined = time.time()
        with harness.held_back(run_dir):
            replicas[1] = _start_replica(config, port, 1, tmp_path)
            harness.wait_for(lambda: steplog.first_step_after(run_dir, joined, 2), 240, "the join")
        _each_exits_cleanly(replicas, tmp_path)
    finally:
        _stop_all(replicas, store)
    events = steplog.read_events(run_dir)
    assert [r["reason"] for r in _regroups(run_dir)] == ["join"]
    join = _regroups(run_dir)[0]
    assert (join["world_size"], join["global_batch"]) == (2, 8)
    after = [e for e in events if e["event"] == "step" and e["step"] > join["resumed_from"]]
    assert after and {(e["world_size"], e["global_batch"]) for e in after} == {(2, 8)}
    for replica in (0, 1):
        log = (tmp_path / f"r{replica}.log").read_text()
        assert "collective failed" not in log, log[-2000:]
