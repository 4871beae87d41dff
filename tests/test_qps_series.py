"""How the GenAI QPS trace becomes a request rate per 5-minute bin (forecast.load_qps_series).

A row is one report of one series' rate. The trace's containers report every 114 s and its API
series every 57 s, so a bin holds 1 to 6 reports of each: summed, as until 2026-12-07, each rate
counted that many times, which put the level 2.6 times too high at the median and added a
bin-to-bin noise of 2.0-3.5 times that was no load (found by a review of the board)."""

from __future__ import annotations

import csv
import io

import numpy as np
import pytest

from huorn.scheduler import forecast
from huorn.sim import shared_data


def test_a_bins_rate_is_each_series_mean_summed_over_series() -> None:
    text = io.StringIO(
        "timestamp_anon,value,container_ip,request_type\n"
        "0,2.0,a,Generative Requests\n"      # container a twice in bin 0: its rate is 2.5
        "100,3.0,a,Generative Requests\n"
        "50,1.0,b,Generative Requests\n"     # container b once: 1.0
        "10,0.5,,API Requests\n"             # the API series three times: 0.5
        "70,0.5,,API Requests\n"
        "130,0.5,,API Requests\n"
        "310,4.0,a,Generative Requests\n"    # bin 1: a alone
    )
    times, rate = forecast.load_qps_series(text)
    assert times.tolist() == [0.0, 300.0]
    assert rate.tolist() == pytest.approx([2.5 + 1.0 + 0.5, 4.0])


def test_a_file_of_one_series_is_its_mean_per_bin() -> None:
    """timestamp_anon,value alone: one series sampled every minute is its rate, not five times it."""
    text = io.StringIO("timestamp_anon,value\n" + "".join(f"{60 * i},{10.0}\n" for i in range(10)))
    assert forecast.load_qps_series(text)[1].tolist() == [10.0, 10.0]


def test_the_trace_reads_as_the_sum_of_its_containers_rates() -> None:
    path = shared_data.shared_data_dir() / "genai_qps.csv"
    _, rate = forecast.load_qps_series(path)
    assert len(rate) == 268  # 22.3 hours of 5-minute bins
    # a bin in the busy afternoon, by hand: each series' reports averaged, then summed

    rows = list(csv.DictReader(path.open()))
    start = min(float(r["timestamp_anon"]) for r in rows)
    b = int(np.argmax(rate))
    per_series: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if int((float(r["timestamp_anon"]) - start) // 300) == b:
            per_series.setdefault((r["request_type"], r["container_ip"]), []).append(float(r["value"]))
    assert rate[b] == pytest.approx(sum(np.mean(v) for v in per_series.values()))
    assert max(len(v) for v in per_series.values()) >= 2  # several reports of a series in a bin
