"""Simulator inputs: the trace rules of huorn.sim.workload on small hand-made CSVs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from huorn.sim import inference, policies, shared_data, state, workload

QPS = shared_data.shared_data_dir() / "genai_qps.csv"

HEADER = ("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
          "creation_time,deletion_time,scheduled_time\n")


def write_pods(path: Path, rows: list[str]) -> Path:
    path.write_text(HEADER + "".join(r + "\n" for r in rows))
    return path


def test_training_pods_are_the_gpu_be_and_burstable_ones(tmp_path: Path) -> None:
    pods = write_pods(tmp_path / "p.csv", [
        "a,1000,1,1,1000,,BE,Running,0,100,0",
        "b,1000,1,1,460,,Burstable,Failed,10,50,10",  # shared GPU: one whole GPU
        "c,1000,1,0,0,,BE,Running,20,90,20",  # no GPU: left out
        "d,1000,1,1,1000,,LS,Running,30,900,30",  # a service: the inference cluster's part
        "e,1000,1,8,1000,,BE,Running,40,4000,40",
    ])
    jobs = workload.load_jobs(pods, 1024, 768, 0.8, seed=0)
    assert [j.name for j in jobs] == ["a", "b", "e"]
    assert [j.requested_gpus for j in jobs] == [1, 1, 8]
    assert [j.duration for j in jobs] == [100, 40, 3960]
    assert jobs[2].family.name == "llm" and jobs[2].requested_replicas == 1
    assert all(j.min_replicas == 1 and j.max_replicas >= j.requested_replicas for j in jobs)


def test_the_elastic_range_factor_widens_every_range_and_its_cap(tmp_path: Path) -> None:
    """The rule: up to 8× the requested replicas (4× for LLMs), at most 64; the sensitivity
    study multiplies both (benchmarks/scheduling_elastic_range.py)."""
    pods = write_pods(tmp_path / "p.csv", [
        "a,1000,1,1,1000,,BE,Running,0,100,0",
        "b,1000,1,16,1000,,BE,Running,10,500,10",  # 16 GPUs: 2 LLM replicas of 8
        "c,1000,1,160,1000,,BE,Running,20,500,20",  # 20 LLM replicas: 4 × 20 = 80 > 64, capped
    ])
    rule = workload.load_jobs(pods, 1024, 768, 0.8, seed=0)
    wide = workload.load_jobs(pods, 1024, 768, 0.8, seed=0, elastic_range=4)
    scale = {j.name: j.family.max_scale for j in rule}
    assert [j.max_replicas for j in rule] == [scale["a"], 2 * scale["b"], 64]
    assert [j.max_replicas for j in wide] == [4 * scale["a"], 8 * scale["b"], 256]
    assert [j.work for j in wide] == [j.work for j in rule]  # the jobs are the same otherwise
    with pytest.raises(ValueError, match="elastic_range"):
        workload.load_jobs(pods, 1024, 768, 0.8, seed=0, elastic_range=0)


def test_the_restart_cost_factor_scales_every_restart_and_nothing_else(tmp_path: Path) -> None:
    """The study of what restarts cost (benchmarks/scheduling_restart_cost.py) scales the
    catalogue's restart times; the jobs and their curves stay the same."""
    pods = write_pods(tmp_path / "p.csv", [
        "a,1000,1,1,1000,,BE,Running,0,100,0",
        "b,1000,1,16,1000,,BE,Running,10,500,10",
    ])
    rule = workload.load_jobs(pods, 1024, 768, 0.8, seed=0)
    half = workload.load_jobs(pods, 1024, 768, 0.8, seed=0, restart_cost=0.5)
    assert [j.family.restart_seconds for j in half] == [j.family.restart_seconds / 2 for j in rule]
    assert all(j.family.restart_seconds > 0 for j in rule)
    same = [(j.work, j.truth, j.max_replicas) for j in rule]
    assert [(j.work, j.truth, j.max_replicas) for j in half] == same
    assert workload.FAMILIES[rule[0].family.name].restart_seconds == rule[0].family.restart_seconds
    with pytest.raises(ValueError, match="restart_cost"):
        workload.load_jobs(pods, 1024, 768, 0.8, seed=0, restart_cost=-1)


def test_declared_work_is_exact_by_default_and_wrong_or_missing_as_the_study_asks() -> None:
    """The study of wrong declarations (benchmarks/scheduling_work_estimate.py): a log-normal
    factor of the asked σ, the asked share undeclared, the same for every policy and run."""
    names = [f"job-{i}" for i in range(4000)]
    assert {workload.declared_factor(n, 0, 0.0, 0.0) for n in names} == {1.0}
    factors = np.array([workload.declared_factor(n, 0, 0.5, 0.0) for n in names])
    assert abs(np.mean(np.log(factors))) < 0.03 and abs(np.std(np.log(factors)) - 0.5) < 0.03
    assert [workload.declared_factor(n, 0, 0.5, 0.0) for n in names[:50]] == list(factors[:50])
    assert [workload.declared_factor(n, 1, 0.5, 0.0) for n in names[:50]] != list(factors[:50])
    missing = [workload.declared_factor(n, 0, 0.5, 0.3) is None for n in names]
    assert 0.27 < np.mean(missing) < 0.33
    assert all(workload.declared_factor(n, 0, 0.0, 1.0) is None for n in names[:50])


