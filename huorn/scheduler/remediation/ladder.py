"""The FALCON mitigation ladder, climbed by the ski-rental rule and capped by the job's spec.

S1 observe → S2 rebalance micro-batches → S3 re-split pipeline stages → S4 cordon the node,
replace the pod, restart from the checkpoint. Each rung costs more (a pause to re-plan, a
repartition, a restart plus the work since the last checkpoint) and fixes more. We do not know
how long a fail-slow will last, which is exactly the ski-rental problem: keep "renting" (paying
the slowdown) until what was paid since the current rung was taken equals the price of the next
rung, then "buy" it. That rule is 2-competitive against an oracle that knew the duration.

A hang is different: the job makes no progress at all, and only S4 removes a stopped rank, so
it goes straight to S4 (or to the cap, with the reason saying what was not allowed).

S4 is the top rung, and it ends the incident: the slow or stopped pod is replaced and the gang
restarts from its checkpoint, so the ladder starts afresh (any S2 counts or S3 split in force go
back to even in the same decision). A capped hang changes nothing, and the ladder stays where it
was. Before, the ladder stayed at S4 or at the cap for good: no later fail-slow was taken, S2's
counts for the replaced pod stayed in force, and a restarted operator disagreed with it. An
incident with nothing of the ladder's in force (S1, a passed rung) ends with its recovery, or
gives way to a later slowdown elsewhere (`on_recovery`, `supersedes`): the ladder sat at S1 for
good before, and a later straggler's S4 replaced the pod that had recovered.

A plan fitted to a slowdown is wrong once the slowdown changes. While S2 or S3 holds, every
step prices the applied plan and the best plan for the speeds measured now; once the predicted
seconds it would have saved pay for re-planning (the same rung's cost: ski-rental again), the
ladder re-plans. When the best plan is the even one, the fail-slow is over: the job goes back
to the even split and the ladder starts afresh. Without this, a rank that recovered would sit
idle behind counts fitted to its slowdown, and that loss would climb the ladder to a restart.
A pipelined job can hold both: S2's counts stay in force when the ladder climbs on to S3. S3's
way back down then also restores the even counts (the plan carries both), unless the replicas'
speeds still call for S2, in which case the ladder returns to S2 on the counts in force.
Decisions are plain objects; the graph turns them into mutations and Events.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from huorn.api.common import MitigationLevel
from huorn.scheduler.remediation import bocd, failslow, hang, rebalance

# A worker at this multiple of its healthy speed or slower is still slow: a shift of the
# detector's own threshold (FALCON's 10 %, bocd.BocdConfig.min_shift) would be found as a fail-slow.
STILL_SLOW = 1.0 + bocd.BocdConfig.min_shift
ORDER = (MitigationLevel.OBSERVE, MitigationLevel.REBALANCE, MitigationLevel.RESPLIT, MitigationLevel.RESTART)
ACTIONS = {
    MitigationLevel.OBSERVE: "observe",
    MitigationLevel.REBALANCE: "rebalance-microbatches",
    MitigationLevel.RESPLIT: "resplit-stages",
    MitigationLevel.RESTART: "cordon-replace-restart",
}


@dataclasses.dataclass(frozen=True)
class LadderCosts:
    """What taking each rung costs, in seconds of the job's wall time (all its GPUs waiting)."""

    rebalance: float = 30.0  # drain the step, re-plan, broadcast the new counts
    resplit: float = 300.0  # repartition layers, move weights between stages
    restart: float = 900.0  # cordon, reschedule, reload; plus half a checkpoint interval of lost work

    def of(self, level: MitigationLevel) -> float:
        return {MitigationLevel.OBSERVE: 0.0, MitigationLevel.REBALANCE: self.rebalance,
                MitigationLevel.RESPLIT: self.resplit, MitigationLevel.RESTART: self.restart}[level]


