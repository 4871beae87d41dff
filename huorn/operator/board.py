"""The prediction board in the cluster: a forecast request rate, in GPUs or in replicas.

Two readers: an inference VirtualCluster's `lending.forecast` (the GPUs it keeps unlent, below)
and an InferenceJob's `autoscaling.forecast` (a floor of its replicas, huorn.operator.autoscaling).
Both read Prometheus and fit the model the same way, through `read`.

An inference cluster with `lending.forecast` keeps unlent (and reclaims ahead of time) the GPUs
that the forecast peak of its request rate over the next 10 minutes needs (or over its reclaim
grace and a tick, where that is longer: `common.board_horizon_bins`), not only its
InferenceJobs' floors: FaPES's board, with the same model as the simulator
(`huorn.scheduler.forecast`). The rate's history comes from Prometheus, which the serving stack
already feeds: one `query_range` at the board's 5-minute bins. Prometheus keeps the history, so
the operator keeps nothing of its own, and a restarted operator has the whole history at its
first tick.

- The bins end now, so the last is the rate now. The model is refitted at most once a bin
  (5 minutes), and only once the history holds enough bins; until then the reading is reactive:
  the current rate alone.
- A rate above the reserve is the "load jumped" case: the reading is never below the current
  rate, so the next tick (`OperatorSettings.vc_status_seconds`) reclaims for it.
- When Prometheus cannot be read, the last reading stays in force (lending less is the safe side)
  and the cluster gets a Warning Event `ForecastUnavailable` that names the field to check. The
  last reading is also in the cluster's status.forecast, so a restarted operator starts from it
  (`resume`) rather than from nothing while Prometheus is down.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic

from huorn.api.base import parse_duration
from huorn.api.common import BOARD_HORIZON_BINS, MAX_HISTORY, RateHistory, board_horizon_bins
from huorn.api.virtualcluster import Lending, LoadForecast
from huorn.operator.context import Context
from huorn.scheduler import forecast

FIELD = "spec.lending.forecast"
# A gap longer than this many bins is read as no requests, not as the last rate held
MAX_FILLED_BINS = 2


class ForecastUnavailable(Exception):
    """Prometheus did not give a usable rate history; the message names the field to check."""


@dataclass
class BoardState:
    """One cluster's board between ticks: its model, when it was fitted, the last reading."""

    settings: tuple[Any, ...]
    model: forecast.LoadForecaster | None = None
    fitted_at: float = -math.inf
    reading: forecast.BoardReading | None = None
    error: str | None = None
    short: str | None = None  # why the history can never fit the board, once said
    beyond: bool = False  # whether the reading needs more GPUs than the cluster has, once said


