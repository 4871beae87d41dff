"""The prediction board in the operator (huorn.operator.board): an inference cluster's request
rate read from Prometheus's HTTP API (a real HTTP server speaking its JSON, tests/prometheus_api.py),
the forecast it makes, the GPUs it reserves, and what happens when Prometheus cannot be read."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import prometheus_api
import pydantic
import pytest

from huorn.api.virtualcluster import ForecastReading, VirtualClusterSpec
from huorn.operator import board
from huorn.operator.context import Context
from huorn.scheduler import forecast

DAY = 86400.0
DAY0 = 19676 * DAY  # a midnight, so the board's time of day is the rate's


def diurnal(t: float) -> float:
    """10 requests/s at midnight, 100 at noon."""
    return 55.0 - 45.0 * math.cos(2 * math.pi * (t % DAY) / DAY)


@pytest.fixture()
def prometheus() -> Iterator[prometheus_api.PrometheusApi]:
    with prometheus_api.serve() as api:
        api.rate = diurnal
        yield api


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, body: Any, kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))


def make_ctx() -> tuple[Context, Recorder]:
    events = Recorder()
    return Context(client=None, post_event=events), events  # type: ignore[arg-type]


def serving(url: str, **forecast_spec: Any) -> dict[str, Any]:
    spec = {"prometheusURL": url, "query": "sum(rate(requests_total[5m]))", "requestsPerGPU": 1.0,
            "headroom": 0.0, **forecast_spec}
    return {"metadata": {"name": "serve"},
            "spec": {"purpose": "inference", "members": {"nodes": ["b0"]},
                     "lending": {"lendable": True, "maxGPUsLent": 8, "forecast": spec}}}


def test_the_history_is_summed_over_series_and_gaps_take_the_bin_before(prometheus) -> None:
    prometheus.series = 3
    prometheus.rate = lambda t: None if t in (DAY0 + 600, DAY0 - 900) else 30.0 + (t - DAY0) / 300
    times, rate = board.fetch_rate_history(prometheus.url, "q", DAY0 - 1200, DAY0 + 1200, 300, 2.0)
    assert times[0] == DAY0 - 1200 and np.all(np.diff(times) == 300)
    # at -1200, -900 (no sample: the bin before), -600, ..., 600 (none), 900, 1200
    assert rate == pytest.approx([26, 26, 28, 29, 30, 31, 31, 33, 34])
    assert prometheus.queries[-1]["query"] == "q" and prometheus.queries[-1]["step"] == "300"


@pytest.mark.parametrize(("setup", "words"), [
    (lambda api: setattr(api, "fail", (400, 'parse error at char 5: unexpected "("')),
     ["answered 400", "spec.lending.forecast.query", "parse error at char 5", "fix the query"]),
    (lambda api: setattr(api, "rate", lambda t: None),
     ["spec.lending.forecast.query", "returned no samples", "metric's name and labels"]),
])
def test_a_query_prometheus_refuses_or_that_matches_nothing_names_the_field(prometheus, setup, words) -> None:
    setup(prometheus)
    with pytest.raises(board.ForecastUnavailable) as err:
        board.fetch_rate_history(prometheus.url, "sum(", DAY0, DAY0 + 600, 300, 2.0)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_an_unreachable_prometheus_names_the_url_field() -> None:
    with pytest.raises(board.ForecastUnavailable, match=r"cannot reach Prometheus at spec\.lending\.forecast"
                                                         r"\.prometheusURL http://127\.0\.0\.1:9"):
        board.fetch_rate_history("http://127.0.0.1:9", "q", DAY0, DAY0 + 600, 300, 1.0)


async def test_with_a_short_history_the_board_reserves_for_the_rate_now(prometheus) -> None:
    ctx, events = make_ctx()
    prometheus.rate = lambda t: diurnal(t) if t >= DAY0 + 6 * 3600 - 1800 else None  # half an hour of it
    reading = await board.update(ctx, serving(prometheus.url), now=DAY0 + 6 * 3600)
    assert reading is not None and not reading.fitted
    assert reading.bins == 7
    assert reading.gpus == math.ceil(diurnal(DAY0 + 6 * 3600))
    assert ctx.index.forecast_demand["serve"] == reading.gpus
    status = ForecastReading.model_validate(board.status_of(ctx, "serve"))  # the CRD's status schema
    assert status.model == "reactive" and status.gpus == reading.gpus and status.error is None
    assert events.events == []


async def test_with_a_days_history_the_board_reserves_ahead_of_the_morning_ramp(prometheus) -> None:
    """On the ramp, the forecast peak of the next 10 minutes is above the rate now: the GPUs come
    back before inference needs them, which the reactive reading cannot do."""
    ctx, _ = make_ctx()
    now = DAY0 + DAY + 7 * 3600  # 07:00, rising
    reading = await board.update(ctx, serving(prometheus.url, quantile=0.9), now=now)
    assert reading is not None and reading.fitted and reading.bins == 289
    coming = max(diurnal(now + s) for s in (300, 600))
    assert reading.rate == pytest.approx(diurnal(now))
    assert reading.peak >= coming * 0.98, (reading, coming)  # within the model's error of what comes
    assert reading.peak <= coming * 1.15, (reading, coming)  # and not the whole cluster
    assert reading.gpus > math.ceil(diurnal(now))
    # at 19:00 the rate falls: the reserve follows it down, never below the rate now
    evening = await board.update(ctx, serving(prometheus.url, quantile=0.9), now=DAY0 + DAY + 19 * 3600)
    assert evening is not None and evening.gpus < reading.gpus
    assert evening.peak >= evening.rate


async def test_the_model_is_fitted_once_a_bin_and_again_when_its_settings_change(prometheus) -> None:
    ctx, _ = make_ctx()
    now = DAY0 + DAY + 3 * 3600
    await board.update(ctx, serving(prometheus.url), now=now)
    first = ctx.boards["serve"].model
    await board.update(ctx, serving(prometheus.url), now=now + 60)  # same bin
    assert ctx.boards["serve"].model is first
    await board.update(ctx, serving(prometheus.url), now=now + 300)  # the next bin
    assert ctx.boards["serve"].model is not first
    second = ctx.boards["serve"].model
    await board.update(ctx, serving(prometheus.url, quantile=0.5), now=now + 360)
    assert ctx.boards["serve"].model is not second
    assert ctx.boards["serve"].model.config.quantile == 0.5


async def test_when_prometheus_fails_the_last_forecast_stays_and_one_warning_says_why(prometheus) -> None:
    ctx, events = make_ctx()
    now = DAY0 + 12 * 3600
    first = await board.update(ctx, serving(prometheus.url), now=now)
    assert first is not None
    prometheus.fail = (503, "query timed out")
    for tick in range(3):
        assert await board.update(ctx, serving(prometheus.url), now=now + 10 * (tick + 1)) == first
    assert ctx.index.forecast_demand["serve"] == first.gpus
    warnings = [e for e in events.events if e[1] == "ForecastUnavailable"]
    assert len(warnings) == 1, events.events
    assert "query timed out" in warnings[0][2]
    assert f"keeping the last forecast, {first.gpus} GPU(s)" in warnings[0][2]
    assert board.status_of(ctx, "serve")["error"] == warnings[0][2]
    prometheus.fail = None
    assert await board.update(ctx, serving(prometheus.url), now=now + 60) is not None
    assert events.events[-1][1] == "ForecastAvailable"
    assert "error" not in board.status_of(ctx, "serve")


async def test_a_new_operator_starts_from_the_reading_in_status_until_prometheus_answers(prometheus) -> None:
    """The operator's memory starts empty; the last reading is in status.forecast, written by the
    operator before. It holds the reserve through an outage, and a fresh reading replaces it."""
    ctx, events = make_ctx()
    body = serving(prometheus.url)
    body["status"] = {"forecast": {"requestsPerSecond": 50.0, "peakRequestsPerSecond": 55.0, "gpus": 6,
                                   "historyBins": 73, "model": "fitted", "error": "an old error"}}
    prometheus.fail = (503, "query timed out")
    kept = await board.update(ctx, body, now=DAY0)
    assert kept == forecast.BoardReading(rate=50.0, peak=55.0, gpus=6, bins=73, fitted=True)
    assert ctx.index.forecast_demand["serve"] == 6
    ((_, reason, message),) = events.events
    assert reason == "ForecastUnavailable" and message.endswith("keeping the last forecast, 6 GPU(s)")
    assert board.status_of(ctx, "serve") == {**body["status"]["forecast"], "error": message}
    prometheus.fail = None
    prometheus.rate = lambda t: 2.0
    fresh = await board.update(ctx, body, now=DAY0 + 10)
    assert fresh is not None and fresh.gpus == 2 and ctx.index.forecast_demand["serve"] == 2
    # a status this operator cannot read is no reading: nothing is reserved from it
    assert board.saved_reading({"gpus": 6}, "gpus") is None
    unreadable = {"requestsPerSecond": 1, "peakRequestsPerSecond": "x", "gpus": 6}
    assert board.saved_reading(unreadable, "gpus") is None


async def test_a_forecast_spec_the_crd_would_refuse_is_reported_not_raised(prometheus) -> None:
    """An object from before the CRD carried the field's schema: the board says what is wrong
    and keeps the last reading, instead of failing the cluster's whole reconcile."""
    ctx, events = make_ctx()
    body = serving(prometheus.url)
    first = await board.update(ctx, body, now=DAY0 + 3600)
    assert first is not None
    del body["spec"]["lending"]["forecast"]["requestsPerGPU"]
    assert await board.update(ctx, body, now=DAY0 + 3610) == first
    ((kind, reason, message),) = events.events
    assert (kind, reason) == ("Warning", "ForecastUnavailable")
    assert message.startswith("spec.lending.forecast is invalid: requestsPerGPU: Field required; fix the "
                              "VirtualCluster"), message
    assert message.endswith(f"keeping the last forecast, {first.gpus} GPU(s)")
    assert ctx.index.forecast_demand["serve"] == first.gpus