@dataclasses.dataclass
class JobShape:
    """What the planners of S2 and S3 need; None means the job has no such parallelism."""

    microbatch_seconds: list[float] | None = None  # per DP rank or pipeline replica, seconds per micro-batch
    total_microbatches: int = 0
    layer_costs: list[float] | None = None  # pipeline: relative cost of each layer
    stage_speeds: list[float] | None = None  # pipeline: relative speed of each stage's rank(s)
    layer_seconds: float | None = None  # pipeline: a step's seconds for one layer cost at speed 1
    fixed_seconds: list[float] | None = None  # per pipeline replica: fill and drain, whatever its count
    noise: float = 0.0  # the least certain rank's relative uncertainty (policy.median_uncertainty)


# (applied plan's seconds a step, best plan's, best plan, whether the best is the even split,
# whether the best is faster than the applied plan beyond the measured noise)
Priced = tuple[float, float, tuple[int, ...], bool, bool]


@dataclasses.dataclass(frozen=True)
class Decision:
    level: MitigationLevel
    action: str
    reason: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    plan: dict[str, object] = dataclasses.field(default_factory=dict)
    # S4 only: the pods it replaces, set by the policy (none: a job-wide finding names no pod, and
    # the decision itself is what the operator records)
    replaced: tuple[str, ...] = ()


def _index(level: MitigationLevel) -> int:
    return ORDER.index(level)