def test_a_job_reports_what_its_declaration_leaves_never_the_truth(tmp_path: Path) -> None:
    rows = [f"j{i},1000,1,1,1000,,BE,Running,{i},{i + 500},0" for i in range(40)]
    pods = write_pods(tmp_path / "p.csv", rows)
    jobs = workload.load_jobs(pods, 1024, 768, 0.8, seed=0, work_estimate_error=1.0, undeclared_share=0.25)
    undeclared = [j for j in jobs if j.declared_factor is None]
    declared = [j for j in jobs if j.declared_factor is not None]
    assert undeclared and declared
    for j in jobs:
        js = state.JobState(j)
        js.done = j.work * 0.5
        remaining = policies.job_view(js).remaining_work
        if j.declared_factor is None:
            assert remaining is None
        else:  # declared less done, never below 0: a job past its declared end is "about done"
            assert remaining == pytest.approx(max(j.work * j.declared_factor - js.done, 0.0))
    assert any(policies.job_view(state.JobState(j, done=j.work)).remaining_work == 0 for j in declared
               if j.declared_factor < 1)
    with pytest.raises(ValueError, match="work_estimate_error"):
        workload.load_jobs(pods, 1024, 768, 0.8, seed=0, work_estimate_error=-0.1)
    with pytest.raises(ValueError, match="undeclared_share"):
        workload.load_jobs(pods, 1024, 768, 0.8, seed=0, undeclared_share=1.5)


def test_compression_sets_the_offered_load(tmp_path: Path) -> None:
    rows = [f"j{i},1,1,1,1000,,BE,Running,{i * 1000},{i * 1000 + 500},0" for i in range(200)]
    jobs = workload.load_jobs(write_pods(tmp_path / "p.csv", rows), 1024, 10, 0.8, seed=0)
    window = max(j.arrival for j in jobs)
    offered = sum(min(j.duration, window - j.arrival) for j in jobs) / (10 * window)
    assert offered == pytest.approx(0.8, rel=0.02)
    assert window < 199 * 1000  # compressed


def test_family_assignment_is_stable_and_seeded_curves_differ(tmp_path: Path) -> None:
    rows = [f"j{i},1,1,1,1000,,BE,Running,{i},{i + 100},0" for i in range(300)]
    pods = write_pods(tmp_path / "p.csv", rows)
    first = workload.load_jobs(pods, 1024, 100, 0.8, seed=0)
    second = workload.load_jobs(pods, 1024, 100, 0.8, seed=1)
    assert [j.family.name for j in first] == [j.family.name for j in second]
    shares = {f: sum(j.family.name == f for j in first) / len(first) for f, _ in workload.MIX}
    assert shares["cnn"] == pytest.approx(0.35, abs=0.1)
    assert first[0].truth != second[0].truth


def test_nodes_are_trimmed_to_the_gpu_count(tmp_path: Path) -> None:
    nodes_csv = tmp_path / "n.csv"
    rows = "".join(f"n{i},1,1,8,T4\n" for i in range(4))
    nodes_csv.write_text("sn,cpu_milli,memory_mib,gpu,model\n" + rows)
    nodes = workload.load_nodes(nodes_csv, 20, seed=0)
    assert sum(n.gpus for n in nodes) == 20
    with pytest.raises(workload.TraceError, match="fewer than the 64"):
        workload.load_nodes(nodes_csv, 64, seed=0)


def test_malformed_rows_name_line_and_column(tmp_path: Path) -> None:
    pods = write_pods(tmp_path / "p.csv", ["a,1,1,1,1000,,BE,Running,50,10,0"])
    with pytest.raises(workload.TraceError, match=r"p.csv:2: column 'deletion_time'"):
        workload.load_jobs(pods, 1024, 10, 0.8, seed=0)
    empty = write_pods(tmp_path / "e.csv", ["a,1,1,1,1000,,LS,Running,0,10,0"])
    with pytest.raises(workload.TraceError, match="no training pods"):
        workload.load_jobs(empty, 1024, 10, 0.8, seed=0)


@pytest.mark.skipif(not QPS.exists(), reason="no shared QPS trace")
def test_inference_cluster_is_sized_for_its_peak() -> None:
    load = inference.InferenceLoad(QPS, 32)
    assert load.need.max() == pytest.approx(0.9 * 32, abs=1)
    assert np.all(load.forecast_need >= load.need)
    assert load.need_at(0) == load.need[len(load.rate) // 2]
    assert load.bin_of(load.bin_seconds * len(load.rate)) == load.bin_of(0)  # wraps around
    with pytest.raises(ValueError, match="qps start"):
        inference.InferenceLoad(QPS, 32, start="noon")


def test_a_qps_file_rewritten_in_place_is_read_again_and_shared_arrays_are_read_only(tmp_path: Path) -> None:
    """The series and its forecast are cached per process; a cache that ignored a rewrite would
    simulate yesterday's load, and one a simulation could write into would change the next's."""
    qps = tmp_path / "qps.csv"
    day = [(i * 300, 10 + 9 * math.sin(2 * math.pi * i / 288)) for i in range(2 * 288)]
    qps.write_text("timestamp_anon,value\n" + "".join(f"{t},{v:.3f}\n" for t, v in day))
    first = inference.InferenceLoad(qps, 8)
    again = inference.InferenceLoad(qps, 16)
    assert again.rate is first.rate  # one read, one fit
    assert again.need.max() == pytest.approx(0.9 * 16, abs=1)
    with pytest.raises(ValueError, match="read-only"):
        first.rate[0] = 0.0
    qps.write_text("timestamp_anon,value\n" + "".join(f"{t},{2 * v:.3f}\n" for t, v in day) + "0,1.0\n")
    rewritten = inference.InferenceLoad(qps, 8)
    # the new row is a second report of the one series in its first bin: their mean
    assert rewritten.rate[0] == pytest.approx((2 * first.rate[0] + 1.0) / 2, rel=1e-3)
