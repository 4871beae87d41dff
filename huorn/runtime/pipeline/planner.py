"""Adaptive k for kFkB pipeline schedules (Ada-Grouper), decided from measurements.

The cost model replays a schedule table as a discrete-event simulation: each stage runs its
row in order; an action starts when the stage is free and its input has arrived; every
message occupies its link (one FIFO per direction of each edge) for the measured seconds per
message. That captures the whole trade-off: with k = 1 each micro-batch's round trip to the
next stage and back sits on the critical path, so per-message link time adds to every
micro-batch; kFkB sends k messages back to back and works on the group while they travel,
paying link time once per group; GPipe hides the most but holds all micro-batches.

Calibration is online and needs no model of the network: compute seconds per forward and
backward come from each stage's timers and link seconds from the link threads' own clocks
over the last window of steps, and `model_scale` (measured ÷ predicted step time of the
running k) reports how well the replay matches reality.

A measurement beats a prediction. The planner keeps each k's last measured window with the
link and compute figures it ran under; while the figures of the window at hand match those
(within `match_tolerance`), that k's measured step time stands in for its prediction. So a
switch that measures slower than the k it left is undone at the next decision (the replay,
scaled on the running k alone, would keep predicting the switch a gain), and the planner does
not switch back again while the figures stay; once they move, the old measurement no longer
speaks for that k and the replay decides again.

Memory: `memory_limit_bytes` (one figure for every stage) and, per call, `memory_limits` (one
per stage, what each stage's device has room for: `memory.activation_budget`) both bound the
predicted peak of every stage; a k that passes neither is not chosen.

The planner also chooses how messages move (`comm`). "overlap" sends from links in the
background and "lockstep" batches each action's sends and the next receive into one exchange
that compute waits for (executor docstring). The replay cannot price what lockstep avoids:
NCCL kernels spinning on SMs beside the GEMMs, which on NVLink cost more than the transfer
saves. So that choice is measured, not predicted. When the links carry at most
`lockstep_link_fraction` of the slowest stage's F+B per message, overlap can hide no more than
that, and the planner runs one window in lockstep and keeps whichever mode measured faster.
It re-measures the other mode every `reprobe_every` windows, and it leaves lockstep at once
when its step time rises by `min_gain` (a slower link shows up as exposed exchanges, and the
k choice needs overlap's link figures).

The planner is decision-only (no torch, no process groups): the runtime passes plain numbers
and plain tables ([(kind, micro-batch), ...] per stage) and gets back a `KDecision`, whose
`to_dict()` goes to telemetry and to the job's graph log. It lives in the runtime, next to the
schedule tables and memory model it reads, because the choice is made inside the gang (one
all-gather and one broadcast at a step boundary); docs/pipeline.md weighs the alternative."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace

PlainTable = Sequence[Sequence[tuple[str, int]]]


def predict_step_seconds(table: PlainTable, forward_s: Sequence[float], backward_s: Sequence[float],
                         link_forward_s: Sequence[float], link_backward_s: Sequence[float]) -> float:
    """Makespan of one step of `table`. link_forward_s[s] is the time one activation message
    holds the link from stage s to s+1, link_backward_s[s] one gradient from s+1 to s."""
    stages = len(table)
    for name, values, want in (("forward_s", forward_s, stages), ("backward_s", backward_s, stages),
                               ("link_forward_s", link_forward_s, stages - 1),
                               ("link_backward_s", link_backward_s, stages - 1)):
        if len(values) != want:
            raise ValueError(f"{name}: need {want} values for {stages} stages, got {len(values)}")
    position = [0] * stages
    clock = [0.0] * stages
    arrival: dict[tuple[str, int, int], float] = {}  # (kind, receiving stage, mb) -> time
    link_free = {("F", s): 0.0 for s in range(stages - 1)} | {("B", s): 0.0 for s in range(stages - 1)}
    progress = True
    while progress:
        progress = False
        for s in range(stages):
            row = table[s]
            while position[s] < len(row):
                kind, mb = row[position[s]]
                if (kind == "F" and s == 0) or (kind == "B" and s == stages - 1):
                    ready = 0.0
                elif (kind, s, mb) in arrival:
                    ready = arrival[(kind, s, mb)]
                else:
                    break
                end = max(clock[s], ready) + (forward_s[s] if kind == "F" else backward_s[s])
                clock[s] = end
                position[s] += 1
                progress = True
                if kind == "F" and s < stages - 1:
                    delivered = max(end, link_free[("F", s)]) + link_forward_s[s]
                    link_free[("F", s)] = delivered
                    arrival[("F", s + 1, mb)] = delivered
                elif kind == "B" and s > 0:
                    delivered = max(end, link_free[("B", s - 1)]) + link_backward_s[s - 1]
                    link_free[("B", s - 1)] = delivered
                    arrival[("B", s - 1, mb)] = delivered
    if any(position[s] < len(table[s]) for s in range(stages)):
        raise ValueError("table deadlocks: some stage waits for a message that is never sent")
    return max(clock)


@dataclass(frozen=True)
class KDecision:
    step: int
    previous_k: int
    k: int
    changed: bool
    reason: str
    predicted_step_s: dict[int, float] = field(default_factory=dict)
    peak_bytes: dict[int, int] = field(default_factory=dict)  # worst stage, per k
    feasible: tuple[int, ...] = ()
    measured_step_s: float = 0.0
    model_scale: float = 1.0
    forward_s: tuple[float, ...] = ()
    backward_s: tuple[float, ...] = ()
    link_forward_s: tuple[float, ...] = ()
    link_backward_s: tuple[float, ...] = ()
    previous_comm: str = "overlap"
    comm: str = "overlap"
    # step seconds measured at k (this window's for the running k, earlier windows' at the same
    # figures for others): where present, the choice used these instead of predicted_step_s
    measured_k_s: dict[int, float] = field(default_factory=dict)
    # what the choice compared: measured_k_s where present, else the replay scaled by the nearest
    # measured k's measured ÷ predicted (AdaptiveKPlanner._expect)
    expected_step_s: dict[int, float] = field(default_factory=dict)
    memory_limits: tuple[int | None, ...] = ()  # per stage, as given to decide (none: not given)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Window:
    """One overlap window's measured step seconds at a k, and the figures it ran under."""

    seconds: float
    compute_s: tuple[float, ...]  # F+B per stage
    link_s: tuple[float, ...]  # seconds per message, forward links then backward links

    def matches(self, other: _Window, tolerance: float) -> bool:
        """Same conditions: every stage's F+B and every link within `tolerance` of each other.
        A link under 5% of the slowest F+B hides behind compute either way, so below that
        link figures count as equal."""
        if len(self.compute_s) != len(other.compute_s) or len(self.link_s) != len(other.link_s):
            return False
        floor = 0.05 * max(*self.compute_s, *other.compute_s)

        def close(a: float, b: float, least: float = 0.0) -> bool:
            return abs(a - b) <= tolerance * max(a, b, least)

        return (all(close(a, b) for a, b in zip(self.compute_s, other.compute_s, strict=True))
                and all(close(a, b, floor) for a, b in zip(self.link_s, other.link_s, strict=True)))


