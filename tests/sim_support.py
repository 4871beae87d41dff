"""What simulator tests share: a Huorn simulation run up to a borrower split across clusters."""

from __future__ import annotations

import pytest

from huorn.sim import engine, run, shared_data, state

DATA = shared_data.shared_data_dir()
TRACE = DATA / "openb_pod_list_default.csv"
NODES = DATA / "openb_node_list_gpu_node.csv"
QPS = DATA / "genai_qps.csv"


def split_borrower() -> tuple[engine.Simulation, state.JobState]:
    """A Huorn simulation (64 GPUs, seed 1, load 1.2) run until a job has replicas on its own
    cluster and a lender's, and that job: the trace never reclaims from one, so tests make it."""
    sim = run.build_simulation(TRACE, NODES, QPS, "huorn", engine.SimConfig(gpus=64, seed=1, load=1.2))

    def split() -> list[state.JobState]:
        return [js for js in sim.active() if js.status == "running" and 0 < js.on_lender < js.replicas]

    class Split(Exception):
        pass

    def stop(_: float) -> None:
        if split():
            raise Split

    with pytest.raises(Split):
        sim.run(stop)
    return sim, split()[0]
