"""C4D-style hang detection from per-rank collective sequence numbers and heartbeats.

In bulk-synchronous training every rank issues the same collectives in the same order, so each
rank's count of collectives entered and completed is a position on one shared timeline. When the
job stops, the positions say who stopped it:
- some ranks wait inside collective k while another never entered it: the latter hangs outside
  communication (compute, data loading, a deadlock in Python). It is the culprit;
- every rank entered collective k and none completed it: the collective itself hangs
  (a link, a NIC, a frozen device). The culprit is the end of the wait-for chain when the
  transport reports whom each rank waits for, else the rank whose heartbeat went stale (its
  process froze mid-collective), else the whole communicator is suspect.
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
            if self._position.get(rank) != position:
                self._position[rank] = position
                self._moved_at[rank] = now
        stalled_for = now - max(self._moved_at[r] for r in by_rank)
        if stalled_for < self.timeout:
            return None
        return classify_stall(by_rank.values(), stalled_for, now, self.heartbeat_timeout)


def classify_stall(
    samples: Iterable[RankSample], stalled_for: float, now: float, heartbeat_timeout: float
) -> HangFinding:
    """Name the culprit of a stall that has already lasted `stalled_for` seconds."""
    by_rank = {s.rank: s for s in samples}
    k = max(s.seq_entered for s in by_rank.values())
    inside = sorted(r for r, s in by_rank.items() if s.seq_entered == k and s.seq_completed < k)
    lagging = sorted(r for r, s in by_rank.items() if s.seq_entered < k)
    stale = sorted(r for r, s in by_rank.items() if now - s.heartbeat > heartbeat_timeout)

    def nodes_of(ranks: Iterable[int]) -> tuple[str, ...]:
        return tuple(sorted({n for r in ranks if (n := by_rank[r].node) is not None}))

    if lagging and inside:
        frozen = set(lagging) <= set(stale)
        why = "heartbeat stale too: the process is frozen" if frozen else "heartbeat alive"
        return HangFinding(
            NON_COMMUNICATION, tuple(lagging), k, stalled_for,
            f"ranks {inside} wait inside collective #{k} for {stalled_for:.1f}s; "
            f"rank(s) {lagging} never entered it ({why})", nodes_of(lagging),
        )
    if not inside:
        return HangFinding(
            NON_COMMUNICATION, tuple(sorted(by_rank)), k, stalled_for,
            f"no rank is inside a collective and none moved for {stalled_for:.1f}s after #{k}: "
            f"the whole job is stuck outside communication", nodes_of(by_rank),
        )
    chain = _follow_wait_chain(by_rank)
    if chain:
        culprits, how = chain, "the end of the wait-for chain"
    elif stale and len(stale) < len(by_rank):
        culprits, how = stale, "its heartbeat stopped inside the collective"
    else:
        culprits, how = [], "no rank stands out: the communicator (links, switches) is suspect"
    return HangFinding(
        COMMUNICATION, tuple(culprits), k, stalled_for,
        f"all ranks entered collective #{k} and none completed it in {stalled_for:.1f}s; "
        f"culprit {culprits or 'unknown'}: {how}", nodes_of(culprits),
    )