class AdaptiveKPlanner:
    """Re-chooses k among `candidates` each time `decide` is called (the runtime calls it every
    `replan_every` steps with that window's averages). It switches only when the best feasible
    k is expected at least `min_gain` faster than the running one, so measurement noise does
    not make k flap, and always leaves a k whose predicted memory exceeds a limit. Expected is
    measured where a window at that k ran under the same figures, else predicted (module
    docstring)."""

    def __init__(self, memory_limit_bytes: int | None = None, min_gain: float = 0.05, *,
                 lockstep: bool = False, lockstep_link_fraction: float = 0.05,
                 reprobe_every: int = 6, match_tolerance: float = 0.2) -> None:
        if memory_limit_bytes is not None and memory_limit_bytes <= 0:
            raise ValueError(f"memory_limit_bytes must be > 0 or None, got {memory_limit_bytes}")
        if not 0.0 <= min_gain < 1.0:
            raise ValueError(f"min_gain must be in [0, 1), got {min_gain}")
        if not 0.0 <= match_tolerance < 1.0:
            raise ValueError(f"match_tolerance must be in [0, 1), got {match_tolerance}")
        if not 0.0 <= lockstep_link_fraction < 1.0:
            raise ValueError(f"lockstep_link_fraction must be in [0, 1), got {lockstep_link_fraction}")
        if reprobe_every < 1:
            raise ValueError(f"reprobe_every must be >= 1 (windows), got {reprobe_every}")
        self.memory_limit_bytes = memory_limit_bytes
        self.min_gain = min_gain
        self.lockstep = lockstep
        self.lockstep_link_fraction = lockstep_link_fraction
        self.reprobe_every = reprobe_every
        self.match_tolerance = match_tolerance
        self.history: list[KDecision] = []
        self._measured: dict[tuple[str, int], float] = {}  # (comm, k) -> last window's step seconds
        self._windows: dict[int, _Window] = {}  # k -> its last overlap window
        self._windows_in_comm = 0
        self._probing = False

    def decide(self, *, step: int, current_k: int, forward_s: Sequence[float], backward_s: Sequence[float],
               link_forward_s: Sequence[float], link_backward_s: Sequence[float], measured_step_s: float,
               candidates: Mapping[int, PlainTable], peak_bytes: Mapping[int, Sequence[int]],
               comm: str = "overlap", lockstep_ok: Mapping[int, bool] | None = None,
               memory_limits: Sequence[int | None] | None = None) -> KDecision:
        """`comm` is how the window ran; `lockstep_ok[k]` says whether k's table has lockstep
        exchanges (`schedules.lockstep_exchanges`); lockstep is only tried where it does.
        `memory_limits[s]` is what stage s has room for (None: no figure), on top of
        `memory_limit_bytes`."""
        if comm not in ("overlap", "lockstep"):
            raise ValueError(f"comm must be 'overlap' or 'lockstep', got {comm!r}")
        if comm == "lockstep":
            return self._decide_in_lockstep(step, current_k, measured_step_s)
        if not candidates:
            raise ValueError("candidates: give at least one k with its table")
        if set(peak_bytes) != set(candidates):
            raise ValueError(f"peak_bytes must cover the same k as candidates: {sorted(candidates)}")
        stages = len(forward_s)
        if memory_limits is not None and len(memory_limits) != stages:
            raise ValueError(f"memory_limits: need one value (or None) per stage ({stages}), "
                             f"got {len(memory_limits)}")
        limits = self._stage_limits(stages, memory_limits)
        worst = {k: max(peak_bytes[k]) for k in candidates}
        feasible = tuple(sorted(k for k in candidates if all(
            limit is None or peak <= limit for peak, limit in zip(peak_bytes[k], limits, strict=True))))
        if not feasible:
            feasible = (min(candidates, key=lambda k: (worst[k], k)),)
        predicted = {k: predict_step_seconds(candidates[k], forward_s, backward_s, link_forward_s,
                                             link_backward_s) for k in sorted(candidates)}
        known = current_k in predicted
        scale = measured_step_s / predicted[current_k] if known and predicted[current_k] else 1.0
        window = _Window(measured_step_s, tuple(f + b for f, b in zip(forward_s, backward_s, strict=True)),
                         (*link_forward_s, *link_backward_s))
        measured = {k: w.seconds for k, w in self._windows.items()
                    if k in predicted and k != current_k and w.matches(window, self.match_tolerance)}
        if known:
            measured[current_k] = measured_step_s
        self._windows[current_k] = window
        expected = self._expect(predicted, measured)
        best = min(feasible, key=lambda k: (expected[k], k))
        current_ok = current_k in feasible
        gain = 1.0 - expected[best] / expected[current_k] if known and expected[current_k] else 1.0
        switch = best != current_k and (not current_ok or gain >= self.min_gain)
        chosen = best if switch else current_k
        reason = self._explain(current_k, best, chosen, predicted, measured, expected, scale, feasible, gain,
                               forward_s, backward_s, link_forward_s, link_backward_s, limits)
        decision = KDecision(
            step=step, previous_k=current_k, k=chosen, changed=chosen != current_k, reason=reason,
            predicted_step_s={k: v * scale for k, v in predicted.items()}, peak_bytes=worst,
            feasible=feasible, measured_step_s=measured_step_s, model_scale=scale,
            forward_s=tuple(forward_s), backward_s=tuple(backward_s),
            link_forward_s=tuple(link_forward_s), link_backward_s=tuple(link_backward_s),
            measured_k_s=measured, expected_step_s=expected,
            memory_limits=tuple(memory_limits) if memory_limits is not None else (),
        )
        decision = self._maybe_probe_lockstep(decision, lockstep_ok or {})
        self.history.append(decision)
        return decision

    @staticmethod
    def _expect(predicted: Mapping[int, float], measured: Mapping[int, float]) -> dict[int, float]:
        """Each k's expected step seconds: measured where a window at k matched, else its replay
        scaled by measured ÷ predicted of the nearest measured k (the larger ratio on a tie). A
        k that measured slower than the replay said makes its neighbours' predictions no more
        trustworthy, so an untried k next to it is not chosen on the replay's word alone."""
        ratios = {k: v / predicted[k] for k, v in measured.items() if predicted[k] > 0}
        expected = dict(measured)
        for k, value in predicted.items():
            if k not in expected:
                nearest = min(ratios, key=lambda m: (abs(m - k), -ratios[m]), default=None)
                expected[k] = value * (ratios[nearest] if nearest is not None else 1.0)
        return expected

    def _stage_limits(self, stages: int, memory_limits: Sequence[int | None] | None) -> list[int | None]:
        """Each stage's bound: the smaller of the fixed limit and the stage's own figure."""
        own = list(memory_limits) if memory_limits is not None else [None] * stages
        fixed = self.memory_limit_bytes
        return [fixed if limit is None else limit if fixed is None else min(fixed, limit) for limit in own]

    def _maybe_probe_lockstep(self, decision: KDecision, lockstep_ok: Mapping[int, bool]) -> KDecision:
        """After an overlap window that keeps k: try (or return to) lockstep when the link is
        too fast for overlap to matter."""
        k = decision.k
        # the window ran the previous k: a switch's window is no figure for the k it switches to
        self._measured[("overlap", decision.previous_k)] = decision.measured_step_s
        self._windows_in_comm += 1
        if not self.lockstep or decision.changed or not lockstep_ok.get(k, False):
            return decision
        compute = max(f + b for f, b in zip(decision.forward_s, decision.backward_s, strict=True))
        link = max([*decision.link_forward_s, *decision.link_backward_s], default=0.0)
        ratio = link / compute if compute else 1.0
        if ratio > self.lockstep_link_fraction:
            return decision
        known = self._measured.get(("lockstep", k))
        lockstep_was_slower = known is not None and known >= decision.measured_step_s
        if lockstep_was_slower and self._windows_in_comm < self.reprobe_every:
            return decision
        why = ("never measured" if known is None else
               f"measured {known * 1e3:.1f} ms against overlap's {decision.measured_step_s * 1e3:.1f} ms"
               if known < decision.measured_step_s else f"last measured {self._windows_in_comm} windows ago")
        self._probing, self._windows_in_comm = True, 0
        return replace(decision, comm="lockstep", reason=(
            f"{decision.reason}; the link is {ratio:.3f}× F+B (≤ {self.lockstep_link_fraction:g}), so "
            f"overlap can hide little: run k={k} in lockstep for a window (lockstep {why})"))

    def _decide_in_lockstep(self, step: int, k: int, measured: float) -> KDecision:
        """A lockstep window has no link figures (an exchange is a rendezvous, not a link's
        time), so k stays and only the two modes' measured step times are compared."""
        overlap = self._measured.get(("overlap", k))
        previous = self._measured.get(("lockstep", k))
        self._windows_in_comm += 1
        comm, note = "lockstep", ""
        if self._probing:
            self._probing = False
            if overlap is not None and measured >= overlap:
                comm = "overlap"
                note = f"not faster than overlap's {overlap * 1e3:.1f} ms: back to overlap"
            else:
                note = ("faster than overlap's " + f"{overlap * 1e3:.1f} ms" if overlap is not None
                        else "no overlap figure") + ": keep lockstep"
        elif previous is not None and measured > previous * (1.0 + self.min_gain):
            comm = "overlap"
            note = (f"{measured / previous - 1.0:.0%} slower than the previous lockstep window "
                    f"({previous * 1e3:.1f} ms): the link may have slowed; back to overlap to re-plan k")
        elif self._windows_in_comm >= self.reprobe_every:
            comm = "overlap"
            note = f"{self._windows_in_comm} windows in lockstep: re-measure overlap"
        else:
            note = "keep lockstep"
        self._measured[("lockstep", k)] = measured
        if comm != "lockstep":
            self._windows_in_comm = 0
        decision = KDecision(step=step, previous_k=k, k=k, changed=False, measured_step_s=measured,
                             reason=f"lockstep window at k={k}: {measured * 1e3:.1f} ms a step, {note}",
                             previous_comm="lockstep", comm=comm)
        self.history.append(decision)
        return decision

    def _explain(self, current: int, best: int, chosen: int, predicted: Mapping[int, float],
                 measured: Mapping[int, float], expected: Mapping[int, float], scale: float,
                 feasible: Sequence[int], gain: float,
                 forward_s: Sequence[float], backward_s: Sequence[float], link_forward_s: Sequence[float],
                 link_backward_s: Sequence[float], limits: Sequence[int | None]) -> str:
        compute = max(f + b for f, b in zip(forward_s, backward_s, strict=True))
        link = max([*link_forward_s, *link_backward_s], default=0.0)
        ratio = link / compute if compute else 0.0
        table = ", ".join(f"k={k}: {predicted[k] * 1e3:.1f} ms" for k in sorted(predicted))
        head = (f"link {link * 1e3:.2f} ms/message = {ratio:.2f}× the slowest stage's F+B "
                f"({compute * 1e3:.2f} ms); predicted step {table}")
        earlier = {k: v for k, v in measured.items() if k != current}
        if earlier:
            head += "; measured at the same figures " + ", ".join(
                f"k={k}: {v * 1e3:.1f} ms" for k, v in sorted(earlier.items()))
            head += f" (k={current} now: {measured[current] * 1e3:.1f} ms)" if current in measured else ""
            rescaled = {k: v for k, v in expected.items()
                        if k not in measured and abs(v - predicted[k] * scale) > 1e-9 * max(v, 1e-12)}
            if rescaled:
                head += "; expected, scaled as the nearest measured k " + ", ".join(
                    f"k={k}: {v * 1e3:.1f} ms" for k, v in sorted(rescaled.items()))
        known = [limit for limit in limits if limit is not None]
        if known:
            blocked = sorted(set(predicted) - set(feasible))
            per_stage = ", ".join("-" if limit is None else str(limit) for limit in limits)
            bound = f"{known[0]} B" if len(set(limits)) == 1 else f"[{per_stage}] B per stage"
            head += (f"; memory limit {bound} rules out k={blocked}" if blocked
                     else f"; all k fit in {bound}")
        if current not in predicted:
            return (f"{head}; the running k={current} is not among the candidates "
                    f"{sorted(predicted)}: switch to k={chosen}")
        if current not in feasible:
            return f"{head}; k={current} exceeds the memory limit, switch to k={chosen}"
        how = "measured" if best in earlier else "is"  # measured at the same figures, or predicted
        if chosen != current:
            return f"{head}; k={chosen} {how} {gain:.0%} faster than k={current}: switch"
        if best != current:
            return (f"{head}; k={best} {how} only {gain:.0%} faster (< {self.min_gain:.0%}): "
                    f"keep k={current}")
        return f"{head}; k={current} is already the fastest: keep"