class MitigationLadder:
    """One job's position on the ladder. Feed it steps; it answers with a Decision when it moves."""

    def __init__(self, cap: MitigationLevel, costs: LadderCosts | None = None,
                 shape: JobShape | None = None) -> None:
        self.cap = MitigationLevel(cap)
        self.costs = costs or LadderCosts()
        self.shape = shape or JobShape()
        self.level: MitigationLevel | None = None  # None: nothing detected
        self.loss_since_rung = 0.0
        self.finding: failslow.SlowFinding | None = None
        self.ranks: tuple[int, ...] = ()
        self.applied: dict[str, object] | None = None  # the S2/S3 plan in force
        self.steps_on_plan = 0
        self.replan_gain = 0.0  # seconds the best plan would have saved since the applied one
        self.counts_in_force: list[int] | None = None  # S2's counts, kept while S3 holds
        self.passed = False  # the rung in force was passed: its even split is what `applied` holds
        # the incident's later changes taken where its slowdown is: easings (on_recovery) and
        # worsenings (on_worsening)
        self.changes: list[failslow.SlowFinding] = []
        self._priced: tuple[JobShape, tuple[int, ...], Priced | None] | None = None  # per shape and plan

    def applicable(self, level: MitigationLevel) -> bool:
        s = self.shape
        if level is MitigationLevel.REBALANCE:
            return s.microbatch_seconds is not None and len(s.microbatch_seconds) >= 2 \
                and s.total_microbatches > len(s.microbatch_seconds)
        if level is MitigationLevel.RESPLIT:
            return s.layer_costs is not None and s.stage_speeds is not None and len(s.stage_speeds) >= 2
        return True

    def next_rung(self) -> MitigationLevel | None:
        """The next rung that applies to this job and that the cap allows, if any."""
        start = 0 if self.level is None else _index(self.level) + 1
        for level in ORDER[start:]:
            if _index(level) > _index(self.cap):
                return None
            if self.applicable(level):
                return level
        return None

    def on_fail_slow(self, finding: failslow.SlowFinding, ranks: Sequence[int]) -> Decision:
        """A validated slowdown: start observing it (S1). Losses count from here. One that
        supersedes the ladder's finding (`supersedes`) starts afresh from S1 too, and says so."""
        before = self.finding if self.level is not None else None
        self._reset()
        self.finding, self.ranks = finding, tuple(ranks)
        self.level, self.loss_since_rung = MitigationLevel.OBSERVE, 0.0
        instead = "" if before is None else (
            f"; it takes the place of the fail-slow on {before.where()} since step {before.onset_iteration}")
        return Decision(
            MitigationLevel.OBSERVE, ACTIONS[MitigationLevel.OBSERVE],
            f"fail-slow ({finding.kind}) on {finding.where()} ×{finding.factor:.2f} since step "
            f"{finding.onset_iteration}; observing until the loss pays for the next rung{instead}",
            self.ranks,
        )

    def holds_no_plan(self) -> bool:
        """Whether nothing of the ladder's own is in force: it observes (S1), or it passed a rung
        and the even split is all that holds (no S2 counts kept under a passed S3)."""
        if self.level is MitigationLevel.OBSERVE:
            return True
        counts = self.counts_in_force
        return self.level is not None and self.passed and (
            counts is None or list(counts) == rebalance.even_split(sum(counts), len(counts)))

    def on_recovery(self, finding: failslow.SlowFinding, reported: Sequence[int] = ()) -> Decision | None:
        """A validated recovery (factor < 1): if it is where the ladder's slowdown was, after it
        began, and nothing of the ladder's is in force, the slowdown is over and the ladder comes
        to rest (a decision that says so); else None. An S2 or S3 plan in force is left to its
        re-planning, which restores the even split once that pays.
        A drop that leaves the worker still slower than its healthy level by what the detector
        reports as a fail-slow (×4.30, then ×0.87: still ×3.74) is an easing, not the end: the
        ladder keeps observing the slowdown at what is left of it (a decision that says so).
        NB: recoveries were ignored, and the ladder took new findings only at rest, so it sat at
        S1 for good after a short slowdown: a later straggler elsewhere climbed it under the old
        finding, and S4 replaced the pod that had recovered long before. Then any drop ended the
        incident: a 13 % easing of a 4× straggler on a loaded host put the ladder at rest, and the
        rest of the job ran 3.7× slow with no rung taken (a run of the S2 scenario test in the
        suite's alone part).
        `reported`: the onsets of this tick's changes where the finding is. An easing already
        taken that the detector still reports makes a close change of a like factor a second
        change (4× → 2× → 1×), not the same one seen again at a moved onset."""
        current = self.finding
        if current is None or finding.factor >= 1 or not self._at_the_slowdown(finding):
            return None
        if self._taken(finding, reported):
            return None  # an easing already taken, its onset moved as the detector's window slid
        if current.factor * finding.factor >= STILL_SLOW:
            return self._compound(finding, "eased", "still")
        ranks = self.ranks
        self._reset()
        return Decision(
            MitigationLevel.OBSERVE, "recovered",
            f"fail-slow ({current.kind}) on {current.where()} since step {current.onset_iteration} is "
            f"over: ×{finding.factor:.2f} from step {finding.onset_iteration}; nothing was in force, "
            "so the ladder comes to rest", ranks)

    def on_worsening(self, finding: failslow.SlowFinding, reported: Sequence[int] = ()) -> Decision | None:
        """A validated rise (factor > 1) where the ladder's slowdown is, after it began, while
        nothing of the ladder's is in force: the slowdown is now its factor times the rise's (a
        decision that says so). Else None.
        NB: a rise there was ignored (it neither starts an incident nor supersedes its own), so
        4× → 2× → 4× → 2× was taken for 4× eased to 2×, then eased to 1×: the incident ended,
        and the ladder sat at rest while the worker ran twice as slow. The first sighting of the
        slowdown itself, at an onset the detector's window moved, is not a rise."""
        current = self.finding
        if current is None or finding.factor <= 1 or not self._at_the_slowdown(finding):
            return None
        first = dataclasses.replace(current, factor=self._onset_factor())
        if self._taken(finding, reported, also=first):
            return None
        return self._compound(finding, "worsened", "now")

    def _at_the_slowdown(self, finding: failslow.SlowFinding) -> bool:
        """Whether a change is one of the observed slowdown's own (where and of the kind it is,
        after its onset) while nothing of the ladder's is in force."""
        current = self.finding
        return (current is not None and self.holds_no_plan()
                and finding.onset_iteration > current.onset_iteration
                and (finding.where(), finding.kind) == (current.where(), current.kind))

    def _compound(self, finding: failslow.SlowFinding, action: str, state: str) -> Decision:
        """Take a change of the observed slowdown: it is now its factor times the change's (segment
        means: new over old, times old over healthy), and a decision that says so."""
        current = self.finding
        assert current is not None
        self.finding = dataclasses.replace(current, factor=current.factor * finding.factor)
        self.changes.append(finding)
        return Decision(
            MitigationLevel.OBSERVE, action,
            f"fail-slow ({current.kind}) on {current.where()} since step {current.onset_iteration} "
            f"{action} ×{finding.factor:.2f} from step {finding.onset_iteration} and is {state} "
            f"×{self.finding.factor:.2f}: the ladder keeps observing it", self.ranks)

    def _onset_factor(self) -> float:
        """The slowdown's factor as first found: what is left of it now, less its changes since."""
        assert self.finding is not None
        return self.finding.factor / math.prod(c.factor for c in self.changes)

    def _taken(self, finding: failslow.SlowFinding, reported: Sequence[int],
               also: failslow.SlowFinding | None = None) -> bool:
        """Whether `finding` is a change the incident already took (or `also`), seen again at an
        onset the detector's sliding window moved: one it no longer reports where it was."""
        return any(_same_change(finding, taken) and taken.onset_iteration not in reported
                   for taken in [*self.changes, *([also] if also is not None else [])])

    def supersedes(self, finding: failslow.SlowFinding) -> bool:
        """Whether a new slowdown takes the place of the one the ladder observes: elsewhere, begun
        well after it (not the same event seen a tick later), with nothing of the ladder's in force.
        The old one's loss has not paid for the next rung, so it is the cheaper; kept, the next
        rung would be taken on its name (S4 replacing a pod that may have recovered unseen)."""
        current = self.finding
        return (current is not None and finding.factor > 1 and self.holds_no_plan()
                and finding.onset_iteration > current.onset_iteration + failslow.ONSET_TOLERANCE
                and finding.where() != current.where())

    def resume(self, level: MitigationLevel, plan: dict[str, object],
               counts_in_force: list[int] | None = None, ranks: Sequence[int] = ()) -> None:
        """Take up an S2 or S3 plan found in force with no ladder behind it: a restarted operator,
        or a policy rebuilt for an edited spec. Without this the new ladder sits at rest while the
        trainer keeps counts fitted to a slowdown, and when the slowdown ends nothing restores the
        even split: a fresh detector sees no change point in a balanced step time. The plan is
        priced from here on like one this ladder applied; what was lost before is not known, so
        the loss towards the next rung counts from here."""
        self.level, self.ranks = MitigationLevel(level), tuple(ranks)
        self._apply(plan)
        if counts_in_force is not None:
            self.counts_in_force = list(counts_in_force)
        self.loss_since_rung = 0.0

    def on_step(self, step_seconds: float, healthy_seconds: float) -> Decision | None:
        """Account one step's loss; re-plan S2/S3 once a better plan has paid for it, or climb a
        rung once the loss since the last one pays for that."""
        if self.level is None:
            return None
        replan = self._replan_if_paid()
        if replan is not None:
            return replan
        self.loss_since_rung += max(0.0, step_seconds - healthy_seconds)
        target = self.next_rung()
        if target is None or self.loss_since_rung < self.costs.of(target):
            return None
        paid, previous = self.loss_since_rung, self.level
        self.level, self.loss_since_rung = target, 0.0
        plan = self.build_plan(target)
        reason = (f"lost {paid:.1f}s since {previous.value}"
                  f" ≥ {self.costs.of(target):.1f}s cost of {target.value} (ski-rental)")
        if target is MitigationLevel.RESTART:
            return self._restart(Decision(target, ACTIONS[target], reason, self.ranks, plan=plan))
        if target is MitigationLevel.REBALANCE and self.finding is not None \
                and self.finding.replica is not None and not self.finding.link:
            # S2 plans from every replica's measured speed, not from this name; the name says
            # whether the plan moves work off the replica that the detector found slow
            reason += f"; detected on pipeline replica {self.finding.replica}"
        if self._changes_nothing(target, plan):
            # The rung is passed (the loss goes on towards the next one) and nothing changes: the
            # even split stays in force. It is priced from here on as an applied plan would be, so
            # a slowdown that begins or grows later still gets this rung's plan once that pays.
            # NB: before, nothing was in force, nothing was priced, and the ladder (no longer at
            # S1) took no new finding: a start-up blip passed S2 early and a real straggler after
            # it was never rebalanced (a flaky serial test, test_remediation_replan.py).
            self.applied, self.passed = self._even_plan(target), True
            self.steps_on_plan, self.replan_gain = 0, 0.0
            return Decision(target, "skip-" + ACTIONS[target],
                            f"{reason}; but the even split is already the best plan for the speeds "
                            "measured now, so it would change nothing", self.ranks)
        self._apply(plan)
        return Decision(target, ACTIONS[target], reason, self.ranks, plan=plan)

    def _changes_nothing(self, level: MitigationLevel, plan: dict[str, object]) -> bool:
        """An S2 or S3 plan that is the job's own even split (what it runs without one), or that
        beats it only within the measured noise."""
        s = self.shape
        if level is MitigationLevel.REBALANCE and s.microbatch_seconds is not None and "microbatches" in plan:
            counts = [int(n) for n in plan["microbatches"]]  # type: ignore[attr-defined]
            even = rebalance.even_split(s.total_microbatches, len(s.microbatch_seconds))
            times, fixed = s.microbatch_seconds, s.fixed_seconds
            return counts == even or not self._faster(rebalance.unit_seconds(counts, times, fixed),
                                                       rebalance.unit_seconds(even, times, fixed))
        if level is MitigationLevel.RESPLIT and s.stage_speeds is not None and "stageLayers" in plan:
            layers = [int(n) for n in plan["stageLayers"]]  # type: ignore[attr-defined]
            costs = s.layer_costs or []
            even = rebalance.even_split(len(costs), len(s.stage_speeds))
            return layers == even or not self._faster(rebalance.stage_seconds(layers, costs, s.stage_speeds),
                                                      rebalance.stage_seconds(even, costs, s.stage_speeds))
        return False

    # -- re-planning under S2/S3 -------------------------------------------------------------------
    SETTLE_STEPS = 8  # steps on a new plan before its telemetry describes it (the shape's window)
    # NB: measured speeds are noisy, and with near-equal ranks the exact optimum is rarely the
    # even split ([5, 3] may beat [4, 4] by a rounding). So a plan counts as faster than another
    # only if it is faster for every speed within ±delta of each unit's measured one
    # (rebalance.worst_case_ratio), delta being the shape's measured uncertainty within
    # [MIN_DELTA, MAX_DELTA]. A fixed 10 % margin on the ratio before let a loaded host's swings
    # between two small ranks pay re-plan after re-plan ([3, 5], [5, 3], [1, 7]) while the even
    # split never came back. MAX_DELTA bounds what noise may hide: one micro-batch moved back to
    # even from a rank that holds up to 5 ([5, 3] → [4, 4]: 1.25×) must always count, which
    # needs delta < 1/(2·5 − 1); smaller gains are not worth chasing through that much noise.
    MIN_DELTA = 0.05
    MAX_DELTA = 0.1

    def settled_steps(self) -> int:
        """Steps priced on the plan in force since its telemetry settled (0 without one): how far
        back the policy may pool each rank's figures into one measured speed, so that the evidence
        for or against the plan grows while it holds instead of being judged window by window."""
        if self.level not in (MitigationLevel.REBALANCE, MitigationLevel.RESPLIT) or self.applied is None:
            return 0
        return max(0, self.steps_on_plan - self.SETTLE_STEPS)

    def delta(self) -> float:
        """The relative error allowed to each unit's measured speed when plans are compared."""
        return min(self.MAX_DELTA, max(self.MIN_DELTA, self.shape.noise))

    def _faster(self, new: Sequence[float], old: Sequence[float]) -> bool:
        """Whether units taking `new` seconds beat `old` for any of their speeds within delta."""
        return rebalance.worst_case_ratio(new, old, self.delta()) < 1.0

    def _apply(self, plan: dict[str, object]) -> None:
        self.passed = False
        self.applied = plan if ("microbatches" in plan or "stageLayers" in plan) else None
        if "microbatches" in plan:
            self.counts_in_force = list(plan["microbatches"])  # type: ignore[call-overload]
        self.steps_on_plan, self.replan_gain = 0, 0.0

    def _replan_if_paid(self) -> Decision | None:
        if self.level not in (MitigationLevel.REBALANCE, MitigationLevel.RESPLIT) or self.applied is None:
            return None
        self.steps_on_plan += 1
        if self.steps_on_plan <= self.SETTLE_STEPS:
            return None
        # NB: the policy hands the ladder a new shape once per monitor tick, which may cover many
        # steps; pricing solves integer programs, so it runs once per shape and plan, not per step
        applied = self._key(self.applied)
        if self._priced is None or self._priced[0] is not self.shape or self._priced[1] != applied:
            self._priced = (self.shape, applied, self._price(self.level))
        priced = self._priced[2]
        if priced is None:
            return None
        current, best, plan, even, faster = priced
        if plan == self._key(self.applied) or current <= best:
            self.replan_gain = 0.0
            return None
        if not faster:  # within the noise: no evidence either way, so the saving neither grows nor resets
            return None
        self.replan_gain += current - best
        cost = self.costs.of(self.level)
        if self.replan_gain < cost:
            return None
        level, gain = self.level, self.replan_gain
        full = self.build_plan(level) if not even else self._even_plan(level)
        what = "micro-batch counts" if level is MitigationLevel.REBALANCE else "stage layers"
        reason = (f"measured speeds changed: the applied {what} {list(self._key(self.applied))} now predict "
                  f"{current:.3f}s a step, {list(plan)} {best:.3f}s; saved {gain:.1f}s ≥ {cost:.1f}s "
                  f"cost of {level.value} (ski-rental)")
        if even:
            action = "restore-even"
            if level is MitigationLevel.RESPLIT and self._s2_still_pays():
                # the stages are balanced again, but one replica is still slower as a whole
                # (all its stages alike, which S3 cannot see): back to S2 on the counts in force
                reason += (f"; the even layer split is best again, but the replicas' speeds still "
                           f"differ: S2's counts {self.counts_in_force} stay and S2 holds again")
                self.level, self.loss_since_rung = MitigationLevel.REBALANCE, 0.0
                self._apply({"microbatches": list(self.counts_in_force)})
                return Decision(level, action, reason, self.ranks, plan=full)
            reason += "; the even split is best again: the fail-slow is over"
            if level is MitigationLevel.RESPLIT and self.counts_in_force is not None \
                    and self.shape.microbatch_seconds is not None:
                full.update(self._even_plan(MitigationLevel.REBALANCE))
                reason += "; S2's counts go back to the even split too"
            self._reset()
        elif self.passed:  # the first plan of a rung passed earlier: the rung's own action
            action = ACTIONS[level]
            self._apply(full)
        else:
            action = "replan-microbatches" if level is MitigationLevel.REBALANCE else "replan-stages"
            self._apply(full)
        return Decision(level, action, reason, self.ranks, plan=full)

    def _reset(self) -> None:
        """Back at rest: no finding, no rung, no plan in force (the job's even split)."""
        self.level, self.finding, self.ranks, self.loss_since_rung = None, None, (), 0.0
        self.applied, self.counts_in_force, self.passed = None, None, False
        self.steps_on_plan, self.replan_gain = 0, 0.0
        self.changes = []

    def _restart(self, decision: Decision) -> Decision:
        """S4 ends the incident: the pod is replaced and the gang restarts from its checkpoint.
        An S2 count or S3 split in force was fitted to the pod that goes, so the decision also
        takes them back to even (from the plans themselves: a resumed ladder may have no shape
        yet), and the ladder comes to rest, where a later fail-slow starts from S1 again. A
        restarted operator finds the even split in the trainer's params and agrees."""
        plan = dict(decision.plan)
        if self.counts_in_force is not None:
            even = rebalance.even_split(sum(self.counts_in_force), len(self.counts_in_force))
            if list(self.counts_in_force) != even:
                plan["microbatches"] = even
        layers = (self.applied or {}).get("stageLayers")
        if isinstance(layers, list | tuple) and layers:
            even = rebalance.even_split(sum(int(n) for n in layers), len(layers))
            if [int(n) for n in layers] != even:
                plan["stageLayers"] = even
        self._reset()
        return dataclasses.replace(decision, plan=plan)

    def _s2_still_pays(self) -> bool:
        """Whether the speeds measured now still make S2's best plan faster than the even split."""
        s = self.shape
        if self.counts_in_force is None or s.microbatch_seconds is None \
                or len(s.microbatch_seconds) != len(self.counts_in_force):
            return False
        best = rebalance.rebalance_microbatches(s.microbatch_seconds, s.total_microbatches, s.fixed_seconds)
        even = rebalance.even_split(s.total_microbatches, len(s.microbatch_seconds))
        return self._faster(rebalance.unit_seconds(best.counts, s.microbatch_seconds, s.fixed_seconds),
                            rebalance.unit_seconds(even, s.microbatch_seconds, s.fixed_seconds))

    @staticmethod
    def _key(plan: dict[str, object]) -> tuple[int, ...]:
        values = plan.get("microbatches", plan.get("stageLayers"))
        return tuple(int(v) for v in values)  # type: ignore[union-attr]

    def _price(self, level: MitigationLevel) -> Priced | None:
        """(applied plan's seconds a step, best plan's, best plan, whether it is the even one,
        whether it beats the applied plan beyond the noise), from the shape measured now; None
        when the shape cannot price this rung. The best plan is the even split unless the
        optimum beats the even split beyond the noise."""
        s, applied = self.shape, self._key(self.applied or {})
        if level is MitigationLevel.REBALANCE:
            if s.microbatch_seconds is None or len(s.microbatch_seconds) != len(applied):
                return None
            times, fixed = s.microbatch_seconds, s.fixed_seconds
            best = tuple(rebalance.rebalance_microbatches(times, s.total_microbatches, fixed).counts)
            even = tuple(rebalance.even_split(s.total_microbatches, len(applied)))
            units = {plan: rebalance.unit_seconds(plan, times, fixed) for plan in (applied, even, best)}
            chosen = best if self._faster(units[best], units[even]) else even
            return (max(units[applied]), max(units[chosen]), chosen, chosen == even,
                    self._faster(units[chosen], units[applied]))
        if s.layer_costs is None or s.stage_speeds is None or s.layer_seconds is None \
                or len(s.stage_speeds) != len(applied) or sum(applied) != len(s.layer_costs):
            return None
        split = rebalance.resplit_stages(s.layer_costs, s.stage_speeds)
        ends = [*split.boundaries[1:], len(s.layer_costs)]
        best = tuple(end - start for start, end in zip(split.boundaries, ends, strict=True))
        even = tuple(rebalance.even_split(len(s.layer_costs), len(applied)))
        layers, speeds = s.layer_costs, s.stage_speeds
        units = {plan: rebalance.stage_seconds(plan, layers, speeds) for plan in (applied, even, best)}
        chosen = best if self._faster(units[best], units[even]) else even
        return (max(units[applied]) * s.layer_seconds, max(units[chosen]) * s.layer_seconds, chosen,
                chosen == even, self._faster(units[chosen], units[applied]))

    def _even_plan(self, level: MitigationLevel) -> dict[str, object]:
        """The job's own plan, in the form of `build_plan`'s, priced on the current shape."""
        s = self.shape
        if level is MitigationLevel.REBALANCE and s.microbatch_seconds is not None:
            counts = rebalance.even_split(s.total_microbatches, len(s.microbatch_seconds))
            seconds = rebalance.step_seconds(counts, s.microbatch_seconds, s.fixed_seconds)
            return {"microbatches": counts, "predictedStepSeconds": seconds, "stepSecondsBefore": seconds}
        assert s.layer_costs is not None and s.stage_speeds is not None
        layers = rebalance.even_split(len(s.layer_costs), len(s.stage_speeds))
        plan = rebalance.resplit_stages(s.layer_costs, s.stage_speeds)
        return {"stageBoundaries": [sum(layers[:i]) for i in range(len(layers))], "stageLayers": layers,
                "predictedStageSeconds": plan.before, "stageSecondsBefore": plan.before}

    def build_plan(self, level: MitigationLevel) -> dict[str, object]:
        s = self.shape
        if level is MitigationLevel.REBALANCE and s.microbatch_seconds is not None:
            mb = rebalance.rebalance_microbatches(s.microbatch_seconds, s.total_microbatches, s.fixed_seconds)
            return {"microbatches": list(mb.counts), "predictedStepSeconds": mb.makespan,
                    "stepSecondsBefore": mb.before}
        if level is MitigationLevel.RESPLIT and s.layer_costs is not None and s.stage_speeds is not None:
            st = rebalance.resplit_stages(s.layer_costs, s.stage_speeds)
            ends = [*st.boundaries[1:], len(s.layer_costs)]
            return {"stageBoundaries": list(st.boundaries),
                    "stageLayers": [end - start for start, end in zip(st.boundaries, ends, strict=True)],
                    "predictedStageSeconds": st.makespan,
                    "stageSecondsBefore": st.before}
        if level is MitigationLevel.RESTART:
            return {"cordon": True, "replacePods": True, "restartFromCheckpoint": True}
        return {}

    def on_hang(self, finding: hang.HangFinding, pods: Sequence[str] = ()) -> Decision:
        """A hang stops the job: only a restart helps, so take S4 now, or the cap if lower.
        `pods`: those that run the hang's culprits, which S4 replaces."""
        ranks = finding.culprits
        if _index(self.cap) < _index(MitigationLevel.RESTART):
            # nothing is done, so the ladder stays as it was (it used to move to the cap for good)
            return Decision(
                self.cap, "capped",
                f"{finding.kind} hang: {finding.reason}; restart needed but spec.remediation."
                f"maxMitigation is {self.cap.value}: raise it to 'restart' to let Huorn recover",
                ranks, finding.nodes,
            )
        decision = Decision(
            MitigationLevel.RESTART, ACTIONS[MitigationLevel.RESTART],
            f"{finding.kind} hang: {finding.reason}; lower rungs cannot move a stopped rank",
            ranks, finding.nodes, self.build_plan(MitigationLevel.RESTART),
        )
        if self.level is not None and self._elsewhere(ranks, pods):
            # Another rank's slowdown is being mitigated: its S2 counts or S3 split were fitted to
            # that rank, which stays, so they stay in force and the ladder where it is. Put back
            # to even, they left the straggler on the even split for good (its change point was
            # already seen, so it was never found again).
            return decision
        return self._restart(decision)

    def _elsewhere(self, ranks: Sequence[int], pods: Sequence[str]) -> bool:
        """Whether a hang's culprits are clear of the slowdown the ladder mitigates: the pod its
        finding names is not among the hang's, and none of its ranks is a culprit, as far as each
        is known (a DDP finding names a pod and no ranks, a resumed plan ranks and no finding).
        NB: ranks alone were compared, so in a DDP job a hang on another pod put a straggler's S2
        counts back to even: the policy gives a DDP finding no ranks."""
        held = self.finding.worker if self.finding is not None else failslow.JOB_WIDE
        by_pod = None if held == failslow.JOB_WIDE or not pods else held not in pods
        by_rank = None if not (self.ranks and ranks) else not set(ranks) & set(self.ranks)
        known = [clear for clear in (by_pod, by_rank) if clear is not None]
        return bool(known) and all(known)


def _same_change(a: failslow.SlowFinding, b: failslow.SlowFinding) -> bool:
    """One change seen twice: onsets within the detector's tolerance and factors within its
    threshold of each other (a full recovery soon after an easing is a change of its own)."""
    return (abs(a.onset_iteration - b.onset_iteration) <= failslow.ONSET_TOLERANCE
            and abs(math.log(a.factor / b.factor)) < bocd.BocdConfig.min_shift)