def fetch_rate_history(url: str, query: str, start: float, end: float, step: float,
                       timeout: float, field: str = FIELD) -> tuple[np.ndarray, np.ndarray]:
    """The query's value every `step` back from `end` to `start` (Prometheus `query_range`),
    summed over series, on a regular grid whose last point is `end`: the rate now. A bin
    without a sample takes the one before it (a scrape missed), but in a gap of more than
    MAX_FILLED_BINS, which is no requests; bins before the first sample are dropped."""
    start = end - step * math.floor((end - start) / step + 1e-9)
    params = urllib.parse.urlencode({"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                     "step": f"{step:g}"})
    target = f"{url.rstrip('/')}/api/v1/query_range?{params}"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as err:
        raise ForecastUnavailable(_http_error(err, field)) from None
    except http.client.InvalidURL as err:
        # NB: before OSError and HTTPException: the CRD's pattern let a port like :9090x through,
        # and this escaped every handler, failing the cluster's whole tick (its reclaim too)
        raise ForecastUnavailable(
            f"{field}.prometheusURL {url} is not a valid URL ({err}); give the Prometheus HTTP API's "
            "base URL, e.g. http://prometheus.monitoring:9090") from None
    except ConnectionError as err:
        # NB: before HTTPException: RemoteDisconnected is both, and a Prometheus restarting
        # mid-request is not a wrong URL
        raise ForecastUnavailable(
            f"Prometheus at {field}.prometheusURL {url} dropped the connection ({err}); reading it "
            "again at the next tick") from None
    except http.client.HTTPException as err:
        raise ForecastUnavailable(
            f"{field}.prometheusURL {url} did not answer HTTP ({type(err).__name__}: {err}); point it "
            "at the Prometheus HTTP API's base URL, e.g. http://prometheus.monitoring:9090") from None
    except (OSError, urllib.error.URLError) as err:
        raise ForecastUnavailable(
            f"cannot reach Prometheus at {field}.prometheusURL {url}: {err}; check the URL and that "
            "the operator may reach it") from None
    except ValueError:
        raise ForecastUnavailable(
            f"{field}.prometheusURL {url} did not answer with Prometheus JSON; point it at the "
            "Prometheus HTTP API's base URL") from None
    if not isinstance(body, dict) or body.get("status") != "success":
        detail = body.get("error") if isinstance(body, dict) else None
        raise ForecastUnavailable(f"Prometheus refused {field}.query: {detail or body!r}; fix the query")
    return _to_grid(body.get("data") or {}, query, start, end, step, field)


def _http_error(err: urllib.error.HTTPError, field: str) -> str:
    """What an HTTP error answer from Prometheus means, and which field or party can fix it: a
    query Prometheus refuses is the query's fault, a range it refuses the history's, a refused
    login the operator's access, and an overloaded or failing server no one's in the spec."""
    detail = _prometheus_error(err.read()) or str(err.reason)
    if err.code in (401, 403):
        return (f"Prometheus refused the operator's request ({err.code}: {detail}); let the operator "
                f"read {field}.prometheusURL without credentials, or point it at an endpoint that does")
    if err.code == 429 or err.code >= 500:
        return (f"Prometheus at {field}.prometheusURL is unavailable ({err.code}: {detail}); reading it "
                "again at the next tick")
    if "resolution" in detail or "points" in detail:
        # NB: Prometheus answers at most 11,000 points a query_range: the API's MAX_HISTORY
        return (f"Prometheus answered {err.code}: {detail}; shorten {field}.history (at most "
                f"{MAX_HISTORY} at the board's 5-minute bins)")
    return f"Prometheus answered {err.code} to {field}.query: {detail}; fix the query"


def _prometheus_error(raw: bytes) -> str | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None


def _to_grid(data: Mapping[str, Any], query: str, start: float, end: float,
             step: float, field: str) -> tuple[np.ndarray, np.ndarray]:
    if data.get("resultType") != "matrix":
        raise ForecastUnavailable(
            f"{field}.query gave a {data.get('resultType')!r} result, not a range vector; it must be an "
            "instant-vector expression such as sum(rate(requests_total[5m]))")
    grid = start + step * np.arange(round((end - start) / step) + 1)
    total = np.full(len(grid), np.nan)
    for series in data.get("result") or []:
        for t, value in series.get("values") or []:
            i = round((float(t) - start) / step)
            v = float(value)
            if 0 <= i < len(grid) and math.isfinite(v):
                total[i] = v if math.isnan(total[i]) else total[i] + v
    seen = np.flatnonzero(~np.isnan(total))
    if len(seen) == 0:
        raise ForecastUnavailable(f"{field}.query {query!r} returned no samples over the history; "
                                  "check the metric's name and labels")
    total, grid = total[seen[0]:], grid[seen[0]:]
    # NB: a long gap is not a missed scrape: `sum(rate(...))` returns no series once no pod
    # exports the counter (the serving pods scaled to zero). Held, the last rate kept the
    # cluster from lending while asleep; held inside the history once the service woke, it
    # taught the model a plateau that never was and reserved the old peak at the first sample
    i = 1
    while i < len(total):
        if not math.isnan(total[i]):
            i += 1
            continue
        end = i
        while end < len(total) and math.isnan(total[end]):
            end += 1
        total[i:end] = total[i - 1] if end - i <= MAX_FILLED_BINS else 0.0
        i = end
    return grid, np.maximum(total, 0.0)


def state_for(previous: BoardState | None, config: Mapping[str, Any],
              horizon_bins: int = BOARD_HORIZON_BINS) -> BoardState:
    """The board state for these forecast settings: `previous` while they are the same; for new
    settings (a horizon too: a new reclaim grace) a new model, with the last reading kept in
    force until one is read."""
    settings = (*(config.get(key) for key in ("prometheusURL", "query", "quantile", "history")), horizon_bins)
    if previous is not None and previous.settings == settings:
        return previous
    return BoardState(settings, reading=previous.reading if previous else None)


def saved_reading(saved: Mapping[str, Any] | None, unit_field: str) -> forecast.BoardReading | None:
    """The reading a previous operator wrote to status (`reading_status`), so that a restarted one
    keeps it in force while Prometheus is down instead of reserving nothing and then erasing it;
    None when status holds none, or one this version cannot read."""
    if not isinstance(saved, Mapping):
        return None
    try:
        return forecast.BoardReading(
            rate=float(saved["requestsPerSecond"]), peak=float(saved["peakRequestsPerSecond"]),
            gpus=max(0, int(saved[unit_field])), bins=max(0, int(saved.get("historyBins") or 0)),
            fitted=saved.get("model") == "fitted")
    except (KeyError, TypeError, ValueError):
        return None


def from_status(config: Mapping[str, Any], status: Mapping[str, Any] | None, unit_field: str) -> BoardState:
    """A new board state whose last reading is the one in `status.forecast`, written by the
    operator before: a restarted one keeps it in force while Prometheus is down (a cluster's
    reserve, a job's replica floor) instead of starting from nothing and erasing it."""
    state = state_for(None, config)
    state.reading = saved_reading((status or {}).get("forecast"), unit_field)
    return state


def resume(ctx: Context, vc_body: Mapping[str, Any]) -> BoardState | None:
    """The cluster's board state, made from its status.forecast where this operator has none yet:
    the operator's memory starts empty, and the reading must hold (in the index, for placement's
    reserve and reclaim) until Prometheus gives a new one. None for a cluster without a board."""
    name = vc_body["metadata"]["name"]
    spec = vc_body.get("spec") or {}
    config = (spec.get("lending") or {}).get("forecast")
    if spec.get("purpose") != "inference" or not config:
        return None
    state: BoardState | None = ctx.boards.get(name)
    if state is None:
        state = ctx.boards[name] = from_status(config, vc_body.get("status"), "gpus")
        if state.reading is not None:
            ctx.index.forecast_demand[name] = state.reading.gpus
    return state


async def read(ctx: Context, body: Mapping[str, Any], state: BoardState, source: RateHistory | None,
               invalid: str, field: str, per_unit: float, headroom: float, unit: str,
               now: float, horizon_bins: int = BOARD_HORIZON_BINS) -> forecast.BoardReading | None:
    """One reading of the board: the history up to now from Prometheus, the model refitted at most
    once a bin, the peak in units of `per_unit` requests/s (a GPU's or a replica's). When it cannot
    be read, the last reading stays in force and one Warning Event (per distinct cause) on `body`
    says why; `invalid` is the reason when `source` is None."""
    try:
        if source is None:
            raise ForecastUnavailable(invalid)
        board_config = forecast.ForecastConfig(quantile=source.quantile, horizon_bins=horizon_bins)
        step = board_config.bin_seconds
        _warn_if_short(ctx, body, state, source, field, forecast.min_history_bins(board_config) * step)
        # bins that end now, so that the last one is the rate now: a jump is seen at this tick
        times, rate = await asyncio.to_thread(
            fetch_rate_history, source.prometheus_url, source.query, now - parse_duration(source.history),
            now, step, ctx.settings.forecast_timeout_seconds, field)
        if len(rate) >= forecast.min_history_bins(board_config) and now - state.fitted_at >= step:
            state.model = await asyncio.to_thread(forecast.LoadForecaster(board_config).fit, times, rate)
            state.fitted_at = now
        # NB: in a thread, as the fit: its features span the whole history (tens of ms a week)
        reading = await asyncio.to_thread(forecast.read_board, times, rate, per_unit, headroom, state.model)
    except (ForecastUnavailable, ValueError) as err:
        message = str(err)
        if state.reading is not None:
            message += f"; keeping the last forecast, {state.reading.gpus} {unit}(s)"
        if message != state.error:
            ctx.post_event(body, "Warning", "ForecastUnavailable", message)
        state.error = message
        return state.reading
    if state.error is not None:
        ctx.post_event(body, "Normal", "ForecastAvailable",
                       f"reading {field}.query again: {reading.gpus} {unit}(s) for "
                       f"{reading.peak:.3g} requests/s")
    state.error, state.reading = None, reading
    return reading


def _warn_if_short(ctx: Context, body: Mapping[str, Any], state: BoardState, source: RateHistory,
                   field: str, needed_seconds: float) -> None:
    """One Warning when the history can never hold the bins the board fits on: it then reads the
    rate now only, for good. The API refuses such an inference cluster's forecast now, but an
    InferenceJob's autoscaling.forecast takes any history (a serving job is not stalled for
    it), and objects stored before the rule kept theirs; both were reactive with no word."""
    history = parse_duration(source.history)
    if history >= needed_seconds:
        state.short = None
        return
    message = (f"{field}.history {source.history} holds fewer bins than the board fits on "
               f"({needed_seconds / 60:.0f}m for its horizon): it reserves for the rate now only; "
               f"lengthen {field}.history")
    if message != state.short:
        ctx.post_event(body, "Warning", "ForecastHistoryShort", message)
    state.short = message


async def update(ctx: Context, vc_body: Mapping[str, Any],
                 now: float | None = None) -> forecast.BoardReading | None:
    """Read the board of an inference cluster with `lending.forecast`; the GPUs it needs go into
    the index, where placement's reserve and reclaim read them (`ClusterIndex.demand_of`)."""
    name = vc_body["metadata"]["name"]
    spec = vc_body.get("spec") or {}
    config = (spec.get("lending") or {}).get("forecast")
    if spec.get("purpose") != "inference" or not config:
        forget(ctx, name)
        return None
    invalid = ""
    try:
        spec_forecast: LoadForecast | None = LoadForecast.model_validate(config)
    except pydantic.ValidationError as err:
        # the CRD's schema refuses these; an object from before the CRD was updated may not
        spec_forecast, invalid = None, f"{FIELD} is invalid: {_first_error(err)}; fix the VirtualCluster"
    # far enough ahead that GPUs asked back come back before they are needed: a victim may keep
    # them for the cluster's reclaim grace (the API's rules check the history covers it)
    default_grace = int(Lending.model_fields["reclaim_grace_seconds"].default)
    grace = (spec.get("lending") or {}).get("reclaimGraceSeconds", default_grace)
    horizon = board_horizon_bins(int(grace) if isinstance(grace, int | float) else default_grace)
    state = ctx.boards[name] = state_for(resume(ctx, vc_body), config, horizon)
    per_gpu, headroom = (spec_forecast.requests_per_gpu, spec_forecast.headroom) if spec_forecast else (1, 0)
    reading = await read(ctx, vc_body, state, spec_forecast, invalid, FIELD, per_gpu, headroom, "GPU",
                         time.time() if now is None else now, horizon)
    if reading is not None and state.error is None:
        ctx.index.forecast_demand[name] = reading.gpus
        _warn_if_beyond(ctx, vc_body, state, reading)
    return reading


def _warn_if_beyond(ctx: Context, body: Mapping[str, Any], state: BoardState,
                    reading: forecast.BoardReading) -> None:
    """One Warning when the forecast peak needs more GPUs than the cluster has: lending nothing
    and reclaiming everything still leaves inference short at that peak, which only more nodes
    (or a truer requestsPerGPU) can change. Said again after the reading comes back within."""
    capacity = sum(n.gpus for n in ctx.index.members_of(body["metadata"]["name"]))
    beyond = 0 < capacity < reading.gpus  # none known: its nodes not seen yet, nothing to compare
    if beyond and not state.beyond:
        ctx.post_event(body, "Warning", "ForecastAboveCapacity",
                       f"the forecast peak of {reading.peak:.3g} requests/s needs {reading.gpus} GPU(s), and "
                       f"the cluster's nodes have {capacity}: inference will be short at that peak; add "
                       f"nodes to spec.members, or check {FIELD}.requestsPerGPU")
    state.beyond = beyond


def reading_status(reading: forecast.BoardReading, error: str | None, unit_field: str) -> dict[str, Any]:
    """A reading for status (common.RateReading), rounded so that noise alone does not rewrite
    status every tick; `unit_field` names the count of what the peak needs (gpus, replicas)."""
    out: dict[str, Any] = {
        "requestsPerSecond": float(f"{reading.rate:.3g}"),
        "peakRequestsPerSecond": float(f"{reading.peak:.3g}"),
        unit_field: reading.gpus, "historyBins": reading.bins,
        "model": "fitted" if reading.fitted else "reactive"}
    if error is not None:
        out["error"] = error  # NB: not null when there is none; a merge patch deletes nulls
    return out


def _first_error(err: pydantic.ValidationError) -> str:
    first = err.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    return f"{where}: {first['msg']}" if where else first["msg"]


def clearing(new: dict[str, Any] | None, old: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """`new` as a merge patch over `old`: an error that has cleared is written as null, which
    deletes it (a key left out of a merge patch keeps its old value)."""
    if new is not None and "error" not in new and "error" in (old or {}):
        return {**new, "error": None}
    return new


def status_of(ctx: Context, name: str) -> dict[str, Any] | None:
    """The cluster board's last reading for the cluster's status."""
    state = ctx.boards.get(name)
    if state is None or state.reading is None:
        return None
    return reading_status(state.reading, state.error, "gpus")


def forget(ctx: Context, name: str) -> None:
    ctx.boards.pop(name, None)
    ctx.index.forecast_demand.pop(name, None)
