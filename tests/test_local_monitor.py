"""The shared monitor's decisions and the local backend's command lines, files and report,
checked without starting processes (the scenario tests in test_local_run.py start them)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import job_support
import pytest
import yaml

from huorn import graph
from huorn.backends import monitor
from huorn.backends.local import commands, report
from huorn.graph import managers, model, mutate
from huorn.runtime import config as run_config

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def build_graph(resize: str | None = None) -> model.Graph:
    """The quickstart's graph; `resize` sets spec.elasticity.resize (default: the manifest's)."""
    from huorn.api import manifests

    manifest = yaml.safe_load(QUICKSTART.read_text())
    if resize is not None:
        manifest["spec"]["elasticity"]["resize"] = resize
    return graph.compile(manifests.load_manifest(manifest))


def observe(*steps: int, world: int = 1, **extra: object) -> monitor.Observation:
    records = [
        {"event": "step", "step": s, "loss": 1.0, "world_size": world, "time": float(s)} for s in steps
    ]
    return monitor.Observation(time=0.0, steps=records, **extra)  # type: ignore[arg-type]


def test_scheduled_resize_fires_once_when_step_is_reached() -> None:
    g = build_graph()
    policy = monitor.ScheduledResize("trainer", [(10, 2), (30, 1)])
    assert policy.decide(g, observe(1, 2, 3)) == []
    (event,) = policy.decide(g, observe(9, 10, 11))
    assert event.type == managers.SCHEDULER_DECISION and event.data["replicas"] == 2
    assert "--scale-at 10:2" in event.data["reason"]
    assert policy.decide(g, observe(12)) == []
    # Both remaining points passed in one observation: only the latest one matters.
    policy = monitor.ScheduledResize("trainer", [(10, 2), (20, 1)])
    assert [e.data["replicas"] for e in policy.decide(g, observe(25))] == [1]


def test_failed_instances_become_events_only_while_in_graph() -> None:
    g = build_graph()
    states = {
        "trainer-0": monitor.InstanceState("trainer-0", "trainer", alive=True, failed=True, reason="SIGKILL"),
        "trainer-7": monitor.InstanceState("trainer-7", "trainer", alive=False, failed=True, reason="old"),
    }
    events = monitor.build_failure_events(g, monitor.Observation(time=0.0, instances=states))
    assert [(e.type, e.data["instance"]) for e in events] == [(managers.INSTANCE_FAILED, "trainer-0")]
    managers.build_default_managers().dispatch(g, events[0])
    assert [i.name for i in g.vertex("trainer").instances] == ["trainer-0-g1"]
    # The replaced name is no longer in the graph, so a repeated report does nothing.
    assert monitor.build_failure_events(g, monitor.Observation(time=0.0, instances=states)) == []


def test_checkpoint_fires_only_checkpoint_edges() -> None:
    g = build_graph()
    seen = monitor.Observation(time=0.0, checkpoint={"vertex": "trainer", "step": 25, "path": "/c"})
    assert monitor.build_checkpoint_events(g, seen) == []
    g.vertices["eval"] = model.Vertex("eval", "eval", 1, 1, mode=model.ExecutionMode.ON_DEMAND, active=False)
    g.edges.append(model.Edge("trainer", "eval", "checkpoint", transport=model.Transport.CHECKPOINT_FILE))
    (event,) = monitor.build_checkpoint_events(g, seen)
    assert event.target == "trainer->eval:checkpoint" and event.data["step"] == 25


def test_run_config_is_accepted_by_the_runtime(tmp_path: Path) -> None:
    g = build_graph()
    mutate.set_param(g, "trainer", "pipelineSchedule", "kfkb", reason="planner")
    mutate.set_param(g, "trainer", "k", 3, reason="planner")
    payload = commands.build_run_config("quickstart", g.vertex("trainer"), tmp_path, tmp_path / "ck", 7)
    path = commands.write_json_atomically(tmp_path / "config.json", payload)
    cfg = run_config.load_run_config(path)
    assert cfg.total_steps() == 7 and cfg.checkpoint_root == tmp_path / "ck"
    assert cfg.spec.parallelism.k == 3 and cfg.spec.model.kv_sharing.value == "fusedkv"
    assert cfg.spec.elasticity.max_replicas == 2


@pytest.mark.parametrize("resize", ["restart", "inPlace"])
def test_agent_command_follows_the_measured_recipe(tmp_path: Path, resize: str) -> None:
    trainer = build_graph(resize).vertex("trainer")
    argv = commands.build_agent_command(
        tmp_path / "c.json",
        trainer,
        "127.0.0.1:29400",
        "quickstart",
        commands.replica_address(1),
        {"keep_alive_interval": 1},
    )
    assert "--nnodes=1:2" in argv and "--rdzv-endpoint=127.0.0.1:29400" in argv
    assert "--local-addr=127.0.0.3" in argv
    conf = next(a for a in argv if a.startswith("--rdzv-conf="))
    assert "is_host=false" in conf and "keep_alive_interval=1" in conf
    if resize == "restart":  # a torchrun agent with the trainer as its workers
        assert argv[1:3] == ["-m", "huorn.runtime.agent"]
        assert argv[-3:] == ["huorn.runtime.train", "--config", str(tmp_path / "c.json")]
    else:  # the trainer itself, in the same rendezvous
        assert argv[1:6] == ["-m", "huorn.runtime.train", "--config", str(tmp_path / "c.json"), "--in-place"]
    env = commands.build_agent_env("trainer-1")
    assert env["HUORN_REPLICA"] == "trainer-1" and env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert commands.replica_address(0) != commands.replica_address(1)


def test_step_summary_finds_gaps_and_recomputed_steps() -> None:
    records = [{"step": s, "world_size": w} for s, w in [(1, 1), (2, 1), (3, 2), (2, 2), (3, 2), (5, 2)]]
    summary = report.summarise_steps(records)
    assert summary.last == 5 and summary.missing == [4] and summary.repeated == 2
    assert summary.world_sizes == [1, 2]


def test_report_is_written_from_run_files(tmp_path: Path) -> None:
    g = build_graph()
    g.clock = iter([100.5, 200.5]).__next__
    mutate.resize(g, "trainer", 2, reason="scale up for the test")
    records = [{"event": "start", "time": 99.0}]
    records += [
        {
            "event": "step",
            "step": s,
            "loss": 5.0 - s / 10,
            "world_size": 1,
            "tokens_per_second": 1000.0,
            "time": 90.0 + s,
        }
        for s in range(1, 11)
    ]
    records += [{"event": "start", "time": 110.0}]
    records += [
        {
            "event": "step",
            "step": s,
            "loss": 5.0 - s / 10,
            "world_size": 2,
            "tokens_per_second": 2000.0,
            "time": 100.0 + s,
        }
        for s in range(11, 15)
    ]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    path = report.write_report(tmp_path, g, "finished")
    text = path.read_text()
    assert "Outcome: **finished**" in text and "no gaps" in text
    assert "scale up for the test" in text and "| 2 | 4 | 2000 |" in text
    assert "| 10.5 |" in text  # from the mutation at 100.5 to the first step after the restart at 110
    for picture in ("loss.png", "throughput.png", "graph.png"):
        assert (tmp_path / picture).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "graph.json").read_text())["summary"]["mutations"] == 1


def test_the_report_of_a_pipelined_run_counts_replicas_not_ranks(tmp_path: Path) -> None:
    """A 2-stage replica runs 2 ranks and the step log's `world_size` counts the gang's ranks; the
    report showed a run at 1 then 2 replicas as "Replicas over the run: 2, 4" and filed its
    throughput under 2 and 4 replicas."""
    manifest = job_support.tiny_job(replicas=1, steps=20, micro_batch=2, parallelism={"pipelineStages": 2})
    manifest["spec"]["elasticity"].update(maxReplicas=2)
    records = [{"event": "step", "step": s, "loss": 1.0, "world_size": ranks, "tokens_per_second": tps,
                "time": 100.0 + s} for ranks, tps, steps in ((2, 1000.0, range(1, 11)),
                                                             (4, 1800.0, range(11, 21))) for s in steps]
    (tmp_path / commands.STEPS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    g = graph.compile(manifest)
    text = report.write_report(tmp_path, g, "finished").read_text()
    assert "- Replicas over the run (in order): 1, 2" in text
    assert "| 1 | 10 | 1000 |" in text and "| 2 | 10 | 1800 |" in text and "| 4 |" not in text
    steps = report.replica_steps(report.read_records(tmp_path), g)  # what `huorn run --json` says
    assert report.summarise_steps(steps).world_sizes == [1, 2]


def test_recovery_counts_an_in_place_regroup_as_the_gang_stepping_again() -> None:
    """An in-place resize logs `regroup`, not a new `start`: its recovery ends at the first step
    after the regroup, not at some later restart."""
    g = build_graph()
    g.clock = iter([100.0]).__next__
    m = mutate.resize(g, "trainer", 2, reason="grow")
    assert m is not None
    records = [{"event": "step", "step": 10, "time": 101.0}, {"event": "regroup", "time": 104.0},
               {"event": "step", "step": 11, "time": 104.5}]
    assert report.recovery_seconds(records, [m]) == {m.version: 4.5}


GROWING_RECORDS = [
    {
        "event": "step",
        "step": s,
        "world_size": 1,
        "step_seconds": 0.8 + 0.01 * (s % 3),
        "loss": 3.0,
        "time": float(s),
        "gradient_noise_scale": 40.0,
    }
    for s in range(1, 9)
]


def test_goodput_policy_asks_the_allocator_and_respects_slots() -> None:
    from huorn.backends import goodput

    records = GROWING_RECORDS
    grow = goodput.GoodputPolicy("quickstart", "local", slots=2, global_batch=16.0)
    (event,) = grow.decide(build_graph(), observe_records(records))
    assert event.data["replicas"] == 2 and event.data["reason"].startswith("goodput allocator: grow")
    # one configuration, at the median of its steps after the first two (warm-up)
    assert [(s.replicas, s.local_batch) for s in grow.perf.samples] == [(1, 16.0)]
    assert grow.noise_scale == 40.0
    # One slot on this machine: the allocator cannot grow the job, so no event.
    tight = goodput.GoodputPolicy("quickstart", "local", slots=1, global_batch=16.0)
    assert tight.decide(build_graph(), observe_records(records)) == []
    assert tight.last_decision is not None and tight.last_decision.replicas == 1


def test_goodput_policy_runs_huorns_allocator_and_does_not_grow_a_job_about_to_finish() -> None:
    """The local backend and the operator decide with the allocator the simulator's Huorn runs
    (allocator.HUORN, its greedy pricing a resize in place at the in-place share: HUORN_RUNTIME).
    Given the job's steps, a restart that the remaining time cannot pay back
    is not taken: the same telemetry that grows a job at step 8 of 1,000 leaves it alone at step
    8 of 10."""
    from huorn.backends import goodput
    from huorn.scheduler import allocator

    records = GROWING_RECORDS
    long = goodput.GoodputPolicy("quickstart", "local", slots=2, global_batch=16.0, total_steps=1000)
    assert long.decider.config == dataclasses.replace(allocator.HUORN, gpus_per_node=1 << 10,
                                                      greedy_in_place=True)
    (event,) = long.decide(build_graph(), observe_records(records))
    assert event.data["replicas"] == 2
    ending = goodput.GoodputPolicy("quickstart", "local", slots=2, global_batch=16.0, total_steps=10,
                                   restart_seconds=20.0)
    assert ending.decide(build_graph(), observe_records(records)) == []
    assert ending.last_decision is not None and ending.last_decision.replicas == 1


def test_a_resize_in_place_is_priced_below_a_restart_so_a_short_job_still_grows() -> None:
    """The quickstart on a quiet host: steps of 0.137 s at one replica, 300 in all (41 s of work).
    A second replica saves about 20 s, which does not pay a 20 s restart from the checkpoint, but
    does pay an in-place resize (allocator.IN_PLACE_RESIZE_SHARE of it, as the simulator prices
    it). Before, the policy priced every resize as a restart and the main demo stayed at one
    replica on a fast host (one run in five here)."""
    from huorn.backends import goodput
    from huorn.scheduler import allocator

    quick = [{"step": s, "world_size": 1, "step_seconds": 0.137} for s in range(1, 6)]
    restart = goodput.GoodputPolicy("quickstart", "local", slots=2, global_batch=16.0, total_steps=300)
    assert restart.decide(build_graph(), observe_records(quick)) == []
    assert restart.last_decision is not None and restart.last_decision.replicas == 1
    in_place = goodput.GoodputPolicy("quickstart", "local", slots=2, global_batch=16.0, total_steps=300,
                                     in_place=True)
    (event,) = in_place.decide(build_graph(), observe_records(quick))
    assert event.data["replicas"] == 2
    assert 0 < allocator.IN_PLACE_RESIZE_SHARE < 1


@pytest.mark.parametrize(("ago", "grows"), [(60.0, False), (1000.0, True)])
def test_no_regrowth_within_the_cooldown_of_a_shrink_the_graph_records(ago: float, grows: bool) -> None:
    """The allocator's flap guard (no regrowth within cooldown_seconds of a shrink), fed from the
    graph's log: the shrink may be anyone's (a reclaim here), and a policy built after it (a
    restarted operator) must still see it. Before, the policy passed no direction, so the guard
    never applied outside the simulator: the telemetry that grows this job grew it 60 s after a
    reclaim had shrunk it."""
    import time

    from huorn.backends import goodput
    from huorn.scheduler import allocator

    g = build_graph()
    g.clock = lambda: time.time() - ago
    mutate.resize(g, "trainer", 2, reason="goodput allocator: grow to 2")
    mutate.resize(g, "trainer", 1, reason="reclaim by inference: shrink to 1")
    assert goodput.last_resize_of(g, "trainer") == (pytest.approx(time.time() - ago, abs=5), -1)
    assert 60.0 < allocator.HUORN.cooldown_seconds < 1000.0
    policy = goodput.GoodputPolicy("quickstart", "local", slots=2, global_batch=16.0)
    events = policy.decide(g, observe_records(GROWING_RECORDS))
    assert [e.data["replicas"] for e in events] == ([2] if grows else [])


def test_goodput_policy_waits_for_samples_and_skips_restart_outliers() -> None:
    from huorn.backends import goodput

    policy = goodput.GoodputPolicy("quickstart", "local", slots=2, global_batch=16.0)
    few = [{"step": s, "world_size": 1, "step_seconds": 0.5} for s in (1, 2)]
    assert policy.decide(build_graph(), observe_records(few)) == []
    assert policy.perf.samples == []  # the first two steps of a configuration pay its warm-up
    policy.learn([{"step": s, "world_size": 1, "step_seconds": 0.5} for s in (3, 4)])
    policy.learn([{"step": 5, "world_size": 1, "step_seconds": 9.0}])  # the warm-up step after a restart
    assert [s.step_time for s in policy.perf.samples] == [0.5]  # the median of the configuration's steps


def observe_records(records: list[dict]) -> monitor.Observation:
    return monitor.Observation(time=0.0, steps=records)


def test_relative_spec_paths_are_made_absolute_against_where_huorn_run_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`huorn run` checks a relative source path from its own directory, but trainers and eval
    processes run in the run directory: the runtime then refused the same path."""
    from huorn.api import manifests
    from huorn.runtime.data import sampler

    corpus = tmp_path / "project" / "data" / "mine"
    corpus.mkdir(parents=True)
    for split in ("train.bin", "val.bin"):
        (corpus / split).write_bytes(bytes(range(256)) * 4)
    manifest = yaml.safe_load(QUICKSTART.read_text())
    manifest["spec"]["data"]["sources"] = [{"name": "general"}, {"name": "mine", "path": "data/mine"}]
    manifest["spec"]["task"] = {"kind": "cpt", "initCheckpoint": "../weights"}
    trainer = graph.compile(manifests.load_manifest(manifest)).vertex("trainer")
    run_dir = tmp_path / "project" / "runs" / "quickstart"
    run_dir.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "project")  # where huorn run was started, and checked the sources
    config = commands.build_run_config("quickstart", trainer, run_dir, run_dir / "ck", 7)
    sources = [(s["name"], s.get("path")) for s in config["spec"]["data"]["sources"]]
    assert sources == [("general", None), ("mine", str(corpus))]
    assert config["spec"]["task"]["initCheckpoint"] == str(tmp_path / "project" / "../weights")
    monkeypatch.chdir(run_dir)  # where the runtime runs: the same check passes there too
    sampler.check_sources(sources)
    assert trainer.params["spec"]["data"]["sources"][1]["path"] == "data/mine"  # the graph keeps its spec
    distill = {"task": {"kind": "distill", "teacher": {"checkpoint": "teacher/ck", "temperature": 2.0}}}
    assert commands.absolute_paths(distill, tmp_path)["task"]["teacher"] == {
        "checkpoint": str(tmp_path / "teacher" / "ck"), "temperature": 2.0}
    assert commands.absolute_paths(distill, tmp_path)["task"] is not distill["task"]
    absolute = {"task": {"kind": "cpt", "initCheckpoint": "/ck"}}
    assert commands.absolute_paths(absolute, tmp_path) == absolute
