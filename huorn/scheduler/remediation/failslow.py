"""FALCON fail-slow detection on per-worker step times, and localisation among comparable ranks.

Detection runs BOCD with validation on each worker's own series (see bocd.py). Classification
uses what synchronous training implies:
- a slow link or NIC delays every member of the collective alike, so a shift that appears on
  most workers at the same time is job-wide (reported once, worker ``*``);
- a shift on a few workers only is their own computation: they are the stragglers;
- with separate ``compute``/``comm`` columns, a compute straggler also lengthens its peers'
  communication (they wait for it inside the all-reduce), so a communication shift that coincides
  with a compute shift elsewhere is that waiting, not a second fault, and is dropped.
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


def detect_fail_slow(table: StepTable, config: bocd.BocdConfig | None = None) -> list[SlowFinding]:
    """Return the validated slowdowns (and recoveries) in the table, ordered by onset."""
    config = config or bocd.BocdConfig()
    found: list[SlowFinding] = []
    if table.compute is not None and table.comm is not None:
        compute = [SlowFinding(w, "compute", *c) for w in table.workers
                   for c in _changes(table.iterations[w], table.compute[w], config)]
        comm = [SlowFinding(w, "communication", *c) for w in table.workers
                for c in _changes(table.iterations[w], table.comm[w], config)]
        comm = [f for f in comm if not any(
            abs(f.onset_iteration - c.onset_iteration) <= ONSET_TOLERANCE and c.worker != f.worker
            for c in compute)]
        found = _merge_job_wide(compute, len(table.workers)) + _merge_job_wide(comm, len(table.workers))
    else:
        found = [SlowFinding(w, "compute", *c) for w in table.workers
                 for c in _changes(table.iterations[w], table.times[w], config)]
        found = _merge_job_wide(found, len(table.workers))
    return sorted(found, key=lambda f: (f.onset_iteration, f.worker))


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
