"""FALCON fail-slow detection on per-worker step times, and localisation among comparable ranks.

Detection runs BOCD with validation on each worker's own series (see bocd.py). Classification
uses what synchronous training implies:
- a slow link or NIC delays every member of the collective alike, so a shift that appears on
  most workers at the same time is job-wide (reported once, worker ``*``);
- a shift on a few workers only is their own computation: they are the stragglers;
- with separate ``compute``/``comm`` columns, compute is judged per worker and communication
  on the per-step minimum over workers (the collective's own latency, free of waiting), and a
  shift counts only if it moves the iteration time by the 10% (FALCON validates on iteration
  time, not on the part that moved).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping

import numpy as np

from huorn.scheduler.remediation import bocd
from huorn.scheduler.remediation.steptable import StepTable

JOB_WIDE = "*"
ONSET_TOLERANCE = 20  # steps: shifts this close together are one event


@dataclasses.dataclass(frozen=True)
class SlowFinding:
    """A validated fail-slow (factor > 1) or recovery (factor < 1) of one worker or the job."""

    worker: str
    kind: str  # compute | communication | job-wide
    onset_iteration: int
    detected_iteration: int
    factor: float

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def _changes(
    iterations: np.ndarray, series: np.ndarray, config: bocd.BocdConfig
) -> list[tuple[int, int, float]]:
    if len(series) < config.warmup + config.validate:
        return []
    found = bocd.detect_changes(np.maximum(series, 1e-6), config)
    return [(int(iterations[c.onset]), int(iterations[c.detected_at]), c.factor) for c in found]


def _merge_job_wide(found: list[SlowFinding], workers: int) -> list[SlowFinding]:
    """Collapse shifts that hit at least half of the workers at once into one job-wide finding."""
    if workers < 2:
        return found
    result: list[SlowFinding] = []
    pending = sorted(found, key=lambda f: f.onset_iteration)
    while pending:
        head = pending[0]
        group = [f for f in pending if abs(f.onset_iteration - head.onset_iteration) <= ONSET_TOLERANCE
                 and (f.factor > 1) == (head.factor > 1)]
        if len({f.worker for f in group}) * 2 >= workers and len(group) >= 2:
            result.append(SlowFinding(
                JOB_WIDE, "job-wide", int(statistics.median_low([f.onset_iteration for f in group])),
                max(f.detected_iteration for f in group), float(np.median([f.factor for f in group])),
            ))
            pending = [f for f in pending if f not in group]
        else:
            result.append(head)
            pending = pending[1:]
    return result


def _iteration_seconds(table: StepTable) -> np.ndarray:
    """The job's step time per iteration: the slowest worker's busy time sets the pace."""
    by_iteration: dict[int, float] = {}
    for w in table.workers:
        for it, t in zip(table.iterations[w], table.times[w], strict=True):
            by_iteration[int(it)] = max(by_iteration.get(int(it), 0.0), float(t))
    return np.array([by_iteration[i] for i in sorted(by_iteration)])


def _moves_iteration(series: np.ndarray, iterations: np.ndarray, finding: SlowFinding,
                     step_seconds: float, min_shift: float) -> bool:
    """FALCON validates on iteration time: a shift in one part counts only if it moves the
    whole step by min_shift. A 2× jitter in a 1 ms wait is not a fail-slow."""
    before = series[iterations < finding.onset_iteration][-100:]
    after = series[iterations >= finding.onset_iteration][:20]
    if len(before) == 0 or len(after) == 0:
        return False
    return abs(float(np.median(after)) - float(np.median(before))) >= min_shift * step_seconds


def detect_fail_slow(table: StepTable, config: bocd.BocdConfig | None = None) -> list[SlowFinding]:
    """Return the validated slowdowns (and recoveries) in the table, ordered by onset."""
    config = config or bocd.BocdConfig()
    if table.compute is None or table.comm is None:
        found = [SlowFinding(w, "compute", *c) for w in table.workers
                 for c in _changes(table.iterations[w], table.times[w], config)]
        return sorted(_merge_job_wide(found, len(table.workers)), key=lambda f: (f.onset_iteration, f.worker))
    step_seconds = float(np.median(_iteration_seconds(table)))
    compute = [f for w in table.workers
               for f in (SlowFinding(w, "compute", *c)
                         for c in _changes(table.iterations[w], table.compute[w], config))
               if _moves_iteration(table.compute[w], table.iterations[w], f, step_seconds, config.min_shift)]
    # NB: per-rank comm time is mostly waiting for the slowest peer, so it is noisy and moves
    # whenever anybody computes slowly. The last rank to arrive waits for nobody: the minimum
    # over ranks is the collective's own latency, and that is what a slow network raises.
    iterations, comm = _min_comm(table)
    network = [f for f in (SlowFinding(JOB_WIDE, "communication", *c)
                           for c in _changes(iterations, comm, config))
               if _moves_iteration(comm, iterations, f, step_seconds, config.min_shift)]
    found = _merge_job_wide(compute, len(table.workers)) + network
    return sorted(found, key=lambda f: (f.onset_iteration, f.worker))


def _min_comm(table: StepTable) -> tuple[np.ndarray, np.ndarray]:
    assert table.comm is not None
    by_iteration: dict[int, float] = {}
    for w in table.workers:
        for it, c in zip(table.iterations[w], table.comm[w], strict=True):
            by_iteration[int(it)] = min(by_iteration.get(int(it), np.inf), float(c))
    iterations = np.array(sorted(by_iteration))
    return iterations, np.array([by_iteration[i] for i in iterations])


@dataclasses.dataclass(frozen=True)
class Culprit:
    rank: int
    kind: str  # compute | communication
    ratio: float  # latency over the median of comparable ranks


def localise_ranks(
    compute: Mapping[int, float], comm: Mapping[int, float],
    compute_ratio: float = 2.0, comm_ratio: float = 1.1,
) -> list[Culprit]:
    """FALCON's localisation among ranks with equal work and communication volume.

    Compute is compared with a loose 2× bound because kernels vary with data; communication with
    a tight 1.1× bound because equal-volume collectives on healthy links take equal time. Only
    ranks that did the same work may be compared: pass one data-parallel group at a time.
    """
    culprits: list[Culprit] = []
    for kind, values, ratio in (("compute", compute, compute_ratio), ("communication", comm, comm_ratio)):
        if len(values) < 3:
            continue  # a median of two cannot tell which of them is the odd one out
        median = statistics.median(values.values())
        if median <= 0:
            continue
        culprits += [Culprit(r, kind, v / median) for r, v in sorted(values.items()) if v > ratio * median]
    return culprits
