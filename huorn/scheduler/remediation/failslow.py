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

A pipelined job (DP × PP) breaks two of those assumptions, so it has its own entry point,
`detect_pipeline_fail_slow`. A pod holds several stages, so the series are per rank, not per
pod. And in a pipeline a slow rank makes others wait: its neighbour stages in their
point-to-point receives, the other replicas in the data-parallel all-reduce. Those waits grow
exactly when the rank slows down, so they would read as a slow network. Waits are effects and
compute is the cause: a communication shift that coincides with a compute shift of a rank that
could have caused it is not reported. What remains is measured where a network fault shows and a
slow peer does not: a link between stages s and s+1 by the smaller of its two endpoints' receive
waits (a slow stage makes only the other endpoint wait, a slow link both), the all-reduce of
stage s by the smallest reduce wait over replicas (the last replica to arrive waits for nobody).
Behind a slow link every stage of the replica waits, so with three stages or more the waits name
the replica, not the link. Where the runtime publishes its links' own seconds per message, those
name it: only the slow link's messages take longer, in the direction that is slow.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from huorn.scheduler.remediation import bocd, steptable
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
    # pipelined jobs only (None elsewhere): the rank and its place, so that the ladder and S2,
    # whose unit is the pipeline replica, know which replica is slow. A link's `stage` is the
    # stage before it (None when it was judged on the waits of a replica of three stages or
    # more, which cannot tell its links apart: `_merge_links`); an all-reduce's or a stage-wide
    # finding's `replica` is None.
    rank: int | None = None
    replica: int | None = None
    stage: int | None = None
    link: bool = False  # communication between `stage` and `stage + 1` of `replica`
    # a link measured on its own messages (PipelineTable.send_link/grad_link): forward
    # (activations, stage → stage + 1), backward (gradients, stage + 1 → stage) or both; None
    # when only the waits were read, which cannot tell the directions apart
    direction: str | None = None

    def to_dict(self) -> dict[str, object]:
        found = dataclasses.asdict(self)
        if self.direction is None:
            del found["direction"]
        if not self.link:  # a DDP finding keeps the five fields `huorn detect` always printed
            del found["link"]
            for key in ("rank", "replica", "stage"):
                if found[key] is None:
                    del found[key]
        return found

    def where(self) -> str:
        """Where the slowdown is, in the words an operator reads in a decision's reason."""
        if self.link and self.stage is None:
            return f"the links between the stages of pipeline replica {self.replica}"
        if self.link and self.direction == "forward":
            return (f"the forward link (activations) from stage {self.stage} to stage "
                    f"{self.stage + 1} of pipeline replica {self.replica}")
        if self.link and self.direction == "backward":
            return (f"the backward link (gradients) from stage {self.stage + 1} to stage "
                    f"{self.stage} of pipeline replica {self.replica}")
        if self.link and self.direction == "both":
            return (f"both directions of the link between stage {self.stage} and stage "
                    f"{self.stage + 1} of pipeline replica {self.replica}")
        if self.link:
            return (f"the link from stage {self.stage} to stage {self.stage + 1} of pipeline "
                    f"replica {self.replica}")
        if self.rank is not None:
            return f"{self.worker} (rank {self.rank}: pipeline replica {self.replica}, stage {self.stage})"
        if self.stage is not None and self.kind == "communication":
            return f"the data-parallel all-reduce of stage {self.stage}"
        if self.stage is not None:
            return f"stage {self.stage} of every pipeline replica"
        return self.worker


def _changes(
    iterations: np.ndarray, series: np.ndarray, config: bocd.BocdConfig
) -> list[tuple[int, int, float]]:
    if len(series) < config.warmup + config.validate:
        return []
    found = bocd.detect_changes(np.maximum(series, 1e-6), config)
    return [(int(iterations[c.onset]), int(iterations[c.detected_at]), c.factor) for c in found]


