"""The simulator's fixes from the review of 2026-12-06: the cluster split the loads are sized for,
the GPU-hours a policy loses, the work series goodput is read from, and what bad input is told."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import sim_support
from typer.testing import CliRunner

from huorn.cli.main import app
from huorn.sim import engine, inference, policies, run, shared_data, workload

DATA = shared_data.shared_data_dir()
TRACE = DATA / "openb_pod_list_default.csv"
NODES = DATA / "openb_node_list_gpu_node.csv"
QPS = DATA / "genai_qps.csv"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared OpenB trace not present")
POD_HEADER = "name,num_gpu,gpu_milli,qos,creation_time,deletion_time\n"


def _simulate(*args: str, output: Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["simulate", "--policy", "fifo", *args, "--output", str(output)])
    return result.exit_code, result.stderr + result.stdout


# ---------------------------------------------------------------- the split the loads are sized for

def test_both_loads_are_sized_for_the_gpus_each_cluster_really_holds() -> None:
    """At 100 GPUs a 25 % share asks 25 GPUs and whole nodes give inference 32: the inference load
    was sized for 25 and the training load compressed for 75 GPUs while 68 trained."""
    config = engine.SimConfig(gpus=100, seed=0)
    sim = run.build_simulation(TRACE, NODES, QPS, "huorn", config)
    assert sim.infer_gpus > round(100 * config.inference_share), "the case must overshoot the share"
    assert sim.load.gpus == sim.infer_gpus
    assert sim.infer_gpus + sim.train_gpus == 100
    jobs = workload.load_jobs(TRACE, 100, sim.train_gpus, config.load, config.seed)
    assert {js.job.name: js.job.arrival for js in sim.jobs} == {
        j.name: j.arrival for j in jobs if j.name in sim.by_name}
    # and a load sized for another cluster is refused, not silently run on this one
    nodes = workload.load_nodes(NODES, 100, 0)
    wrong = inference.InferenceLoad(QPS, 25, 0)
    with pytest.raises(ValueError, match="sized for 25 GPUs"):
        engine.Simulation(jobs, nodes, wrong, policies.POLICIES["huorn"], config)


def test_a_share_the_split_overrides_is_noted(tmp_path: Path) -> None:
    """The 8-GPU least silently overrode --inference-share 0.01 at 16 GPUs (inference 50 %)."""
    code, err = _simulate("--gpus", "16", "--inference-share", "0.01", output=tmp_path)
    assert code == 0, err
    assert "note: --inference-share 0.01 asks 0 of 16 GPUs" in err and "inference gets 8 GPUs (50 %)" in err
    assert "\ngpu_hours_lost_total " in err  # every cause of GPU-hours lost, not rolled-back work alone


@pytest.mark.parametrize("args", [("--gpus", "8"), ("--gpus", "16", "--inference-share", "0.99")])
def test_a_split_that_leaves_nothing_to_train_is_refused_naming_the_flags(tmp_path: Path,
                                                                         args: tuple[str, ...]) -> None:
    """It leaked numpy's divide-by-zero warning and advised more GPUs or another seed."""
    code, err = _simulate(*args, output=tmp_path)
    assert code == 2
    assert err.startswith(f"error: --gpus {args[1]} with --inference-share ")
    assert "leaving none to train" in err
    assert "RuntimeWarning" not in err


def test_a_negative_seed_is_named(tmp_path: Path) -> None:
    code, err = _simulate("--seed", "-1", output=tmp_path)
    assert code == 2 and err.startswith("error: --seed must be >= 0, got -1"), err


def test_the_node_list_is_read_before_the_load_is_judged(tmp_path: Path) -> None:
    """--gpus 100000 printed a note on the load before the node list's real error."""
    code, err = _simulate("--gpus", "100000", output=tmp_path)
    assert code == 2 and err.startswith(f"error: {NODES}: holds "), err


# ---------------------------------------------------------------- trace errors

def test_a_trace_whose_training_pods_sampling_keeps_none_says_so(tmp_path: Path) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text(POD_HEADER + "p1,1,1000,BE,0,100\n")
    code, err = _simulate("--trace", str(pods), "--gpus", "16", output=tmp_path / "o")
    assert code == 2
    assert f"error: {pods}: 1 training pod(s), none kept by sampling at --gpus 16" in err, err
    assert "use --gpus 1024 or a larger trace" in err


def test_repeated_pod_and_node_names_are_refused_with_file_line_and_column(tmp_path: Path) -> None:
    pods = tmp_path / "pods.csv"
    pods.write_text(POD_HEADER + "p0,1,1000,LS,0,50\np1,1,1000,BE,0,100\np1,1,1000,BE,10,300\n")
    with pytest.raises(workload.TraceError) as caught:
        workload.load_jobs(pods, 1024, 768, 0.8, 0)
    assert str(caught.value) == f"{pods}:4: column 'name' value 'p1' repeats line 3; names must be unique"
    nodes = tmp_path / "nodes.csv"
    nodes.write_text("sn,gpu\nn0,8\nn1,8\nn0,8\n")
    with pytest.raises(workload.TraceError) as caught:
        workload.load_nodes(nodes, 16, 0)
    assert str(caught.value) == f"{nodes}:4: column 'sn' value 'n0' repeats line 2; names must be unique"


# ---------------------------------------------------------------- GPU-hours lost, by cause

