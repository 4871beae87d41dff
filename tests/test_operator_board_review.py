"""What a review of the prediction board found: answers from Prometheus (or from something that is
not Prometheus) that escaped the board and failed the cluster's whole tick, a rate series that
vanished and was held for good, a forecast too large for an int64, and error messages that sent
the user to the wrong field. Prometheus is tests/prometheus_api.py, a real HTTP server."""

from __future__ import annotations

import contextlib
import math
import socket
import threading
from collections.abc import Iterator

import numpy as np
import prometheus_api
import pytest
from test_operator_board import DAY0, diurnal, serving

from huorn.api.virtualcluster import ForecastReading
from huorn.operator import board
from huorn.operator.context import Context
from huorn.scheduler import forecast
from huorn.sim import shared_data


@pytest.fixture()
def prometheus() -> Iterator[prometheus_api.PrometheusApi]:
    with prometheus_api.serve() as api:
        yield api


def test_a_url_with_a_port_that_is_no_number_is_named_not_raised() -> None:
    """http.client.InvalidURL escaped the board: the tick failed and nothing was reclaimed."""
    with pytest.raises(board.ForecastUnavailable, match=r"spec\.lending\.forecast\.prometheusURL "
                                                         r"http://127\.0\.0\.1:9090x is not a valid URL"):
        board.fetch_rate_history("http://127.0.0.1:9090x", "q", DAY0, DAY0 + 600, 300, 1.0)


