"""The FALCON mitigation ladder, climbed by the ski-rental rule and capped by the job's spec.

S1 observe → S2 rebalance micro-batches → S3 re-split pipeline stages → S4 cordon the node,
replace the pod, restart from the checkpoint. Each rung costs more (a pause to re-plan, a
repartition, a restart plus the work since the last checkpoint) and fixes more. We do not know
how long a fail-slow will last, which is exactly the ski-rental problem: keep "renting" (paying
the slowdown) until what was paid since the current rung was taken equals the price of the next
rung, then "buy" it. That rule is 2-competitive against an oracle that knew the duration.

A hang is different: the job makes no progress at all, and only S4 removes a stopped rank, so
it goes straight to S4 (or to the cap, with the reason saying what was not allowed).
Decisions are plain objects; the graph turns them into mutations and Events.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from huorn.api.common import MitigationLevel
from huorn.scheduler.remediation import failslow, hang, rebalance

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

    microbatch_seconds: list[float] | None = None  # per data-parallel rank, seconds per micro-batch
    total_microbatches: int = 0
    layer_costs: list[float] | None = None  # pipeline: relative cost of each layer
    stage_speeds: list[float] | None = None  # pipeline: relative speed of each stage's rank(s)


@dataclasses.dataclass(frozen=True)
class Decision:
    level: MitigationLevel
    action: str
    reason: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    plan: dict[str, object] = dataclasses.field(default_factory=dict)


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
        """A validated slowdown: start observing it (S1). Losses count from here."""
        self.finding, self.ranks = finding, tuple(ranks)
        self.level, self.loss_since_rung = MitigationLevel.OBSERVE, 0.0
        return Decision(
            MitigationLevel.OBSERVE, ACTIONS[MitigationLevel.OBSERVE],
            f"fail-slow ({finding.kind}) on {finding.worker} ×{finding.factor:.2f} since step "
            f"{finding.onset_iteration}; observing until the loss pays for the next rung", self.ranks,
        )

    def on_step(self, step_seconds: float, healthy_seconds: float) -> Decision | None:
        """Account one step's loss; climb a rung once the loss since the last one pays for it."""
        if self.level is None:
            return None
        self.loss_since_rung += max(0.0, step_seconds - healthy_seconds)
        target = self.next_rung()
        if target is None or self.loss_since_rung < self.costs.of(target):
            return None
        paid, previous = self.loss_since_rung, self.level
        self.level, self.loss_since_rung = target, 0.0
        return Decision(
            target, ACTIONS[target],
            f"lost {paid:.1f}s since {previous.value}"
            f" ≥ {self.costs.of(target):.1f}s cost of {target.value} (ski-rental)",
            self.ranks, plan=self.build_plan(target),
        )

    def build_plan(self, level: MitigationLevel) -> dict[str, object]:
        s = self.shape
        if level is MitigationLevel.REBALANCE and s.microbatch_seconds is not None:
            mb = rebalance.rebalance_microbatches(s.microbatch_seconds, s.total_microbatches)
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

    def on_hang(self, finding: hang.HangFinding) -> Decision:
        """A hang stops the job: only a restart helps, so take S4 now, or the cap if lower."""
        ranks = finding.culprits
        if _index(self.cap) < _index(MitigationLevel.RESTART):
            self.level = self.cap
            return Decision(
                self.cap, "capped",
                f"{finding.kind} hang: {finding.reason}; restart needed but spec.remediation."
                f"maxMitigation is {self.cap.value}: raise it to 'restart' to let Huorn recover",
                ranks, finding.nodes,
            )
        self.level, self.loss_since_rung = MitigationLevel.RESTART, 0.0
        return Decision(
            MitigationLevel.RESTART, ACTIONS[MitigationLevel.RESTART],
            f"{finding.kind} hang: {finding.reason}; lower rungs cannot move a stopped rank",
            ranks, finding.nodes, self.build_plan(MitigationLevel.RESTART),
        )