def _merge_job_wide(found: list[SlowFinding], workers: list[str],
                    host_of: Mapping[str, str] | None = None) -> list[SlowFinding]:
    """Collapse shifts that hit at least half of the hosts at once into one job-wide finding. A
    host is what `host_of` maps a worker to (a pod running one rank per GPU), else the worker: all
    the ranks of one slow pod are one host slowing down, not half of a two-pod job."""
    host = (lambda w: host_of.get(w, w)) if host_of else (lambda w: w)
    hosts = len({host(w) for w in workers})
    if hosts < 2:
        return found

    def merge(group: list[SlowFinding]) -> SlowFinding | None:
        slowed = len({host(f.worker) for f in group})
        if slowed * 2 >= hosts and slowed >= 2:
            return SlowFinding(JOB_WIDE, "job-wide", *_group_span(group))
        return None

    return _merge_concurrent(found, lambda f: f.onset_iteration, merge)


def _merge_concurrent(found: list[SlowFinding], order: Callable[[SlowFinding], Any],
                      merge: Callable[[list[SlowFinding]], SlowFinding | None]) -> list[SlowFinding]:
    """Walk the shifts in `order`; those within ONSET_TOLERANCE of the earliest left, and in the
    same direction, form a group. `merge(group)` gives one finding for the whole group, or None
    to keep the earliest alone and look at the others again: every merge rule of this module
    (job-wide, per replica, per link) is a different `merge` over the same grouping."""
    result: list[SlowFinding] = []
    pending = sorted(found, key=order)
    while pending:
        head = pending[0]
        group = [f for f in pending if abs(f.onset_iteration - head.onset_iteration) <= ONSET_TOLERANCE
                 and (f.factor > 1) == (head.factor > 1)]
        merged = merge(group)
        if merged is None:
            result.append(head)
            pending = pending[1:]
        else:
            result.append(merged)
            pending = [f for f in pending if f not in group]
    return result


def _group_span(group: list[SlowFinding]) -> tuple[int, int, float]:
    """A merged finding's onset (the median's lower), detection (the last) and factor (median)."""
    return (int(statistics.median_low([f.onset_iteration for f in group])),
            max(f.detected_iteration for f in group), float(np.median([f.factor for f in group])))


def _iteration_seconds(table: StepTable) -> np.ndarray:
    """The job's step time per iteration: the slowest worker's busy time sets the pace."""
    by_iteration: dict[int, float] = {}
    for w in table.workers:
        for it, t in zip(table.iterations[w], table.times[w], strict=True):
            by_iteration[int(it)] = max(by_iteration.get(int(it), 0.0), float(t))
    return np.array([by_iteration[i] for i in sorted(by_iteration)])


def _rise(iterations: np.ndarray, series: np.ndarray, finding: SlowFinding, since: int | None = None
          ) -> float:
    """Seconds a step that the shift added: the median of 20 steps from its onset less that of
    up to 100 before it, from `since` on (NaN when either side is empty)."""
    before = series[(iterations < finding.onset_iteration)
                    & (iterations >= (since if since is not None else -math.inf))][-100:]
    after = series[iterations >= finding.onset_iteration][:20]
    if len(before) == 0 or len(after) == 0:
        return math.nan
    return float(np.median(after)) - float(np.median(before))


def _validated(iterations: np.ndarray, series: np.ndarray, changes: list[tuple[int, int, float]],
               finding_of: Callable[[tuple[int, int, float]], SlowFinding], step_seconds: float,
               min_shift: float) -> list[tuple[SlowFinding, float]]:
    """The changes of one series that FALCON validates on iteration time, with each one's rise: a
    shift in one part counts only if it moves the whole step by min_shift (a 2× jitter in a 1 ms
    wait is not a fail-slow). Each change is measured from the last validated change before it.
    NB: measured across it, a straggler's return to 2× after 4× was set against a median of
    healthy, 4× and 2× steps, near 2× itself, and dropped: 4× → 2× → 4× → 2× read as a slowdown
    that eased, worsened and stayed at 4×. Measured from the last change BOCD found, validated
    or not, a burst of a few steps (its rise dropped, its 20 steps mostly past it) left its fall
    to be measured against the burst alone: a lone easing that never happened."""
    found: list[tuple[SlowFinding, float]] = []
    since: int | None = None
    for change in changes:
        finding = finding_of(change)
        rise = _rise(iterations, series, finding, since)
        if not math.isnan(rise) and abs(rise) >= min_shift * step_seconds:
            found.append((finding, rise))
            since = finding.onset_iteration
    return found


