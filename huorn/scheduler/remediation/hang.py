"""C4D-style hang detection from per-rank collective sequence numbers and heartbeats.

In bulk-synchronous training every rank issues the same collectives in the same order, so each
rank's count of collectives entered and completed is a position on one shared timeline. When the
job stops, the positions say who stopped it:
- peers wait inside collective k while one rank never entered it: that rank hangs outside
  communication (compute, data loading, a deadlock in Python);
- one rank sits inside an earlier collective that its peers have long since entered too: it
  hangs inside communication (a stuck NIC or link, a frozen kernel);
- every rank entered collective k and none completed it: the collective itself hangs. The
  culprit is the end of the wait-for chain when the transport reports whom each rank waits for,
  else the rank whose heartbeat went stale, else the whole communicator is suspect.
Torch's watchdog only notices after 10 minutes and cannot name anybody; this needs one timeout.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

COMMUNICATION = "communication"
NON_COMMUNICATION = "non-communication"


@dataclasses.dataclass(frozen=True)
class RankSample:
    """What one rank's telemetry said; `heartbeat` is on the observer's clock (seconds)."""

    rank: int
    seq_entered: int
    seq_completed: int
    heartbeat: float
    step: int = 0
    waiting_on: int | None = None  # the peer this rank's open collective waits for, if known
    node: str | None = None
    moved_at: float | None = None  # when its sequence numbers last changed, by the rank's clock


@dataclasses.dataclass(frozen=True)
class HangFinding:
    kind: str  # communication | non-communication
    culprits: tuple[int, ...]  # empty when the communicator as a whole is suspect
    collective: int  # sequence number of the collective the job is stuck at
    stalled_for: float
    reason: str
    nodes: tuple[str, ...] = ()


def _follow_wait_chain(samples: dict[int, RankSample]) -> list[int]:
    """Ranks at the end of the wait-for chains: waited on, waiting on nobody (or on a cycle)."""
    sinks: set[int] = set()
    for start in samples:
        seen: list[int] = []
        rank: int | None = start
        while rank is not None and rank in samples and rank not in seen:
            seen.append(rank)
            rank = samples[rank].waiting_on
        if rank is None or rank not in samples:
            if len(seen) > 1:
                sinks.add(seen[-1])
        else:
            sinks.add(rank)  # a cycle: where it closes
    return sorted(sinks)


def _outside_ends(by_rank: dict[int, RankSample], starts: list[int], inside: set[int]) -> list[int]:
    """Ranks outside any operation that the wait-for chains from `starts` (ranks inside one) end at."""
    ends: set[int] = set()
    for start in starts:
        seen = [start]
        peer = by_rank[start].waiting_on
        while peer is not None and peer in by_rank and peer not in seen and peer in inside:
            seen.append(peer)
            peer = by_rank[peer].waiting_on
        if peer is not None and peer in by_rank and peer not in inside:
            ends.add(peer)
    return sorted(ends)


class HangDetector:
    """Remembers when each rank last moved, and judges a stall once it lasts `timeout` seconds."""

    def __init__(self, timeout: float, heartbeat_timeout: float | None = None) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout={timeout}: the hang timeout must be > 0 seconds (e.g. 30)")
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout if heartbeat_timeout is not None else timeout / 2
        self._position: dict[int, tuple[int, int]] = {}
        self._moved_at: dict[int, float] = {}

    def observe(self, samples: Iterable[RankSample], now: float) -> HangFinding | None:
        """Feed one poll of every rank's telemetry; return a finding once the job is hung."""
        by_rank = {s.rank: s for s in samples}
        if not by_rank:
            return None
        for rank, s in by_rank.items():
            position = (s.seq_entered, s.seq_completed)
            if rank not in self._position and s.moved_at is not None:
                # first sight (a restarted operator, a new detector): the rank says how long it
                # has been where it is, so a stall that began before is not timed afresh
                self._position[rank] = position
                self._moved_at[rank] = min(now, s.moved_at)
            elif self._position.get(rank) != position:
                self._position[rank] = position
                self._moved_at[rank] = now
        stalled_for = now - max(self._moved_at[r] for r in by_rank)
        if stalled_for < self.timeout:
            return None
        return classify_stall(by_rank.values(), stalled_for, now, self.heartbeat_timeout)