async def test_the_forecast_raises_the_demand_above_the_floors_but_never_lowers_them(prometheus) -> None:
    ctx, _ = make_ctx()
    ctx.index.observe_inference_job({"metadata": {"namespace": "t", "name": "chat"},
                                     "spec": {"virtualCluster": "serve", "autoscaling": {"minReplicas": 3},
                                              "resources": {"gpus": 2}}})
    prometheus.rate = lambda t: 2.0  # 2 GPUs: below the floors
    await board.update(ctx, serving(prometheus.url), now=DAY0)
    assert ctx.index.forecast_demand["serve"] == 2 and ctx.index.demand_of("serve") == 6
    prometheus.rate = lambda t: 7.5
    await board.update(ctx, serving(prometheus.url), now=DAY0 + 10)
    assert ctx.index.demand_of("serve") == 8
    # a training cluster, or one without the field, has no board
    body = serving(prometheus.url)
    del body["spec"]["lending"]["forecast"]
    assert await board.update(ctx, body, now=DAY0 + 20) is None
    assert "serve" not in ctx.boards and ctx.index.demand_of("serve") == 6


def test_the_api_refuses_a_forecast_on_a_training_cluster_and_a_bad_url() -> None:
    spec = serving("http://prometheus.monitoring:9090")["spec"]
    assert VirtualClusterSpec.model_validate(spec).lending.forecast.requests_per_gpu == 1.0
    with pytest.raises(pydantic.ValidationError, match=r"lending\.forecast: is read only by an inference "
                                                       r"virtual cluster \(purpose training\); set purpose"):
        VirtualClusterSpec.model_validate({**spec, "purpose": "training"})
    bad = {**spec, "lending": {**spec["lending"], "forecast": {**spec["lending"]["forecast"],
                                                              "prometheusURL": "prometheus:9090"}}}
    with pytest.raises(pydantic.ValidationError, match="prometheusURL"):
        VirtualClusterSpec.model_validate(bad)
    with pytest.raises(ValueError, match="history"):
        forecast.read_board(np.array([]), np.array([]), 1.0, 0.1, None)