def detect_fail_slow(table: StepTable, config: bocd.BocdConfig | None = None,
                     host_of: Mapping[str, str] | None = None) -> list[SlowFinding]:
    """Return the validated slowdowns (and recoveries) in the table, ordered by onset.
    `host_of`: the pod of each worker where a pod runs several (_merge_job_wide)."""
    config = config or bocd.BocdConfig()
    if table.compute is None or table.comm is None:
        found = [SlowFinding(w, "compute", *c) for w in table.workers
                 for c in _changes(table.iterations[w], table.times[w], config)]
        return sorted(_merge_job_wide(found, list(table.workers), host_of),
                      key=lambda f: (f.onset_iteration, f.worker))
    step_seconds = float(np.median(_iteration_seconds(table)))
    compute = [f for w in table.workers
               for f, _ in _validated(table.iterations[w], table.compute[w],
                                      _changes(table.iterations[w], table.compute[w], config),
                                      lambda c, w=w: SlowFinding(w, "compute", *c),
                                      step_seconds, config.min_shift)]
    # NB: per-rank comm time is mostly waiting for the slowest peer, so it is noisy and moves
    # whenever anybody computes slowly. The last rank to arrive waits for nobody: the minimum
    # over ranks is the collective's own latency, and that is what a slow network raises.
    iterations, comm = _min_comm(table)
    network = [f for f, _ in _validated(iterations, comm, _changes(iterations, comm, config),
                                        lambda c: SlowFinding(JOB_WIDE, "communication", *c), step_seconds,
                                        config.min_shift)]
    found = _merge_job_wide(compute, list(table.workers), host_of) + network
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


# -- pipelined jobs (DP × PP) -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PipelineRank:
    """Where one rank sits: the instance (pod, agent) that runs it, which S4 would replace."""

    instance: str
    rank: int
    replica: int
    stage: int


@dataclasses.dataclass(frozen=True)
class LinkSeries:
    """One outgoing link of one rank, per step (aligned with the rank's steps): seconds each
    message held the link, and how many it carried."""

    seconds_per_message: np.ndarray
    messages: np.ndarray

    def seconds(self) -> np.ndarray:
        """Seconds a step the link was busy: what a slower link adds to the pipeline's step,
        which is what FALCON's validation on iteration time weighs."""
        return self.seconds_per_message * self.messages


@dataclasses.dataclass
class PipelineTable:
    """Per-rank series of a pipelined job: `steps` has one worker per rank (keyed as in `ranks`)
    with its compute/comm split; `recv_wait` and `reduce_wait` are the parts of comm that the
    pipeline trainer publishes apart (None from a runtime that does not); `send_link` and
    `grad_link` are each rank's outgoing links, to the next stage and to the previous (a rank
    without that link, or whose runtime does not publish it, is absent)."""

    steps: StepTable
    ranks: dict[str, PipelineRank]
    recv_wait: dict[str, np.ndarray] | None = None
    reduce_wait: dict[str, np.ndarray] | None = None
    send_link: dict[str, LinkSeries] = dataclasses.field(default_factory=dict)
    grad_link: dict[str, LinkSeries] = dataclasses.field(default_factory=dict)