@contextlib.contextmanager
def raw_server(reply: bytes) -> Iterator[str]:
    """A port that reads each request, answers `reply` (raw bytes, no HTTP) and closes."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conn.recv(4096)
            if reply:
                conn.sendall(reply)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        server.close()


@pytest.fixture()
def not_http() -> Iterator[str]:
    """A port that speaks another protocol: it greets with a banner and closes."""
    with raw_server(b"SSH-2.0-OpenSSH_9.6\r\n") as url:
        yield url


@pytest.fixture()
def hangs_up() -> Iterator[str]:
    """A server that reads the request and closes without an answer (a Prometheus restarting)."""
    with raw_server(b"") as url:
        yield url


def test_a_dropped_connection_is_not_blamed_on_the_url(hangs_up: str) -> None:
    with pytest.raises(board.ForecastUnavailable) as err:
        board.fetch_rate_history(hangs_up, "q", DAY0, DAY0 + 600, 300, 2.0)
    assert "dropped the connection" in str(err.value) and "next tick" in str(err.value)
    assert "base URL" not in str(err.value)


def test_a_server_that_does_not_speak_http_is_named_not_raised(not_http: str) -> None:
    """http.client.BadStatusLine escaped the board as InvalidURL did."""
    with pytest.raises(board.ForecastUnavailable, match="did not answer HTTP"):
        board.fetch_rate_history(not_http, "q", DAY0, DAY0 + 600, 300, 2.0)


async def test_the_board_keeps_its_last_reading_when_the_url_is_not_http(not_http: str,
                                                                         prometheus) -> None:
    events: list[tuple[str, str, str]] = []
    ctx = Context(client=None, post_event=lambda _b, *e: events.append(e))  # type: ignore[arg-type]
    prometheus.rate = lambda t: 3.0
    first = await board.update(ctx, serving(prometheus.url), now=DAY0)
    assert first is not None and first.gpus == 3
    again = await board.update(ctx, serving(not_http), now=DAY0 + 10)
    assert again == first and ctx.index.forecast_demand["serve"] == 3
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "ForecastUnavailable")]


@pytest.mark.parametrize(("code", "message", "words"), [
    (503, "service unavailable", ["spec.lending.forecast.prometheusURL is unavailable (503",
                                  "at the next tick"]),
    (429, "too many requests", ["is unavailable (429"]),
    (401, "unauthorized", ["refused the operator's request (401", "prometheusURL"]),
    (400, "exceeded maximum resolution of 11,000 points per timeseries. Try decreasing the query "
          "resolution (?step=XX)", ["shorten spec.lending.forecast.history", "at most 900h"]),
    (400, "parse error at char 5", ["to spec.lending.forecast.query", "fix the query"]),
])
def test_each_http_error_names_who_can_fix_it(prometheus, code: int, message: str, words: list[str]) -> None:
    """Every error answer said "fix the query": a 503 sent users to rewrite a correct query."""
    prometheus.fail = (code, message)
    with pytest.raises(board.ForecastUnavailable) as err:
        board.fetch_rate_history(prometheus.url, "q", DAY0, DAY0 + 600, 300, 2.0)
    assert all(w in str(err.value) for w in words), str(err.value)
    if code != 400 or "parse" not in message:
        assert "fix the query" not in str(err.value)


def test_a_series_gone_for_longer_than_a_missed_scrape_is_no_load(prometheus) -> None:
    """`sum(rate(...))` has no series once no pod exports it: the last rate was held for good, and
    a cluster whose serving scaled to zero never lent again."""
    prometheus.rate = lambda t: 80.0 if t <= DAY0 else None
    _, rate = board.fetch_rate_history(prometheus.url, "q", DAY0 - 3600, DAY0 + 6 * 3600, 300, 2.0)
    assert rate[:13].tolist() == [80.0] * 13 and rate[13:].tolist() == [0.0] * (len(rate) - 13)
    # a missed scrape or two at the end is still the rate before it
    prometheus.rate = lambda t: 80.0 if t <= DAY0 else None
    _, rate = board.fetch_rate_history(prometheus.url, "q", DAY0 - 3600, DAY0 + 600, 300, 2.0)
    assert rate.tolist() == [80.0] * 15
    # and once the service wakes, the gap inside the history stays no load: held, it taught the
    # model a plateau that never was and reserved the old peak at the first sample after it
    prometheus.rate = lambda t: 80.0 if t <= DAY0 else (1.0 if t >= DAY0 + 4 * 3600 else None)
    _, rate = board.fetch_rate_history(prometheus.url, "q", DAY0 - 3600, DAY0 + 4 * 3600, 300, 2.0)
    assert rate[:13].tolist() == [80.0] * 13 and rate[13:-1].tolist() == [0.0] * 47 and rate[-1] == 1.0
    # a short gap inside it is still a missed scrape
    prometheus.rate = lambda t: None if DAY0 < t <= DAY0 + 600 else 80.0
    _, rate = board.fetch_rate_history(prometheus.url, "q", DAY0 - 3600, DAY0 + 3600, 300, 2.0)
    assert rate.tolist() == [80.0] * 25


async def test_a_service_that_wakes_from_zero_reserves_for_its_rate_now_not_its_old_peak(prometheus) -> None:
    ctx = Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    prometheus.rate = lambda t: 80.0 if t <= DAY0 else (1.0 if t >= DAY0 + 4 * 3600 else None)
    reading = await board.update(ctx, serving(prometheus.url), now=DAY0 + 4 * 3600)
    assert reading is not None and reading.rate == 1.0 and reading.gpus <= 2


async def test_a_peak_beyond_any_cluster_reserves_the_most_not_a_negative_count(prometheus) -> None:
    """Cast to int64 past 2^63, the count wrapped to -2^63: nothing was reserved, and the status
    write was refused by the CRD's minimum."""
    assert forecast.gpus_needed(2e16, 0.002) == forecast.MAX_GPUS
    assert forecast.gpus_needed(np.array([1.5, np.inf]), 1.0, 0.0).tolist() == [2, forecast.MAX_GPUS]
    ctx = Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    prometheus.rate = lambda t: 2e16
    reading = await board.update(ctx, serving(prometheus.url), now=DAY0)
    assert reading is not None and reading.gpus == forecast.MAX_GPUS
    assert ctx.index.forecast_demand["serve"] == forecast.MAX_GPUS
    assert ForecastReading.model_validate(board.status_of(ctx, "serve")).gpus == forecast.MAX_GPUS


def test_a_reading_at_one_bin_is_the_series_forecast_at_that_bin() -> None:
    """predict_peak builds the last bin's features alone (it built every bin's, on the event
    loop, to keep one): the same forecast, at every bin of a real day."""
    times, rate = forecast.load_qps_series(shared_data.shared_data_dir() / "genai_qps.csv")
    model = forecast.LoadForecaster().fit(times[:150], rate[:150])
    series = model.predict_series(times, rate)
    for end in range(0, len(rate), 7):
        assert model.predict_peak(times, rate, end) == pytest.approx(series[end], rel=1e-12), end
    assert math.isfinite(series[-1])