def classify_stall(
    samples: Iterable[RankSample], stalled_for: float, now: float, heartbeat_timeout: float
) -> HangFinding:
    """Name the culprit of a stall that has already lasted `stalled_for` seconds.

    NB: DDP launches one all-reduce per gradient bucket without waiting for the previous one,
    so healthy ranks run ahead to later sequence numbers while the culprit's stays behind. The
    lowest `entered` is therefore the culprit; whether it sits inside its collective
    (entered > completed) or outside (entered == completed) tells the two hang classes apart.
    Pipeline stages count different numbers of operations mid-step, so a lagging rank whose open
    receive names a peer outside any operation points at that peer instead.
    """
    by_rank = {s.rank: s for s in samples}
    k_max = max(s.seq_entered for s in by_rank.values())
    k_min = min(s.seq_entered for s in by_rank.values())
    inside = {r for r, s in by_rank.items() if s.seq_completed < s.seq_entered}
    stale = {r for r, s in by_rank.items() if now - s.heartbeat > heartbeat_timeout}

    def nodes_of(ranks: Iterable[int]) -> tuple[str, ...]:
        return tuple(sorted({n for r in ranks if (n := by_rank[r].node) is not None}))

    def alive(ranks: Iterable[int]) -> str:
        return "heartbeat stale: the process is frozen" if set(ranks) <= stale else "heartbeat alive"

    if k_min < k_max:
        lagging = sorted(r for r, s in by_rank.items() if s.seq_entered == k_min)
        # A pipeline's stages count different numbers of operations mid-step (padding aligns
        # the counts only at step ends), so the lowest count need not be the culprit: a
        # lagging stage inside a receive that names its peer waits on that peer, and a chain
        # that ends at a rank outside any operation names a rank hung outside communication.
        blocked_by = _outside_ends(by_rank, [r for r in lagging if r in inside], inside)
        if blocked_by:
            waiters = sorted(r for r in lagging if r in inside)
            return HangFinding(
                NON_COMMUNICATION, tuple(blocked_by), by_rank[blocked_by[0]].seq_entered + 1,
                stalled_for,
                f"rank(s) {waiters} wait inside operation #{k_min} on rank(s) {blocked_by}, outside any "
                f"operation: rank(s) {blocked_by} never entered its next one in {stalled_for:.1f}s "
                f"({alive(blocked_by)})",
                nodes_of(blocked_by),
            )
        if set(lagging) <= inside:
            return HangFinding(
                COMMUNICATION, tuple(lagging), k_min, stalled_for,
                f"rank(s) {lagging} stuck inside collective #{k_min} for {stalled_for:.1f}s while peers "
                f"went on to #{k_max} ({alive(lagging)})", nodes_of(lagging),
            )
        outside = [r for r in lagging if r not in inside]
        return HangFinding(
            NON_COMMUNICATION, tuple(outside), k_min + 1, stalled_for,
            f"peers wait inside collective #{k_min + 1}..#{k_max} for {stalled_for:.1f}s; rank(s) "
            f"{outside} never entered #{k_min + 1} ({alive(outside)})", nodes_of(outside),
        )
    if not inside:
        return HangFinding(
            NON_COMMUNICATION, tuple(sorted(by_rank)), k_max, stalled_for,
            f"no rank is inside a collective and none moved for {stalled_for:.1f}s after #{k_max}: "
            f"the whole job is stuck outside communication", nodes_of(by_rank),
        )
    if len(inside) < len(by_rank):
        outside = sorted(set(by_rank) - inside)
        return HangFinding(
            NON_COMMUNICATION, tuple(outside), k_max, stalled_for,
            f"ranks {sorted(inside)} wait inside collective #{k_max}; rank(s) {outside} completed it and "
            f"issued nothing for {stalled_for:.1f}s ({alive(outside)})", nodes_of(outside),
        )
    chain = _follow_wait_chain(by_rank)
    if chain:
        culprits, how = chain, "the end of the wait-for chain"
    elif stale and len(stale) < len(by_rank):
        culprits, how = sorted(stale), "its heartbeat stopped inside the collective"
    else:
        culprits, how = [], "no rank stands out: the communicator (links, switches) is suspect"
    return HangFinding(
        COMMUNICATION, tuple(culprits), k_max, stalled_for,
        f"all ranks entered collective #{k_max} and none completed it in {stalled_for:.1f}s; "
        f"culprit {culprits or 'unknown'}: {how}", nodes_of(culprits),
    )


def parse_runtime_telemetry(snapshot: dict, observed_at: float, node: str | None = None) -> RankSample:
    """Read one rank's `/telemetry` JSON (huorn.runtime.telemetry) into a RankSample.

    The runtime stamps its heartbeat with its own wall clock; `observed_at` is the observer's
    clock at the same moment, and on one host (or NTP-synchronised hosts) they agree closely
    enough for a heartbeat timeout of seconds.
    """
    try:
        collective = snapshot["collective"]
        steps = snapshot.get("steps") or []
        return RankSample(
            rank=int(snapshot["rank"]), seq_entered=int(collective["entered"]),
            seq_completed=int(collective["completed"]), heartbeat=float(snapshot["heartbeat"]),
            step=int(steps[-1]["step"]) if steps else 0, node=node,
            moved_at=float(collective["changed"]) if collective.get("changed") is not None else None,
            # the peer of its oldest open operation (a pipeline stage's receive names its
            # neighbour): where every rank waits inside one, the chain of these finds the sink
            waiting_on=int(collective["waiting_on"]) if collective.get("waiting_on") is not None else None,
        )
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"telemetry snapshot lacks a field the hang detector needs: {error!r}") from error