def build_pipeline_table(records: Mapping[str, Sequence[tuple[int, Mapping[str, Any]]]],
                         ranks: Mapping[str, PipelineRank]) -> PipelineTable | None:
    """The detector's table from each rank's (step, step record) pairs in step order: the
    compute/comm split, and, from a runtime that publishes them, the receive and reduce waits
    apart and each rank's outgoing links. The waits tell a slow peer from a slow link, and the
    links say which link; a rank whose records lack a link (the first stage sends no gradients,
    the last no activations, an older runtime neither) is left out of that link's series."""
    records = {w: recs for w, recs in records.items() if recs}
    rows = [{"iteration": step, "worker": w, "time": r["step_seconds"],
             "compute": r["compute_seconds"], "comm": r["comm_seconds"]}
            for w, recs in records.items() for step, r in recs]
    if not rows:
        return None
    table = PipelineTable(steptable.build_table(rows, (*steptable.REQUIRED, *steptable.OPTIONAL)),
                          {w: ranks[w] for w in records})
    if all("recv_wait_seconds" in r and "reduce_wait_seconds" in r
           for recs in records.values() for _, r in recs):
        table.recv_wait = {w: np.array([r["recv_wait_seconds"] for _, r in recs], dtype=float)
                           for w, recs in records.items()}
        table.reduce_wait = {w: np.array([r["reduce_wait_seconds"] for _, r in recs], dtype=float)
                             for w, recs in records.items()}
    for name, links in (("send_link", table.send_link), ("grad_link", table.grad_link)):
        for w, recs in records.items():
            if all(f"{name}_seconds_per_message" in r for _, r in recs):
                links[w] = LinkSeries(
                    np.array([r[f"{name}_seconds_per_message"] for _, r in recs], dtype=float),
                    np.array([r.get(f"{name}_messages", 1) for _, r in recs], dtype=float))
    return table


def detect_pipeline_fail_slow(table: PipelineTable,
                              config: bocd.BocdConfig | None = None) -> list[SlowFinding]:
    """Return the validated slowdowns (and recoveries) of a pipelined job, ordered by onset:
    ranks slow in compute by name and place, links and all-reduces slow on their own."""
    config = config or bocd.BocdConfig()
    steps = table.steps
    if steps.compute is None or steps.comm is None:
        raise ValueError("a pipelined job's table needs the compute and comm columns")
    step_seconds = float(np.median(_iteration_seconds(steps)))
    compute = []
    for w in steps.workers:
        where = table.ranks[w]
        compute += [f for f, _ in _validated(
            steps.iterations[w], steps.compute[w], _changes(steps.iterations[w], steps.compute[w], config),
            lambda c, where=where: SlowFinding(where.instance, "compute", *c, rank=where.rank,
                                               replica=where.replica, stage=where.stage),
            step_seconds, config.min_shift)]
    replicas = len({p.replica for p in table.ranks.values()})
    compute = _merge_pipeline(compute, replicas)
    network = [f for f in _pipeline_network(table, config, step_seconds) if not _explained(f, compute)]
    return sorted(compute + network,
                  key=lambda f: (f.onset_iteration, f.worker, -1 if f.rank is None else f.rank))


def _merge_pipeline(found: list[SlowFinding], replicas: int) -> list[SlowFinding]:
    """Collapse shifts that hit at least half of the pipeline replicas (two at least) at once.

    The unit is the replica, not the rank: a replica slow as a whole is all its stages, which in
    a job of two replicas is half the ranks, and it must stay a named replica for S2. A shift on
    one stage of most replicas is that stage's (S3's case); one on several stages is job-wide."""

    def merge(group: list[SlowFinding]) -> SlowFinding | None:
        hit = {f.replica for f in group}
        if len(hit) < 2 or len(hit) * 2 < replicas:
            return None
        stages = {f.stage for f in group}
        stage = stages.pop() if len(stages) == 1 else None
        return SlowFinding(JOB_WIDE, "job-wide" if stage is None else "compute", *_group_span(group),
                           stage=stage)

    return _merge_concurrent(found, lambda f: (f.onset_iteration, f.rank or 0), merge)


CAUSE_LAG = 3  # steps a cause's onset may be placed after its effect's (BOCD's onsets jitter)


def _explained(network: SlowFinding, compute: list[SlowFinding]) -> bool:
    """Whether a compute shift at the same time could have made these ranks wait: a rank of the
    same replica for a link (a stage waits only for its own pipeline's stages; and on NCCL a
    send waits for its receive to be posted, so a slow stage lengthens its incoming links' own
    seconds per message too), any rank for an all-reduce or a job-wide figure (every replica
    waits for the slowest).

    A link measured on its own messages is explained only by its receiver: the sender computes
    before it sends, so its own slowdown cannot lengthen a message. And no cause begins well after
    its effect. NB: both happened in one run of the slow-link test (2026-12-03): the sender of a
    slowed gradient link, a last stage, computed 3.6× slower from 6 steps after the link's onset
    (the host's load), and that took the link's finding away."""
    return any(-ONSET_TOLERANCE <= c.onset_iteration - network.onset_iteration <= CAUSE_LAG
               and (c.factor > 1) == (network.factor > 1)
               and (network.replica is None or c.replica is None or c.replica == network.replica)
               and _could_delay(c, network)
               for c in compute)