def test_a_pause_cut_short_by_another_restart_counts_only_the_time_it_held() -> None:
    """Restart pauses are GPU-hours without progress; gpu_hours_lost counted only rolled-back
    work, so Huorn, whose victims checkpoint, always showed 0."""
    from huorn.sim import state

    fam = workload.FAMILIES["cnn"]
    job = workload.TrainingJob("j", 0.0, 1, fam, fam.params, fam.noise_scale, 1, 8, 1, 1e9, 3600.0)
    js = state.JobState(job)
    js.status = "running"
    js.configure(2, 1, 64.0, 0.0, restart=True)  # first start: 2 GPUs paused for 40 s
    js.sync(10.0)
    js.configure(4, 1, 32.0, 10.0, restart=True)  # cut short after 10 s: 4 GPUs paused for 40 s
    js.sync(1000.0)
    assert js.start_gpu_seconds == pytest.approx(2 * 10.0)
    assert js.restart_gpu_seconds == pytest.approx(4 * fam.restart_seconds)
    assert js.gpu_seconds == pytest.approx(2 * 10.0 + 4 * 990.0)


def test_the_report_counts_restart_pauses_and_reclaim_holds_beside_rolled_back_work() -> None:
    config = engine.SimConfig(gpus=64, seed=1, load=1.2)
    results, sims = run.run_policies(TRACE, NODES, QPS, ["kueue", "huorn"], config)
    for name, r in results.items():
        parts = ("gpu_hours_lost", "gpu_hours_starting", "gpu_hours_restarting", "gpu_hours_reclaim_held")
        assert r["gpu_hours_lost_total"] == pytest.approx(sum(r[p] for p in parts))
        assert r["gpu_hours_starting"] > 0 and r["gpu_hours_restarting"] > 0, name
        # a pause holds GPUs: no job pauses longer than it holds them
        assert all(js.start_gpu_seconds + js.restart_gpu_seconds <= js.gpu_seconds + 1e-6
                   for js in sims[name].jobs)
    huorn = results["huorn"]
    assert huorn["preemptions"] > 0 and huorn["gpu_hours_reclaim_held"] > 0
    assert huorn["gpu_hours_lost_total"] > huorn["gpu_hours_lost"]
    assert results["kueue"]["gpu_hours_reclaim_held"] == 0  # its victims exit at once


# ---------------------------------------------------------------- the work series goodput reads

@pytest.mark.parametrize("seed", [0, 1])
def test_fifos_work_series_never_falls_and_ends_at_the_whole_trace(seed: int) -> None:
    """A job ending exactly on a tick was counted twice in that tick's sample (done, and still
    live), so FIFO's work series rose and fell back (128 GPUs, seed 1, t = 41,520 s); and no
    sample came after the last tick. FIFO never loses work, so its series can only rise."""
    sim = run.build_simulation(TRACE, NODES, QPS, "fifo", engine.SimConfig(gpus=128, seed=seed))
    sim.run()
    work = [w for _, w in sim.totals.series_work]
    assert all(b >= a - 1e-6 for a, b in itertools.pairwise(work))
    assert any(js.finished % sim.config.tick_seconds == 0 for js in sim.jobs), "a job must end on a tick"
    total = sum(js.job.requested_gpus * js.job.duration for js in sim.jobs)
    assert sim.totals.series_work[-1] == (max(js.finished for js in sim.jobs), pytest.approx(total))


# ---------------------------------------------------------------- a reclaim's victim

def test_a_reclaims_shrink_keeps_the_global_batch_at_least_the_base_batch(monkeypatch) -> None:
    """The staying replicas kept their local batch, so the global batch fell below the base batch
    (statistical efficiency above 1, which flatters) until the next cycle picked it again."""
    from huorn.scheduler import loaning

    sim, js = sim_support.split_borrower()
    base = js.job.family.base_batch
    js.local_batch = max(1.0, base / js.replicas)  # the allocator's default: the base batch in all
    gpus = js.on_lender * js.job.family.gpus_per_replica
    shrink = loaning.Reclaim(js.job.name, "shrink", js.on_lender, gpus, sim.now, sim.now + 30, True, 0.0, "t")
    monkeypatch.setattr(loaning, "plan_reclaim", lambda *_: [shrink])
    policies._huorn_reclaim(sim, 1, "test")
    assert js.status == "running" and js.on_lender == 0
    assert js.replicas * js.local_batch >= base - 1e-9


def test_a_victims_returned_gpus_are_offered_to_pending_jobs_when_they_come_back(monkeypatch) -> None:
    """The engine freed a victim's held GPUs without marking the schedule as needing a run: they
    idled until something else changed (Huorn runs its full cycle every fifth tick)."""
    sim = run.build_simulation(TRACE, NODES, QPS, "huorn", engine.SimConfig(gpus=64, seed=1, load=1.2))
    returned: list[float] = []  # when a victim's GPUs came back while jobs were pending
    offered: set[float] = set()  # when the policy was asked to place pending jobs
    forget, schedule, admit = sim.snap.forget, policies.schedule, policies.admit

    def pending() -> bool:
        return any(js.status == "pending" for js in sim.active())

    def record_forget(name: str) -> None:
        if name.startswith("returning:") and pending():
            returned.append(sim.now)
        forget(name)

    def record(call):  # type: ignore[no-untyped-def]
        def wrapped(s: engine.Simulation) -> None:
            if pending():
                offered.add(s.now)
            call(s)
        return wrapped

    monkeypatch.setattr(sim.snap, "forget", record_forget)
    monkeypatch.setattr(policies, "schedule", record(schedule))
    monkeypatch.setattr(policies, "admit", record(admit))
    sim.run()
    assert len(returned) >= 3
    late = [t for t in returned if t not in offered]
    assert not late, f"{len(late)} of {len(returned)} returns left pending jobs waiting, e.g. at {late[:3]}"
