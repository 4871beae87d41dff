"""Pipeline schedules as explicit tables: for each stage, the ordered list of forward (F) and
backward (B) actions on micro-batches.

Tables rather than generators, because a table can be printed, checked, drawn and handed to
the planner's cost model as plain data before a single tensor moves. GPipe, 1F1B and kFkB are
all one construction: micro-batches are cut into groups of k, and each stage runs a 1F1B order
over groups. Stage s warms up with S−s−1 groups of forwards, then alternates one group of
forwards with one group of backwards, then drains. k = 1 is 1F1B; k ≥ M is GPipe (one group).
Peak in-flight micro-batches on stage s are k·(S−s), the Ada-Grouper memory trade-off."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

ActionKind = Literal["F", "B"]
SCHEDULE_NAMES = ("gpipe", "1f1b", "kfkb")


class ScheduleError(ValueError):
    """A table that breaks an invariant; the message names the stage, action and rule."""


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    microbatches: int
    k: int
    table: tuple[tuple[Action, ...], ...]

    def describe(self) -> str:
        """One line per stage, e.g. `stage 0: F0 F1 B0 F2 B1 ...`, for logs and debugging."""
        return "\n".join(f"stage {s}: " + " ".join(map(str, row)) for s, row in enumerate(self.table))

    def to_plain(self) -> list[list[tuple[str, int]]]:
        """The table as lists of (kind, micro-batch): what the scheduler's cost model reads."""
        return [[(a.kind, a.microbatch) for a in row] for row in self.table]


def build_schedule(name: str, stages: int, microbatches: int, k: int = 1) -> Schedule:
    """The table of `name` (gpipe, 1f1b, kfkb) for `stages` stages and `microbatches` micro-batches."""
    if stages < 1:
        raise ScheduleError(f"stages must be >= 1, got {stages}")
    if microbatches < 1:
        raise ScheduleError(f"microbatches must be >= 1, got {microbatches}")
    if name == "gpipe":
        group = microbatches
    elif name == "1f1b":
        group = 1
    elif name == "kfkb":
        if k < 1:
            raise ScheduleError(f"k must be >= 1 for kfkb, got {k}; k = 1 is 1F1B")
        group = min(k, microbatches)
    else:
        raise ScheduleError(f"schedule name must be one of {', '.join(SCHEDULE_NAMES)}; got {name!r}")
    groups = [list(range(start, min(start + group, microbatches))) for start in range(0, microbatches, group)]
    table = tuple(tuple(_order_stage(stage, stages, groups)) for stage in range(stages))
    schedule = Schedule(name=name, stages=stages, microbatches=microbatches, k=group, table=table)
    check_schedule(schedule)
    return schedule


def _order_stage(stage: int, stages: int, groups: list[list[int]]) -> list[Action]:
    warmup = min(stages - stage - 1, len(groups))
    order: list[Action] = [Action("F", m) for g in groups[:warmup] for m in g]
    backward = 0
    for forward in range(warmup, len(groups)):
        order += [Action("F", m) for m in groups[forward]]
        order += [Action("B", m) for m in groups[backward]]
        backward += 1
    for g in groups[backward:]:
        order += [Action("B", m) for m in g]
    return order


def check_schedule(schedule: Schedule) -> None:
    """Raise ScheduleError unless every stage runs each micro-batch's F once, then its B once,
    micro-batches enter every stage in the same order (point-to-point messages match in order),
    and the cross-stage dependencies can all be met (no deadlock)."""
    if len(schedule.table) != schedule.stages:
        raise ScheduleError(f"table has {len(schedule.table)} rows for {schedule.stages} stages")
    expected = list(range(schedule.microbatches))
    for stage, row in enumerate(schedule.table):
        seen_forward: set[int] = set()
        seen_backward: set[int] = set()
        for position, action in enumerate(row):
            done = seen_forward if action.kind == "F" else seen_backward
            if action.microbatch in done:
                raise ScheduleError(f"stage {stage} position {position}: {action} runs twice")
            if action.kind == "B" and action.microbatch not in seen_forward:
                raise ScheduleError(f"stage {stage} position {position}: {action} runs before its forward")
            done.add(action.microbatch)
        for kind in ("F", "B"):
            order = [a.microbatch for a in row if a.kind == kind]
            if sorted(order) != expected:
                raise ScheduleError(f"stage {stage}: {kind} covers micro-batches {sorted(order)}, "
                                    f"expected each of 0..{schedule.microbatches - 1} once")
            if order != expected:
                raise ScheduleError(f"stage {stage}: {kind} order {order} is not ascending; neighbours "
                                    "would receive messages in a different order than they were sent")
    stuck = find_deadlock(schedule)
    if stuck:
        raise ScheduleError("deadlock: " + "; ".join(stuck))