def _could_delay(cause: SlowFinding, link: SlowFinding) -> bool:
    """Whether a compute finding's stage receives on the link that `link` measured itself."""
    if not link.link or link.direction is None or link.stage is None or cause.stage is None:
        return True  # judged on waits, or a stage-wide or job-wide cause: any stage may be it
    receivers = {"forward": {link.stage + 1}, "backward": {link.stage},
                 "both": {link.stage, link.stage + 1}}[link.direction]
    return cause.stage in receivers


def _pipeline_network(table: PipelineTable, config: bocd.BocdConfig,
                      step_seconds: float) -> list[SlowFinding]:
    steps = table.steps
    assert steps.comm is not None
    found: list[SlowFinding] = []

    # NB: a wait or a link's time is near zero while healthy, where sub-millisecond jitter is a
    # 30× swing in the log space BOCD works in: two such spikes merged by the median-of-three into
    # a short plateau at the end of the warm-up started a run that then absorbed a real 20 ms
    # shift for good (1 run in ~12 of tests/test_remediation_failslow_link_local.py). Below half
    # of min_shift of the step such a part cannot decide a finding, so BOCD sees it floored
    # there; every shift that could move the step by min_shift still rises at least 2× above it.
    floor = config.min_shift / 2 * step_seconds

    def detect(series: tuple[np.ndarray, np.ndarray], into: list[SlowFinding] | None = None,
               rises: list[float] | None = None, **where: object) -> None:
        """The series' validated changes into `into` (or `found`), and their rises into `rises`."""
        iterations, values = series
        for finding, rise in _validated(
                iterations, values, _changes(iterations, np.maximum(values, floor), config),
                lambda c: SlowFinding(JOB_WIDE, "communication", *c, **where),  # type: ignore[arg-type]
                step_seconds, config.min_shift):
            (found if into is None else into).append(finding)
            if rises is not None:
                rises.append(rise)

    if table.recv_wait is None or table.reduce_wait is None:
        # NB: a runtime that publishes only the sum cannot tell a stage's wait for its neighbour
        # from its replica's wait for another replica; the DDP rule on the sum, with the
        # explanation rule applied to every rank, is the most that can be said
        detect(_per_iteration(steps, steps.comm, steps.workers, min))
        return found
    at = {(p.replica, p.stage): w for w, p in table.ranks.items()}
    stages = sorted({p.stage for p in table.ranks.values()})
    for replica in sorted({p.replica for p in table.ranks.values()}):
        pairs = [(at.get((replica, stage)), at.get((replica, stage + 1))) for stage in stages[:-1]]
        if all(first in table.send_link and second in table.grad_link for first, second in pairs):
            # every link's own time, on the rank that sends it, which only a slow link (or on
            # NCCL a late receiver, which the explanation rule covers) makes longer. The waits
            # are not read then: they grow behind any slow link, and a wait that validated a
            # tick before the link's own shift would take the decision with a vaguer name.
            measured: list[SlowFinding] = []
            rises: list[float] = []
            for stage, (first, second) in zip(stages, pairs, strict=False):
                for links, sender, direction in ((table.send_link, first, "forward"),
                                                 (table.grad_link, second, "backward")):
                    series = _per_iteration(steps, {sender: links[sender].seconds()}, [sender], min)  # type: ignore[index]
                    detect(series, measured, rises, replica=replica, stage=stage, link=True,
                           direction=direction)
            found += _merge_directions(_without_late_receivers(measured, rises))
            continue
        waits: list[SlowFinding] = []
        for stage, ends in zip(stages, pairs, strict=False):
            if None not in ends:
                detect(_per_iteration(steps, table.recv_wait, list(ends), min), waits,  # type: ignore[arg-type]
                       replica=replica, stage=stage, link=True)
        found += _merge_links(waits, len(pairs))
    for stage in stages:
        group = [w for w, p in table.ranks.items() if p.stage == stage]
        if len(group) >= 2:
            detect(_per_iteration(steps, table.reduce_wait, group, min), stage=stage)
    return found


