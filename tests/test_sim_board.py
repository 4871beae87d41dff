"""Huorn's prediction board in the simulator: a thinner reserve lends more without losing the SLO."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from huorn.scheduler import forecast
from huorn.sim import engine, inference, policies, run, shared_data

DATA = shared_data.shared_data_dir()
TRACE = DATA / "openb_pod_list_default.csv"
NODES = DATA / "openb_node_list_gpu_node.csv"
QPS = DATA / "genai_qps.csv"
pytestmark = pytest.mark.skipif(not TRACE.exists(), reason="shared OpenB trace not present")


def test_only_huorn_uses_a_board_other_than_the_default() -> None:
    """The baselines' behaviour must not move with Huorn's board (Kueue reads no forecast anyway)."""
    for name, spec in policies.POLICIES.items():
        if name == "huorn":
            assert spec.board.quantile == policies.HUORN_BOARD_QUANTILE < forecast.ForecastConfig().quantile
        else:
            assert spec.board == forecast.ForecastConfig()


def test_huorn_board_reserves_less_on_the_busy_day_and_still_covers_most_next_bins() -> None:
    """Fitted on the second half, played from the start (the busy day first): the held-out half."""
    default = inference.InferenceLoad(QPS, 32, start="beginning")
    huorn = inference.InferenceLoad(QPS, 32, start="beginning",
                                    board=policies.POLICIES["huorn"].board)
    held = np.arange(len(huorn.rate) // 2 - 1)
    assert np.all(huorn.forecast_need >= huorn.need)  # never below what is needed now
    above_default = np.mean(default.forecast_need[held] - default.need[held])
    above_huorn = np.mean(huorn.forecast_need[held] - huorn.need[held])
    assert above_huorn < 0.5 * above_default  # measured 2.9 GPUs against 6.2 (2.4 against 8.4 summed)
    covered = np.mean(huorn.forecast_need[held] >= huorn.need[held + 1])
    assert covered >= 0.65  # measured 0.87 (0.95 board: 0.95); misses are reclaimed at once


def test_thinner_reserve_lends_more_and_keeps_the_slo(monkeypatch: pytest.MonkeyPatch) -> None:
    """128 GPUs, busy inference during the training burst: the case where the reserve binds."""
    config = engine.SimConfig(gpus=128, seed=0, qps_start="beginning")
    out = {}
    for quantile in (0.95, policies.HUORN_BOARD_QUANTILE):
        board = forecast.ForecastConfig(quantile=quantile)
        spec = dataclasses.replace(policies.POLICIES["huorn"], board=board)
        monkeypatch.setitem(policies.POLICIES, "huorn", spec)
        results, sims = run.run_policies(TRACE, NODES, QPS, ["huorn"], config)
        lent = sum(lent for t, _, lent, *_ in sims["huorn"].totals.series if t < 4 * 3600)
        out[quantile] = (results["huorn"], lent)
    (old, old_lent), (new, new_lent) = out[0.95], out[policies.HUORN_BOARD_QUANTILE]
    assert new_lent > 1.3 * old_lent  # GPU-ticks lent in the first four hours: 2,234 against 1,430
    # On the QPS series binned per container (2026-12-07) the lending buys less mean JCT than it
    # did on the noisy sum of reports (1,637 s against 1,678 s then): 1,629 s against 1,635 s,
    # and -0.4 to -1.4 % on seeds 2-4, +0.3 % on seed 1 (docs/scheduling.md, "Prediction board")
    assert new["jct_mean_s"] < old["jct_mean_s"]
    # measured 81.2 against 79.2 GPU-equivalents (76.1 against 75.1 on the summed reports)
    assert new["goodput_saturated_gpu_equiv"] > 1.005 * old["goodput_saturated_gpu_equiv"]
    assert new["inference_slo_attainment"] >= 0.995  # measured 99.96 % (goal 99 %)