def simulate_timeline(schedule: Schedule, forward_s: float = 1.0, backward_s: float = 2.0,
                      ) -> list[list[tuple[Action, float, float]]] | None:
    """(action, start, end) per stage when every stage runs its row in order as soon as the
    message it needs has arrived (sends never block: the executor sends from a link thread).
    None when the stages stop with work left, which is a deadlock."""
    stages = schedule.stages
    position = [0] * stages
    clock = [0.0] * stages
    finished: dict[tuple[str, int, int], float] = {}
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(stages)]
    progress = True
    while progress:
        progress = False
        for stage in range(stages):
            while position[stage] < len(schedule.table[stage]):
                action = schedule.table[stage][position[stage]]
                ready = _ready_time(action, stage, stages, finished)
                if ready is None:
                    break
                start = max(clock[stage], ready)
                end = start + (forward_s if action.kind == "F" else backward_s)
                finished[(action.kind, stage, action.microbatch)] = end
                timeline[stage].append((action, start, end))
                clock[stage] = end
                position[stage] += 1
                progress = True
    if any(position[s] < len(schedule.table[s]) for s in range(stages)):
        return None
    return timeline


def _ready_time(action: Action, stage: int, stages: int, finished: dict[tuple[str, int, int], float]
                ) -> float | None:
    """When the input of `action` is available, or None if its producer has not run yet."""
    if action.kind == "F":
        return 0.0 if stage == 0 else finished.get(("F", stage - 1, action.microbatch))
    if ("F", stage, action.microbatch) not in finished:
        return None
    return 0.0 if stage == stages - 1 else finished.get(("B", stage + 1, action.microbatch))


def find_deadlock(schedule: Schedule) -> list[str]:
    """Descriptions of the actions each stuck stage waits on; empty when the table completes."""
    if simulate_timeline(schedule) is not None:
        return []
    done: set[tuple[str, int, int]] = set()
    position = [0] * schedule.stages
    changed = True
    while changed:
        changed = False
        for stage, row in enumerate(schedule.table):
            while position[stage] < len(row):
                action = row[position[stage]]
                need = _needed(action, stage, schedule.stages)
                if need is not None and need not in done:
                    break
                done.add((action.kind, stage, action.microbatch))
                position[stage] += 1
                changed = True
    stuck = []
    for stage, row in enumerate(schedule.table):
        if position[stage] < len(row):
            action = row[position[stage]]
            need = _needed(action, stage, schedule.stages)
            waits = f"{need[0]}{need[2]} of stage {need[1]}" if need else "nothing"
            stuck.append(f"stage {stage} blocks at {action} waiting for {waits}")
    return stuck


def _needed(action: Action, stage: int, stages: int) -> tuple[str, int, int] | None:
    if action.kind == "F":
        return None if stage == 0 else ("F", stage - 1, action.microbatch)
    return None if stage == stages - 1 else ("B", stage + 1, action.microbatch)


