"""The inference virtual cluster's load: the GenAI QPS series, its GPU need, and the board's forecast.

The series is played in simulated seconds, in 5-minute bins, and the forecaster never sees the half
it is first tested on: with `start="middle"` it is fitted on the first half and play starts at the
midpoint (a quiet night first, the busy day about 12 h in); with `start="beginning"` it is fitted
on the second half and play starts at the beginning (the busy day arrives within the first hour,
on top of the training burst: the adversarial phase). After the end the series wraps around.
The board (`board`, a ForecastConfig) is the policy's own: Huorn forecasts at its own quantile.
Its rate is scaled so the peak needs 90 % of the inference cluster with 10 % headroom: the cluster
is sized for its peak, as inference clusters are, and so idles at night.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import numpy as np

from huorn.scheduler import forecast

PEAK_SHARE = 0.9
HEADROOM = 0.1


@functools.lru_cache(maxsize=16)
def _played_series(qps_csv: Path, stamp: tuple[int, int], start: str, board: forecast.ForecastConfig | None,
                   seed: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The series, its forecast peak at every bin, and where play starts, once per process.

    A comparison builds one simulation per policy, a benchmark dozens, all on the same series:
    reading it and fitting the board took 0.9 s each time, a quarter of the simulator tests' CPU.
    `stamp` (mtime, size) is in the key so that a file rewritten in place is read again. The
    arrays are read-only, since every simulation shares them.
    """
    times, rate = forecast.load_qps_series(qps_csv)
    half = len(rate) // 2
    if start == "middle":
        offset, fit = half, slice(0, half)
    elif start == "beginning":
        offset, fit = 0, slice(half, len(rate))
    else:
        raise ValueError(f"qps start {start!r} is unknown; use middle or beginning")
    need = forecast.min_history_bins(board or forecast.ForecastConfig())
    if fit.stop - (fit.start or 0) < need:  # the forecaster's own message names neither file nor fix
        raise ValueError(f"{qps_csv}: {len(rate)} bins of request rate are too few: the board is fitted on "
                         f"half of them and needs {need}; give a series of at least {2 * need} bins")
    board_model = forecast.LoadForecaster(board, seed=seed).fit(times[fit], rate[fit])
    peak = board_model.predict_series(times, rate)
    rate.setflags(write=False)
    peak.setflags(write=False)
    return rate, peak, offset


class InferenceLoad:
    def __init__(self, qps_csv: Path, gpus: int, seed: int = 0, start: str = "middle",
                 board: forecast.ForecastConfig | None = None):
        path = Path(qps_csv).resolve()
        stat = path.stat()
        rate, peak, self.offset = _played_series(path, (stat.st_mtime_ns, stat.st_size), start, board, seed)
        self.gpus = gpus
        self.rate = rate
        self.bin_seconds = forecast.ForecastConfig().bin_seconds
        self.rate_per_gpu = max(float(rate.max()), 1e-9) * (1 + HEADROOM) / (PEAK_SHARE * max(gpus, 1))
        self.need = np.minimum(forecast.gpus_needed(rate, self.rate_per_gpu, HEADROOM), gpus)
        self.forecast_need = np.minimum(forecast.gpus_needed(peak, self.rate_per_gpu, HEADROOM), gpus)

    def bin_of(self, t: float) -> int:
        return (int(t // self.bin_seconds) + self.offset) % len(self.rate)

    def next_bin_time(self, t: float) -> float:
        return (math.floor(t / self.bin_seconds) + 1) * self.bin_seconds

    def need_at(self, t: float) -> int:
        return int(self.need[self.bin_of(t)])

    def forecast_at(self, t: float) -> int:
        return int(self.forecast_need[self.bin_of(t)])

    def requests_per_second(self, t: float) -> float:
        return float(self.rate[self.bin_of(t)])
