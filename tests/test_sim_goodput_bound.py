"""The saturated-goodput bound is above what every policy reaches, and not absurdly loose."""

from __future__ import annotations

from pathlib import Path

import pytest

from huorn.sim import engine, report, run

DATA = Path("/work/shared/data")
TRACE = DATA / "openb_pod_list_default.csv"
NODES = DATA / "openb_node_list_gpu_node.csv"
QPS = DATA / "genai_qps.csv"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared OpenB trace not present")


@pytest.mark.parametrize("seed", [2, 4])
def test_no_policy_beats_the_bound(seed: int) -> None:
    results, sims = run.run_policies(TRACE, NODES, QPS, ["fifo", "pollux", "huorn"],
                                     engine.SimConfig(gpus=32, seed=seed))
    bound = report.saturated_goodput_bound(sims["fifo"])
    assert bound == pytest.approx(report.saturated_goodput_bound(sims["huorn"]))  # policy-independent
    reached = {name: r["goodput_saturated_gpu_equiv"] for name, r in results.items()}
    assert all(0 < value <= bound for value in reached.values()), (bound, reached)
    assert reached["huorn"] >= 0.6 * bound  # the elastic policies get most of the way there