def count_in_flight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward ran and backward has not: the number of
    activation sets a stage holds at its peak, which the memory model multiplies by their size."""
    peaks = []
    for row in schedule.table:
        live = peak = 0
        for action in row:
            live += 1 if action.kind == "F" else -1
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def build_candidates(stages: int, microbatches: int, ks: Sequence[int]) -> dict[int, Schedule]:
    """kFkB tables for each distinct effective k (k above M collapses to GPipe's single group)."""
    return {min(k, microbatches): build_schedule("kfkb", stages, microbatches, k) for k in ks}


# --- lockstep exchanges ------------------------------------------------------------------------
# In lockstep mode (executor `comm="lockstep"`) a stage does not send from a link in the
# background. Between two actions it posts ONE batched exchange that holds the sends of the
# action it just ran and the receives of the action it runs next, and its compute waits for the
# whole exchange, as torch.distributed.pipelining's schedules do. No NCCL kernel then runs beside
# a GEMM, which is what a fast link (NVLink) wants. The price is that every exchange is a
# rendezvous with the neighbours, so the pairing must be checked: one rank's exchanges run one
# after another (one NCCL stream), and an exchange finishes only once every peer has posted the
# exchange holding the matching operation.


@dataclass(frozen=True)
class Transfer:
    """One point-to-point operation of an exchange. `kind` F is an activation (to stage + 1),
    B a gradient (to stage − 1); `peer` is the other stage."""

    op: Literal["send", "recv"]
    kind: ActionKind
    peer: int
    microbatch: int

    def __str__(self) -> str:
        arrow = "→" if self.op == "send" else "←"
        return f"{self.op} {self.kind}{self.microbatch} {arrow} stage {self.peer}"


Exchanges = tuple[tuple[tuple[Transfer, ...], ...], ...]


@functools.lru_cache(maxsize=64)
def lockstep_exchanges(schedule: Schedule) -> Exchanges:
    """Per stage, len(row) + 1 exchanges: exchange i runs right before action i (the last one
    after the final action). Each holds action i's receive and the sends that are ready.

    A send first goes into the exchange right after the action that produced it, which is
    torch's pairing for 1F1B (send F_i with the receive of the B that follows). In kFkB with
    k > 1 that rendezvous can be a cycle: stage 0 waits to hand F2 to stage 1, which waits to
    hand B1 to stage 0. Such a send is deferred to the stage's next exchange, with every later
    send in its direction (messages match in order), until the table runs through
    `find_lockstep_deadlock`. ScheduleError when no deferral helps."""
    last = schedule.stages - 1
    exchanges: list[list[list[Transfer]]] = []
    for stage, row in enumerate(schedule.table):
        per_stage: list[list[Transfer]] = []
        previous: Action | None = None
        for action in [*row, None]:
            ops: list[Transfer] = []
            if previous is not None:
                if previous.kind == "F" and stage < last:
                    ops.append(Transfer("send", "F", stage + 1, previous.microbatch))
                elif previous.kind == "B" and stage > 0:
                    ops.append(Transfer("send", "B", stage - 1, previous.microbatch))
            if action is not None:
                if action.kind == "F" and stage > 0:
                    ops.append(Transfer("recv", "F", stage - 1, action.microbatch))
                elif action.kind == "B" and stage < last:
                    ops.append(Transfer("recv", "B", stage + 1, action.microbatch))
            per_stage.append(ops)
            previous = action
        exchanges.append(per_stage)
    for _ in range(sum(len(row) for row in schedule.table) ** 2):
        blocked = _lockstep_blocked(exchanges)
        if not blocked:
            return tuple(tuple(tuple(ops) for ops in per_stage) for per_stage in exchanges)
        # defer the one send whose receive is furthest ahead on its peer: that peer has the
        # most work to do before it can take the message, so holding it back costs least
        where = _exchange_index(exchanges)
        reached = {stage: index for stage, index, _ in blocked}
        candidates = [(where[(t.peer, "recv", t.kind, t.microbatch)]
                       - reached.get(t.peer, len(exchanges[t.peer])), stage, index, t)
                      for stage, index, unmatched in blocked for t in unmatched
                      if t.op == "send" and index + 1 < len(exchanges[stage])]
        if not candidates:
            break
        _, stage, index, send = max(candidates, key=lambda c: (c[0], -c[1]))
        ops = exchanges[stage][index]
        deferred = [t for t in ops if t.op == "send" and t.kind == send.kind]
        exchanges[stage][index] = [t for t in ops if t not in deferred]
        exchanges[stage][index + 1][:0] = deferred
    stuck = describe_blocked(exchanges)
    raise ScheduleError(f"{schedule.name} k={schedule.k} cannot run in lockstep: " + "; ".join(stuck))


def find_lockstep_deadlock(schedule: Schedule, exchanges: Exchanges | None = None) -> list[str]:
    """What each stuck stage waits for when `exchanges` (default: `lockstep_exchanges`) run;
    empty when the table completes.

    Strict semantics (NCCL): a rank runs exchange, action, exchange, ... one after another; an
    exchange ends when each of its operations is matched by the peer's operation and the peer
    has reached the exchange that holds it. Eager buffering of small sends is not assumed, so
    exchanges that pass here cannot hang on any transport."""
    if exchanges is None:
        try:
            exchanges = lockstep_exchanges(schedule)
        except ScheduleError as error:
            return [str(error)]
    as_lists = [[list(ops) for ops in per_stage] for per_stage in exchanges]
    return describe_blocked(as_lists)


def describe_blocked(exchanges: Sequence[Sequence[Sequence[Transfer]]]) -> list[str]:
    return [f"stage {stage} blocks at exchange {index} waiting for [{', '.join(map(str, ops))}]"
            for stage, index, ops in _lockstep_blocked(exchanges)]


def _lockstep_blocked(exchanges: Sequence[Sequence[Sequence[Transfer]]]
                      ) -> list[tuple[int, int, list[Transfer]]]:
    """(stage, exchange index, unmatched operations) for every stage that cannot finish."""
    where = _exchange_index(exchanges)
    partner = {"send": "recv", "recv": "send"}
    position = [0] * len(exchanges)  # 2·i: exchange i pending; 2·i + 1: action i pending
    finish = [2 * len(per_stage) - 1 for per_stage in exchanges]

    def unmatched(stage: int) -> list[Transfer]:
        ops = exchanges[stage][position[stage] // 2]
        return [t for t in ops
                if position[t.peer] < 2 * where.get((t.peer, partner[t.op], t.kind, t.microbatch), 1 << 30)]

    changed = True
    while changed:
        changed = False
        for stage in range(len(exchanges)):
            while position[stage] < finish[stage]:
                if position[stage] % 2 == 0 and unmatched(stage):
                    break
                position[stage] += 1
                changed = True
    return [(stage, position[stage] // 2, unmatched(stage))
            for stage in range(len(exchanges)) if position[stage] < finish[stage]]


def _exchange_index(exchanges: Sequence[Sequence[Sequence[Transfer]]]
                    ) -> dict[tuple[int, str, str, int], int]:
    """(stage, op, kind, micro-batch) -> the index of the exchange that holds it."""
    return {(stage, t.op, t.kind, t.microbatch): index
            for stage, per_stage in enumerate(exchanges) for index, ops in enumerate(per_stage) for t in ops}