LATE_RECEIVER_SHARE = 0.25  # of the slow link's own rise: below it, a concurrent link's rise is its effect


def _without_late_receivers(found: list[SlowFinding], rises: list[float]) -> list[SlowFinding]:
    """Drop the link shifts of a replica that a much larger concurrent one explains.

    A send completes only once its receiver takes it (gloo; NCCL for large messages), so behind
    one slow link the other links of the replica take longer too: their receivers post later,
    having waited for the slow link themselves. Measured on the local backend (3 stages, rank 1's
    forward link held back 20 ms a message, a loaded 2-core machine): the slowed link's seconds a
    step rose by the delay, the backward links' by 1-3 ms a message, enough on some runs to
    validate, and to take the decision with the wrong link's name. A link that shifted with less
    than a quarter of a concurrent link's rise is taken as its effect; a cable slow both ways
    raises both directions alike, and both stay (`_merge_directions` makes them one)."""
    return [f for f, rise in zip(found, rises, strict=True)
            if not any(_together(f, g) and abs(rise) < LATE_RECEIVER_SHARE * abs(other)
                       for g, other in zip(found, rises, strict=True) if g is not f)]


def _together(a: SlowFinding, b: SlowFinding) -> bool:
    return abs(a.onset_iteration - b.onset_iteration) <= ONSET_TOLERANCE and (a.factor > 1) == (b.factor > 1)


def _merge_directions(found: list[SlowFinding]) -> list[SlowFinding]:
    """Both directions of one link that shifted together are one finding: a slow cable or NIC
    slows both ways, and two decisions for one fault would climb the ladder twice."""
    result: list[SlowFinding] = []
    for f in found:
        twin = next((g for g in result if g.stage == f.stage and g.direction != f.direction
                     and _together(f, g)), None)
        if twin is None:
            result.append(f)
        else:
            result[result.index(twin)] = dataclasses.replace(
                twin, direction="both", onset_iteration=min(f.onset_iteration, twin.onset_iteration),
                detected_iteration=max(f.detected_iteration, twin.detected_iteration),
                factor=float(np.median([f.factor, twin.factor])))
    return result


def _merge_links(found: list[SlowFinding], links: int) -> list[SlowFinding]:
    """One replica's link findings from the waits, given how many links the replica has: with
    more than one, those that shifted together become one finding with no stage named.

    A slow link delays the whole pipeline's critical path, so with three stages or more every
    stage of the replica waits longer, the far links' endpoints too: the waits name the replica
    but not which of its links. That holds for a link whose waits validated alone as well. The
    waits of a link away from the slow one grow less (the delay partly fills slack that its
    stages had), so under load they may miss validation, and the link left need not be the slow
    one: on one local run with the backward link from stage 2 to stage 1 slowed, only the waits
    of the link from stage 0 to stage 1 validated. With one link (two stages) the waits name it.
    A runtime that publishes its links' seconds per message names the link
    (`_merge_directions`); this is what is left without them."""
    if links <= 1:
        return found

    def merge(group: list[SlowFinding]) -> SlowFinding:
        return dataclasses.replace(group[0], stage=None, factor=float(np.median([f.factor for f in group])),
                                   detected_iteration=max(f.detected_iteration for f in group))

    return _merge_concurrent(found, lambda f: f.onset_iteration, merge)


def _per_iteration(steps: StepTable, series: Mapping[str, np.ndarray], workers: list[str],
                   reduce: Callable[[list[float]], float]) -> tuple[np.ndarray, np.ndarray]:
    """One figure per iteration over `workers`, on the iterations every one of them reported."""
    by_iteration: dict[int, list[float]] = {}
    for w in workers:
        for it, v in zip(steps.iterations[w], series[w], strict=True):
            by_iteration.setdefault(int(it), []).append(float(v))
    iterations = np.array(sorted(i for i, v in by_iteration.items() if len(v) == len(workers)), dtype=int)
    return iterations, np.array([reduce(by_iteration[int(i)]) for i in iterations], dtype=float)
