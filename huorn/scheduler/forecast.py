"""The prediction board: how many GPUs each inference virtual cluster will need over the next horizon.

Lending inference GPUs to training only pays if they come back before inference needs them. A
reclaim takes up to the reclaim grace (the borrower checkpoints first), so the board forecasts the
*peak* request rate over the next horizon, at an upper quantile rather than the mean: a forecast
that is right on average is wrong half the time, and each of those times is an SLO miss.

The model is scikit-learn gradient boosting with the quantile loss, on features a service's own
history gives: the last few bins, the recent mean, maximum and slope, and the time of day. Time of
day matters because inference load is diurnal (the GenAI trace in /work/shared/data swings ten-fold
over a day); the slope matters because load ramps before it peaks.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

DAY = 86400.0
EPS = 0.5  # requests per second; keeps the ratio of two near-idle rates finite
# The longest history load_qps_series bins: the board fits on days to weeks, and a timestamp far
# off (a typo, milliseconds among seconds) had np.bincount allocate one bin per 5 minutes up to it.
MAX_HISTORY_DAYS = 366
MAX_GPUS = 1_000_000  # the most a reading asks for: more than any cluster has, and far from int64's end


def _log_ratio(peak: float, level: float) -> float:
    return math.log((peak + EPS) / (level + EPS))


def load_qps_series(path: str | Path | TextIO, bin_seconds: float = 300.0) -> tuple[np.ndarray, np.ndarray]:
    """Cluster request rate per bin from the GenAI QPS trace, from a path or an open text stream
    (a CLI's standard input, named `-` in errors). Returns (bin start times, rate).

    A row is one report of one series' rate: a container's (`container_ip`) of one request type
    (`request_type`), or, without those columns, the one series of the file; no other column
    tells series apart (a per-replica column of another name reads as one series, averaged). The rate of a bin
    is, for each series, the mean of its reports in the bin, summed over series. The trace's
    containers report every 114 s and its API series every 57 s, so summing the reports, as
    this did until 2026-12-07, counted each rate 1 to 6 times a bin (2.6 times at the median):
    a level off by that much, and a bin-to-bin noise (2.0-3.5 times, p10-p90) that was no load.
    """
    if not isinstance(path, str | Path):
        return _read_qps(path, bin_seconds, "-")
    with Path(path).open(newline="", encoding="utf-8-sig") as fh:  # -sig: a BOM is no part of a name
        return _read_qps(fh, bin_seconds, path)


def _read_qps(fh: TextIO, bin_seconds: float, path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    times: list[float] = []
    values: list[float] = []
    lines: list[int] = []
    series: list[tuple[str, str]] = []
    reader = csv.DictReader(fh)
    try:
        if reader.fieldnames is not None:
            reader.fieldnames = [name.strip().lstrip("\ufeff") for name in reader.fieldnames]
        missing = {"timestamp_anon", "value"} - set(reader.fieldnames or [])
        if missing:
            raise ValueError(f"{path}: column(s) {sorted(missing)} missing; the QPS trace needs "
                             "timestamp_anon,value")
        for line, row in enumerate(reader, start=2):
            try:
                stamp, value = float(row["timestamp_anon"]), float(row["value"])
            except (TypeError, ValueError) as err:
                raise ValueError(f"{path}:{line}: timestamp_anon and value must be numbers "
                                 f"({err})") from None
            # float() reads nan and inf: a nan rate made every GPU count garbage, silently
            for column, number in (("timestamp_anon", stamp), ("value", value)):
                if not math.isfinite(number):
                    raise ValueError(f"{path}:{line}: {column} is {row[column].strip()!r}; it must be "
                                     "a finite number")
            if value < 0:
                raise ValueError(f"{path}:{line}: value is {value:g}; a request rate must be ≥ 0")
            times.append(stamp)
            values.append(value)
            lines.append(line)
            series.append(((row.get("request_type") or "").strip(), (row.get("container_ip") or "").strip()))
    except UnicodeDecodeError as error:
        # NB: no byte offset: error.start counts from the decoder's chunk, not the file's start.
        raise ValueError(f"{path}: not UTF-8 text ({error.reason}); the QPS trace is a CSV with "
                         "columns timestamp_anon,value") from None
    if not times:
        raise ValueError(f"{path}: no rows")
    t = np.asarray(times)
    _check_span(path, t, lines)
    start = t.min()
    idx = ((t - start) // bin_seconds).astype(int)
    names = {name: i for i, name in enumerate(sorted(set(series)))}
    which = np.array([names[name] for name in series], dtype=np.int64)
    # NB: only the (bin, series) cells that occur: a dense grid was bins × series, and a year of
    # a thousand containers' reports took 2.4 GiB
    cells, inverse = np.unique(idx.astype(np.int64) * len(names) + which, return_inverse=True)
    means = np.bincount(inverse, weights=np.asarray(values)) / np.bincount(inverse)
    rate = np.bincount(cells // len(names), weights=means, minlength=int(idx.max()) + 1)
    return start + bin_seconds * np.arange(len(rate)), rate



def _check_span(path: str | Path, t: np.ndarray, lines: list[int]) -> None:
    """Refuse a history longer than MAX_HISTORY_DAYS, naming the row most likely wrong: of the
    earliest and the latest, the one farther from the median."""
    first, last = int(t.argmin()), int(t.argmax())
    span = float(t[last] - t[first])
    if span <= MAX_HISTORY_DAYS * DAY:
        return
    middle = float(np.median(t))
    odd, other = (last, first) if t[last] - middle >= middle - t[first] else (first, last)
    raise ValueError(f"{path}:{lines[odd]}: timestamp_anon {t[odd]:.0f} lies {span / DAY:.4g} days from "
                     f"timestamp_anon {t[other]:.0f} (line {lines[other]}); the board reads at most "
                     f"{MAX_HISTORY_DAYS} days of history (timestamps in seconds): fix the timestamp, or "
                     "give the recent part of the history")


# Huorn's board forecasts the 10-minute peak at the 0.9 quantile, not 0.95. What a miss costs sets
# the quantile: the board re-plans every 5-minute bin and reclaims at once when load passes the
# reserve, so an under-forecast leaves inference short only for the reclaim latency (the victim's
# checkpoint write, at most the 30 s grace: a tenth of a bin), never for the whole bin. At 0.95 the
# reserve bought again the insurance the reactive path already gives: through the busy day it sat
# 7-14 GPUs above the next 10 minutes' real peak at 128 GPUs (of 32) and 60-110 at 1,024 (of 256),
# idle. 0.9 was picked among 0.95, 0.9, 0.85, 0.8, 0.65 and 0.5 on seeds 0-4 at 128 GPUs: lower
# quantiles gained no more JCT and left a thinner reserve (docs/scheduling.md, "Prediction board").
HUORN_QUANTILE = 0.9

@dataclass(frozen=True)
class ForecastConfig:
    horizon_bins: int = 2  # forecast the peak over the next this many bins
    lags: int = 6
    quantile: float = 0.95
    bin_seconds: float = 300.0


def _features(times: np.ndarray, rate: np.ndarray, end: int, lags: int) -> np.ndarray:
    """Features of the history up to and including bin `end`."""
    window = rate[max(0, end - lags + 1): end + 1]
    window = np.concatenate([np.full(lags - len(window), window[0]), window])
    phase = 2 * math.pi * (times[end] % DAY) / DAY
    slope = window[-1] - window[-3] if lags >= 3 else 0.0
    return np.concatenate([window, [window.mean(), window.max(), slope, math.sin(phase), math.cos(phase)]])


class LoadForecaster:
    """Peak-rate forecaster for one inference virtual cluster."""

    def __init__(self, config: ForecastConfig | None = None, seed: int = 0):
        # Imported here: scikit-learn costs the operator ~50 MiB and a second at start, and only
        # an inference cluster with lending.forecast ever builds a forecaster.
        from sklearn import ensemble

        self.config = config or ForecastConfig()
        self._model = ensemble.GradientBoostingRegressor(
            loss="quantile", alpha=self.config.quantile, n_estimators=150, max_depth=3,
            learning_rate=0.05, random_state=seed)
        self._fitted = False

    def fit(self, times: np.ndarray, rate: np.ndarray) -> LoadForecaster:
        h, lags = self.config.horizon_bins, self.config.lags
        if len(rate) < lags + h + 10:
            raise ValueError(f"history has {len(rate)} bins; the forecaster needs at least {lags + h + 10}")
        ends = np.arange(lags - 1, len(rate) - h)
        x = np.stack([_features(times, rate, e, lags) for e in ends])
        # Learn the peak relative to the recent maximum, in logs: a ratio carries over from a busy
        # afternoon to a quiet night, where an absolute rate learnt in one would be wrong in the other.
        y = np.array([_log_ratio(rate[e + 1: e + 1 + h].max(), rate[max(0, e - lags + 1): e + 1].max())
                      for e in ends])
        self._model.fit(x, y)
        self._fitted = True
        return self

    def predict_peak(self, times: np.ndarray, rate: np.ndarray, end: int) -> float:
        """Upper-quantile peak rate over the `horizon_bins` after bin `end`, never below the current rate."""
        # NB: the features of bin `end` alone: the series built them for every bin of the
        # history to keep the last (136 ms on the operator's event loop at 30 days)
        return float(self._peaks(times, rate, np.array([end]))[0])

    def predict_series(self, times: np.ndarray, rate: np.ndarray) -> np.ndarray:
        """Forecast made at every bin (vectorised, for the simulator and the evaluation)."""
        return self._peaks(times, rate, np.arange(len(rate)))

    def _peaks(self, times: np.ndarray, rate: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The forecast made at each bin of `ends`, from the history up to it."""
        if not self._fitted:
            raise ValueError("forecaster is not fitted; call fit() with request-rate history first")
        lags = self.config.lags
        x = np.stack([_features(times, rate, e, lags) for e in ends])
        level = np.array([rate[max(0, e - lags + 1): e + 1].max() for e in ends])
        peak = (level + EPS) * np.exp(self._model.predict(x)) - EPS
        return np.maximum(peak, rate[ends])


def gpus_needed(rate: float | np.ndarray, rate_per_gpu: float, headroom: float = 0.1) -> np.ndarray:
    """GPUs that serve `rate` within SLO with `headroom` spare (the board's answer)."""
    if rate_per_gpu <= 0:
        raise ValueError(f"rate_per_gpu must be > 0, got {rate_per_gpu}")
    # NB: clipped before the cast: past 2^63 it wrapped to a negative count, which reserved nothing
    needed = np.ceil(np.asarray(rate, dtype=float) * (1 + headroom) / rate_per_gpu)
    return np.clip(np.nan_to_num(needed, nan=MAX_GPUS, posinf=MAX_GPUS), 0, MAX_GPUS).astype(int)


@dataclass(frozen=True)
class BoardReading:
    """What the board says for one inference cluster now: the rate, the forecast peak of the next
    horizon, and the GPUs that peak needs. `fitted` is False while the history is too short for
    the model; the reading is then reactive (the current rate only)."""

    rate: float
    peak: float
    gpus: int
    bins: int
    fitted: bool


def min_history_bins(config: ForecastConfig) -> int:
    """Bins of history the forecaster needs before it can be fitted."""
    return config.lags + config.horizon_bins + 10


def read_board(times: np.ndarray, rate: np.ndarray, rate_per_gpu: float, headroom: float,
               model: LoadForecaster | None) -> BoardReading:
    """The board's reading at the last bin of `rate`, from a fitted `model` or, without one,
    from the current rate alone (what a cluster reserves before it has a day of history)."""
    if len(rate) == 0:
        raise ValueError("the request-rate history is empty")
    now = float(rate[-1])
    peak = now if model is None else max(now, model.predict_peak(times, rate, len(rate) - 1))
    gpus = int(gpus_needed(peak, rate_per_gpu, headroom))
    return BoardReading(now, peak, gpus, len(rate), model is not None)


@dataclass(frozen=True)
class BoardEvaluation:
    """The board replayed over held-out history, against persistence (reserving the rate now):
    per bin of the held-out part, the GPUs each reserves and the GPUs the next horizon needs."""

    times: np.ndarray
    rate: np.ndarray
    peak: np.ndarray  # the board's forecast peak at each bin
    need: np.ndarray  # GPUs the real peak of the next horizon needs
    board_gpus: np.ndarray
    persistence_gpus: np.ndarray
    bin_seconds: float

    @staticmethod
    def _summary(reserve: np.ndarray, need: np.ndarray, bin_seconds: float) -> dict[str, float]:
        short = np.maximum(need - reserve, 0)
        return {"coverage": float(np.mean(reserve >= need)),
                "mean_reserved_gpus": float(reserve.mean()),
                "mean_idle_gpus": float(np.maximum(reserve - need, 0).mean()),
                "mean_short_gpus_when_short": float(short[short > 0].mean()) if (short > 0).any() else 0.0,
                "short_gpu_hours": float(short.sum() * bin_seconds / 3600)}

    def summary(self) -> dict[str, dict[str, float]]:
        return {"board": self._summary(self.board_gpus, self.need, self.bin_seconds),
                "persistence": self._summary(self.persistence_gpus, self.need, self.bin_seconds)}


def evaluate_board(times: np.ndarray, rate: np.ndarray, rate_per_gpu: float, headroom: float,
                   config: ForecastConfig | None = None, train_share: float = 0.5) -> BoardEvaluation:
    """Fit the board on the first `train_share` of the history and replay it over the rest, the
    way it runs: each bin's forecast sees only the bins before it."""
    config = config or ForecastConfig()
    if not 0 < train_share < 1:
        raise ValueError(f"train_share must lie in (0, 1), got {train_share}")
    cut = int(len(rate) * train_share)
    h = config.horizon_bins
    if cut < min_history_bins(config) or len(rate) - cut <= h:
        raise ValueError(f"history has {len(rate)} bins; fitting on {train_share:.0%} of it and replaying "
                         f"the rest needs at least {math.ceil(min_history_bins(config) / train_share)} bins")
    model = LoadForecaster(config).fit(times[:cut], rate[:cut])
    peak = model.predict_series(times, rate)
    held = slice(cut, len(rate) - h)
    coming = np.array([rate[e + 1: e + 1 + h].max() for e in range(cut, len(rate) - h)])
    return BoardEvaluation(times[held], rate[held], peak[held], gpus_needed(coming, rate_per_gpu, headroom),
                           gpus_needed(peak[held], rate_per_gpu, headroom),
                           gpus_needed(rate[held], rate_per_gpu, headroom), config.bin_seconds)
