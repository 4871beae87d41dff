"""The saturated-goodput bound is above what every policy reaches, and not absurdly loose."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from huorn.sim import bounds, engine, run, shared_data, state, workload

DATA = shared_data.shared_data_dir()
TRACE = DATA / "openb_pod_list_default.csv"
NODES = DATA / "openb_node_list_gpu_node.csv"
QPS = DATA / "genai_qps.csv"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared OpenB trace not present")


@pytest.mark.parametrize("seed", [2, 4])
def test_no_policy_beats_the_bound(seed: int) -> None:
    results, sims = run.run_policies(TRACE, NODES, QPS, ["fifo", "pollux", "huorn"],
                                     engine.SimConfig(gpus=32, seed=seed))
    bound = bounds.saturated_goodput_bound(sims["fifo"])
    assert bound == pytest.approx(bounds.saturated_goodput_bound(sims["huorn"]))  # policy-independent
    reached = {name: r["goodput_saturated_gpu_equiv"] for name, r in results.items()}
    assert all(0 < value <= bound for value in reached.values()), (bound, reached)
    assert reached["huorn"] >= 0.6 * bound  # the elastic policies get most of the way there
    shared = bounds.capacity_goodput_bound(sims["fifo"])
    assert all(value <= shared * (1 + 1e-9) for value in reached.values()), (shared, reached)


class _IdleInference:
    """The inference load the capacity bound reads: none, so every inference GPU is lendable."""

    bin_seconds = 300.0

    def need_at(self, t: float) -> int:
        return 0


def _jobs_half_of_them_late(tmp_path: Path) -> list[state.JobState]:
    """Four one-GPU jobs of 100,000 s: two at the start, two 150,000 s in. With 2 training GPUs
    the saturated window is 200,000 s, and the late pair can finish in it only on more GPUs."""
    rows = "".join(f"j{i},1000,1,1,1000,,BE,Running,{i},{i + 100_000},0\n" for i in range(4))
    pods = tmp_path / "pods.csv"
    pods.write_text("name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
                    "creation_time,deletion_time,scheduled_time\n" + rows)
    jobs = [state.JobState(j) for j in workload.load_jobs(pods, 1024, 2, 0.8, seed=0)]
    for js, arrival in zip(jobs, (0.0, 0.0, 150_000.0, 150_000.0), strict=True):
        js.job.arrival = arrival
    return jobs


@pytest.mark.parametrize("infer", [0, 1])
def test_the_capacity_bound_is_held_to_the_gpus_a_policy_may_use(tmp_path: Path, infer: int) -> None:
    """Capacity ignored, the late pair grows to 8 GPUs each and finishes: the bound is all the
    work. On 2 training GPUs (+ `infer` idle inference GPUs) no schedule finishes it, and no
    schedule does more than every GPU at the best goodput per GPU any job has; on ample GPUs
    the two bounds agree."""
    jobs = _jobs_half_of_them_late(tmp_path)
    sim = SimpleNamespace(jobs=jobs, train_gpus=2, infer_gpus=infer, load=_IdleInference())
    free = bounds.saturated_goodput_bound(sim)  # type: ignore[arg-type]
    shared = bounds.capacity_goodput_bound(sim)  # type: ignore[arg-type]

    def first_slope(js: state.JobState) -> float:  # GPU-equivalents per GPU at the hull's start
        value = bounds.best_rates(js) * js.job.requested_gpus * js.job.duration / js.job.work
        return float(bounds._hull(np.arange(1, js.job.max_replicas + 1, dtype=float), value)[1][0])

    assert free == pytest.approx(2.0)  # all 400,000 GPU-s of work over the 200,000 s window
    # the late pair shares the GPUs for the last 50,000 s (one slot more: a job may start in the
    # slot its arrival falls in), each GPU at best at the best goodput per GPU any job has
    late = (2 + infer) * max(first_slope(js) for js in jobs) * (50_000 + 200_000 / 48)
    assert shared <= (200_000 + late) / 200_000 + 1e-9, (shared, late)
    assert shared < 0.95 * free, (shared, free)
    roomy = SimpleNamespace(jobs=jobs, train_gpus=2, infer_gpus=1000, load=_IdleInference())
    assert bounds.capacity_goodput_bound(roomy) == pytest.approx(free, rel=0.02)  # type: ignore[arg-type]


def test_the_hull_is_concave_and_lets_a_job_leave_gpus_idle() -> None:
    lengths, slopes = bounds._hull(np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 1.5, 1.2, 2.4]))
    assert lengths.sum() == pytest.approx(4.0)
    assert np.all(np.diff(slopes) <= 1e-12) and np.all(slopes > 0)
    # 3 GPUs are worth at least what 2 are: the dip to 1.2 is not a loss a schedule must take
    assert (lengths * slopes).sum() == pytest.approx(2.4)