def test_the_apis_board_constants_are_the_forecasters() -> None:
    """The API's rules check a history against the board's time base, kept in huorn.api.common
    (the API imports nothing above it): they must be the forecaster's own."""
    from huorn.api import common

    config = forecast.ForecastConfig()
    assert (config.horizon_bins, config.bin_seconds) == (common.BOARD_HORIZON_BINS, common.BOARD_BIN_SECONDS)
    for grace in (0, 30, 290, 291, 1800, 86400):
        h = common.board_horizon_bins(grace)
        assert h * 300 >= grace + common.RECLAIM_TICK_SECONDS and h >= 2
        assert common.board_history_seconds(grace) == forecast.min_history_bins(
            forecast.ForecastConfig(horizon_bins=h)) * config.bin_seconds
    assert common.board_history_seconds(30) == 90 * 60  # MIN_HISTORY, 90m


async def test_a_long_reclaim_grace_reserves_as_far_ahead_as_the_grace(prometheus) -> None:
    """The board looked 10 minutes ahead whatever the grace: with a 30-minute grace, a victim asked
    back at the forecast's horizon kept its GPUs 20 minutes past it. On the morning ramp, a 30 s
    grace reserves for the next 10 minutes' peak and a 30-minute one for the next 35 minutes'."""
    prometheus.rate = diurnal
    now = DAY0 + 3 * 86400 + 6 * 3600
    readings = {}
    for grace in (30, 1800):
        ctx = Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
        body = serving(prometheus.url)
        body["spec"]["lending"]["reclaimGraceSeconds"] = grace
        body["spec"]["lending"]["forecast"]["history"] = "72h"
        readings[grace] = await board.update(ctx, body, now=now)
        assert ctx.boards["serve"].model is not None
        assert ctx.boards["serve"].model.config.horizon_bins == (2 if grace == 30 else 7)
    in_10, in_35 = diurnal(now + 600), diurnal(now + 2100)  # 57.0 and 61.9 requests/s
    assert readings[30] is not None and readings[30].peak == pytest.approx(in_10, rel=0.02)
    assert readings[1800] is not None and readings[1800].peak == pytest.approx(in_35, rel=0.02)
    assert readings[1800].gpus >= math.ceil(0.98 * in_35) > readings[30].gpus


async def test_a_history_too_short_to_ever_fit_says_so_once(prometheus) -> None:
    """A stored cluster whose history cannot hold the bins its grace's horizon needs (the API
    refuses it now; objects from before keep theirs), or an InferenceJob's short history, read
    the rate now for good: that was silent."""
    events: list[tuple[str, str, str]] = []
    ctx = Context(client=None, post_event=lambda _b, *e: events.append(e))  # type: ignore[arg-type]
    prometheus.rate = lambda t: 5.0
    body = serving(prometheus.url)
    body["spec"]["lending"]["reclaimGraceSeconds"] = 1800  # 7 bins ahead: 23 bins, 115 minutes
    body["spec"]["lending"]["forecast"]["history"] = "90m"
    for tick in range(3):
        reading = await board.update(ctx, body, now=DAY0 + 3 * 86400 + 10 * tick)
        assert reading is not None and not reading.fitted and reading.gpus == 5
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "ForecastHistoryShort")]
    assert "spec.lending.forecast.history 90m" in events[0][2] and "115m" in events[0][2]


async def test_a_forecast_beyond_the_clusters_gpus_warns_once_a_time(prometheus) -> None:
    """Lending nothing and reclaiming everything still leaves inference short at such a peak:
    only more nodes, or a truer requestsPerGPU, change it. That was silent."""
    from kube import builders

    events: list[tuple[str, str, str]] = []
    ctx = Context(client=None, post_event=lambda _b, *e: events.append(e))  # type: ignore[arg-type]
    ctx.index.observe_vc(builders.make_virtual_cluster("serve", pool="b"))
    ctx.index.observe_node(builders.make_node("b0", 8, pool="b"))
    body = serving(prometheus.url)
    for tick, rate in enumerate((20.0, 20.0, 5.0, 12.0)):
        prometheus.rate = lambda t, r=rate: r
        await board.update(ctx, body, now=DAY0 + 10 * tick)
    warned = [m for _, reason, m in events if reason == "ForecastAboveCapacity"]
    assert len(warned) == 2  # at 20, once; not at 5; again at 12
    assert "needs 20 GPU(s), and the cluster's nodes have 8" in warned[0] and "requestsPerGPU" in warned[0]
