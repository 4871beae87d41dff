"""The remediation policy of the monitor loop: telemetry in, ladder decisions and graph events out.

It has the shape of `huorn.backends.monitor.Policy` (`decide(graph, observation)`), so the local
backend and the operator run it like any other policy. It reads `observation.telemetry`
(replica → the runtime's `/telemetry` JSON) and `observation.time`, and nothing else.

S4's mutation reports the culprit's instance failed, and the default InstanceManager replaces it
with a new generation, which makes the elastic gang restart from its last checkpoint. S2's is a
set-param of the trainer vertex's `microbatches` (per-rank counts, with the ladder's reason); the
backend delivers it (the local backend writes the run directory's control file, which the
trainer applies at a step boundary). Unless the caller gives a JobShape, S2's inputs come from
the telemetry itself: each rank's seconds per micro-batch is its recent median compute time (its
step minus the time inside collectives) over the micro-batches it computes, which the trainer
publishes under `parameters.micro_batches`. S3's is a set-param of the trainer vertex's
`stageLayers` (layers per pipeline stage); the backend restarts the gang from a coordinated
checkpoint with the new split, which the checkpoint's undivided parameter names allow. S3's inputs
are each stage's seconds per layer: its ranks' median compute time over the layers it holds, as
the pipeline trainer publishes them under `parameters.pipeline.stage_layers`. Every decision is
kept in `decisions` (the operator copies them to status).

A pipelined job gets both rungs from one shape (`build_pipeline_shape`). S2's unit there is the
pipeline replica: a replica runs one table, so its seconds per micro-batch are its slowest
stage's. That splits the two rungs' work cleanly. A replica that is slow as a whole, or slow in
one stage, differs from the other replicas, and S2 (cheaper) moves micro-batches away from it.
A stage that is slow in every replica leaves the replicas equal: S2's best plan is the even
split, the ladder passes it (`skip-rebalance-microbatches`), and S3, which moves layers in every
replica at once, takes over.

Fail-slow detection keeps one history per rank, with the instance (pod, agent) that runs it: a
DDP pod with several GPUs runs one rank on each, and a pipelined pod several stages. The pipeline
detector must also see each rank's compute and waits with its replica and stage, to tell the
rank that is slow from those that wait for it. A DDP finding names the rank's instance, the unit
S4 replaces, and the detector counts pods, not ranks, when it asks whether half of the workers
slowed at once (all the GPUs of one slow host are that host, not half of a two-pod job). A
history whose instance is gone (replaced, removed) is dropped, as is one whose instance serves
other ranks now (torchrun may give a pod other ranks after a restart): an old name must not count
as a worker.

Each tick's step records ran before the tick's decision, so after a rung is taken the rest of
them price nothing on it: a tick takes at most one rung above S1. A policy rebuilt for a running
job (a restarted operator, an edited spec) replays the history the telemetry still holds, and
it used to climb S1 → S2 → S4 in one tick on steps that ran before S2 existed.

NB: a whole job that sits outside any collective for a while is what checkpointing, validation,
start-up and rendezvous look like, so that case is recorded (after start-up, with every rank in
view) but never restarts anything.
"""

from __future__ import annotations

import dataclasses
import re
import statistics
from collections.abc import Mapping
from typing import Any, Protocol

from huorn.api import base
from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import managers, model
from huorn.scheduler.remediation import failslow, hang, ladder, rebalance, steptable

HISTORY_STEPS = 1024  # per rank: enough for BOCD's segments, bounded for week-long jobs
SHAPE_WINDOW = 5  # recent steps whose median compute time gives a rank's seconds per micro-batch
# NB: while an S2/S3 plan holds, the window grows with the steps since its telemetry settled, up
# to EVIDENCE_WINDOW: judged 5 steps at a time, a recovered rank left at [5, 3] and measured ~5 %
# slower than its peer hid in one window's noise (up to 11 % on a loaded host), so the even split
# never came back; pooled, the median's uncertainty falls as 1/√n. The cap bounds how long a
# change in the speeds takes to move the median (half the window).
EVIDENCE_WINDOW = 20
# how an S4's replacement names the step it was taken at (RemediationPolicy._events_for)
S4_AT_STEP = re.compile(r"remediation S4 \([^)]*\) at step (\d+)")


class TelemetryObservation(Protocol):
    time: float
    telemetry: dict[str, dict[str, Any]]


class RemediationPolicy:
    """One job's detectors and ladder, fed one monitor observation at a time."""

    def __init__(self, remediation: Remediation, costs: ladder.LadderCosts | None = None,
                 shape: ladder.JobShape | None = None) -> None:
        self.remediation = remediation
        self.hang = hang.HangDetector(base.parse_duration(remediation.hang_timeout))
        self.ladder = ladder.MitigationLadder(remediation.max_mitigation, costs, shape)
        self.shape_from_telemetry = shape is None
        self.decisions: list[ladder.Decision] = []
        self.history: dict[str, dict[int, dict]] = {}  # rank's history key → step → record
        self.instance_of: dict[str, str] = {}  # history key → the instance that runs its rank
        self.positions: dict[str, failslow.PipelineRank] = {}  # pipelined: history key → rank's place
        self._handled_hangs: set[tuple[tuple[str, ...], int]] = set()
        self._slow_seen: set[tuple[str, int]] = set()
        self._last_step = -1
        self._restart_step = -1  # the step of the last S4 this policy took (last_restart_step)
        self._replaced: set[str] = set()  # the pods its S4s replaced (replaced_pods)
        self._resumed = False  # a plan taken up from the graph: price it from the next step on

    def decide(self, graph: model.Graph, observation: TelemetryObservation) -> list[managers.Event]:
        snapshots = {k: v for k, v in observation.telemetry.items() if "collective" in v}
        if not snapshots:
            return []
        events = self._decide_hang(graph, snapshots, observation.time)
        if self.remediation.fail_slow_detection and not events:
            events = self._decide_fail_slow(graph, snapshots)
        return events

    def resume(self, trainer_params: Mapping[str, Any]) -> bool:
        """Take up the S2 counts or S3 layer split that the trainer vertex holds, if they are not
        the even split (ladder.MitigationLadder.resume says why); True if one was taken up. The
        graph is the API's record of what the trainers run, so this is what an operator restarted
        or handed an edited spec knows of the ladder it replaces."""
        counts = _uneven(trainer_params.get("microbatches"))
        layers = _uneven(trainer_params.get("stageLayers"))
        if counts is None and layers is None:
            return False
        mitigation = trainer_params.get("mitigation") or {}
        ranks = [int(r) for r in mitigation.get("ranks") or ()] if isinstance(mitigation, Mapping) else []
        if layers is not None:
            self.ladder.resume(MitigationLevel.RESPLIT, {"stageLayers": layers}, counts, ranks)
        else:
            self.ladder.resume(MitigationLevel.REBALANCE, {"microbatches": counts}, ranks=ranks)
        self._resumed = True
        return True

    # -- hangs -----------------------------------------------------------------------------------
    def _decide_hang(
        self, graph: model.Graph, snapshots: Mapping[str, dict], now: float
    ) -> list[managers.Event]:
        replica_of: dict[int, str] = {}
        samples = []
        for key, snap in snapshots.items():
            replica = snap.get("replica") or key
            try:
                sample = hang.parse_runtime_telemetry(snap, now, node=replica)
            except ValueError:
                continue  # a replica mid-restart can serve a partial view; judge it next tick
            replica_of[sample.rank] = replica
            samples.append(sample)
        finding = self.hang.observe(samples, now)
        step = max((sample.step for sample in samples), default=-1)
        world = max((int(snap.get("world_size") or 0) for snap in snapshots.values()), default=0)
        if finding is not None and not finding.culprits:
            # Every rank inside one collective, none standing out: no rank to replace, but the job
            # is hung, and that must show (it used to leave no trace until torch's watchdog). Only
            # with every rank in view: a rank missing (its pod being replaced) would be the one
            # that stands out, and the old telemetry of the others is no communicator's fault.
            if len(samples) >= world and ((), finding.collective) not in self._handled_hangs:
                self._handled_hangs.add(((), finding.collective))
                self.decisions.append(ladder.Decision(
                    MitigationLevel.OBSERVE, "suspect-communicator",
                    f"{finding.kind} hang: {finding.reason}; no rank to replace, so nothing is restarted: "
                    f"check the links and switches between {', '.join(sorted(set(replica_of.values())))}"))
            return []
        if finding is not None and len(finding.culprits) == len(samples):
            self._record_outside(finding, snapshots, replica_of, world)
            return []
        if finding is None or not finding.culprits:
            return []
        replicas = tuple(sorted({replica_of[r] for r in finding.culprits}))
        key = (replicas, finding.collective)
        if key in self._handled_hangs:
            return []
        self._handled_hangs.add(key)
        return self._take(graph, self.ladder.on_hang(finding, replicas), replicas, step)

    def _record_outside(self, finding: hang.HangFinding, snapshots: Mapping[str, dict],
                        replica_of: Mapping[int, str], world: int) -> None:
        """Every rank stalled outside any collective: what checkpointing, validation and
        rendezvous look like, so nothing is restarted, but it is recorded (once per collective),
        as the docs always said and the policy did not. (A pipeline stage's receives are counted
        on CPU, so a stage blocked on a hung neighbour is inside one; on NCCL they are not.)
        Not before any rank published a step (start-up: loading a model may outlast the timeout)
        and only with every rank in view (a gang mid-restart is outside collectives too). The
        decision names no ranks: it blames none, and a plan's ranks must not be overwritten."""
        key = ((failslow.JOB_WIDE,), finding.collective)
        if key in self._handled_hangs or len(replica_of) < world \
                or not any(snap.get("steps") for snap in snapshots.values()):
            return
        self._handled_hangs.add(key)
        self.decisions.append(ladder.Decision(
            MitigationLevel.OBSERVE, "stalled-outside-collectives",
            f"{finding.kind} stall: {finding.reason}; nothing is restarted, as checkpointing, validation "
            "and rendezvous look the same (so does a pipelined job on NCCL stopped in a point-to-point "
            "send or receive, which only CPU runs count): if it lasts, check "
            f"{', '.join(sorted(set(replica_of.values())))}"))

    def _take(self, graph: model.Graph, decision: ladder.Decision,
              replicas: tuple[str, ...], step: int) -> list[managers.Event]:
        """Keep a decision and return its events; an S4 decision keeps the pods it names and the
        step it was taken at (`atStep` in its plan, `at step` in its events' reasons). One that
        names none (a job-wide slowdown) says so: the operator records it as it does a capped one,
        where it used to record nothing. NB: a named pod that is gone already was replaced by an
        earlier decision (a restarted operator reads the stale telemetry again): nothing new."""
        if decision.level is MitigationLevel.RESTART and decision.action != "capped":
            self._restart_step = step
            self._replaced.update(replicas)
            decision = dataclasses.replace(decision, replaced=tuple(replicas),
                                           plan={**decision.plan, "atStep": step})
            if not replicas:
                decision = dataclasses.replace(decision, reason=(
                    f"{decision.reason}; it names no pod to replace (the slowdown is job-wide)"))
        events = self._events_for(graph, decision, replicas)
        self.decisions.append(decision)
        return events

    # -- fail-slow -------------------------------------------------------------------------------
    def _decide_fail_slow(self, graph: model.Graph, snapshots: Mapping[str, dict]) -> list[managers.Event]:
        served = set()
        for key, snap in snapshots.items():
            served.add(history_key := self._history_key(key, snap))
            steps = self.history.setdefault(history_key, {})
            served_steps = snap.get("steps") or []
            for record in served_steps:
                steps[int(record["step"])] = record
            if served_steps:
                # A worker serves the tail of its run: steps past its newest are from before the
                # gang went back to a checkpoint (an S4, a restart), and are run again. Kept, each
                # re-run step's new time sat beside the old times of the steps after it, which
                # read as a change at the step being re-run on every tick.
                newest = max(int(r["step"]) for r in served_steps)
                for stale in [k for k in steps if k > newest]:
                    del steps[stale]
            for old in sorted(steps)[:-HISTORY_STEPS]:
                del steps[old]
        self._forget_gone(graph, served)
        # NB: a slowdown that began before the last S4 is that S4's: its pod is gone (or, job-wide,
        # nothing could be replaced). Found again, because the replaced pod's history went and the
        # survivors' waits for it now set the per-step minimum of communication, or because a
        # rebuilt policy replays the telemetry's 256 steps, it climbed the ladder once more from
        # its old onset, up to an S4 that named no pod.
        # NB: only findings the S4 could have ended: on a pod it replaced, or job-wide. The gang
        # resumes from its checkpoint, steps before the S4's (95 or 70 after an S4 at 100), and a
        # survivor's slowdown that begins in the steps it re-runs was ignored for good.
        restarted = max(self._restart_step, last_restart_step(graph))
        replaced = self._replaced | replaced_pods(graph)
        if self.positions:
            pipeline_table = self.build_pipeline_table()
            found = failslow.detect_pipeline_fail_slow(pipeline_table) if pipeline_table else []
        else:
            table = self.build_table()
            found = [f if f.worker == failslow.JOB_WIDE else
                     dataclasses.replace(f, worker=self.instance_of.get(f.worker, f.worker))
                     for f in (failslow.detect_fail_slow(table, host_of=self.instance_of) if table else [])]
        if not any(self.history.values()):
            return []
        events: list[managers.Event] = []
        first = self._last_step + 1
        for finding in found:
            if (finding.where(), finding.onset_iteration) in self._slow_seen \
                    or (finding.onset_iteration < restarted
                        and (finding.worker == failslow.JOB_WIDE or finding.worker in replaced)):
                continue
            reported = [f.onset_iteration for f in found if f.where() == finding.where()]
            if finding.factor <= 1:
                # the ladder's slowdown is over: at S1 (or a passed rung) nothing else would end it
                if (recovered := self.ladder.on_recovery(finding, reported)) is not None:
                    self._slow_seen.add((finding.where(), finding.onset_iteration))
                    self.decisions.append(recovered)
                continue
            self._slow_seen.add((finding.where(), finding.onset_iteration))
            if self.ladder.level is not None and (worse := self.ladder.on_worsening(finding, reported)):
                self.decisions.append(worse)  # where the ladder's slowdown is: it is now worse
            elif self.ladder.level is None or self.ladder.supersedes(finding):
                self.decisions.append(self.ladder.on_fail_slow(finding, _culprit_ranks(finding, found)))
                # ski-rental's rent runs from the onset, not from the detection: the steps between
                # were lost all the same, and a detector slowed by a noisy host must not also
                # delay the mitigation by the loss it would have counted meanwhile. Not from
                # before it: a rebuilt policy (nothing priced yet) would count those steps' noise
                first = max(finding.onset_iteration, 0)
            elif self.ladder.finding is None:
                self.ladder.finding = finding  # a resumed plan's: its onset gives the healthy baseline
        latest = max((max(steps) for steps in self.history.values() if steps), default=-1)
        if self._resumed:
            # the steps before the resume ran on the plan too, but under speeds not measured now:
            # pricing them with today's shape would credit a re-plan with savings nobody saw
            self._resumed, first = False, max(first, latest + 1)
        if self.shape_from_telemetry:
            window = min(EVIDENCE_WINDOW, max(SHAPE_WINDOW, self.ladder.settled_steps()))
            self.ladder.shape = (build_pipeline_shape(snapshots, window) or build_shape(snapshots, window)
                                 or self.ladder.shape)
        healthy = self._healthy_step_seconds()
        for step in range(first, latest + 1):
            seconds = max((h[step]["step_seconds"] for h in self.history.values() if step in h), default=None)
            if seconds is None:
                continue
            # NB: without a healthy baseline (a resumed plan, no steps before the onset) nothing is
            # counted as lost, but the plan in force is still priced against the speeds now
            finding = self.ladder.finding  # S4 puts the ladder at rest: the culprit is named before
            decision = self.ladder.on_step(seconds, seconds if healthy is None else healthy)
            if decision is not None:
                worker = finding.worker if finding else failslow.JOB_WIDE
                events += self._take(graph, decision, () if worker == failslow.JOB_WIDE else (worker,), step)
                # NB: every step of this tick ran before this rung, the new ones too: they price
                # nothing on it. Breaking only on steps already seen let a rebuilt policy (nothing
                # seen yet) climb S1 → S2 → S4 in one tick on history from before S2 existed.
                break
        self._last_step = max(self._last_step, latest)
        return events

    def _forget_gone(self, graph: model.Graph, served: set[str]) -> None:
        """Drop the histories of ranks not served this tick whose instance the graph no longer
        runs, or whose rank another instance runs now (torchrun renumbered the gang after a
        restart). A rank that merely missed a poll, its pod's other ranks answering, keeps its
        history: dropped, it came back with only what the telemetry still held, and its
        change-point baseline was lost."""
        live = set(graph.instance_names())
        # rank → the instance that runs it this tick (keys with ranks are "<instance>/<rank>")
        ranks = {k.rpartition("/")[2]: self.instance_of.get(k, k) for k in served if "/" in k}
        for key in [k for k in self.history if k not in served]:
            instance = self.instance_of.get(key, key)
            rank = key.rpartition("/")[2] if "/" in key else None
            if instance not in live or (rank is not None and ranks.get(rank, instance) != instance):
                del self.history[key]
                self.instance_of.pop(key, None)
                self.positions.pop(key, None)

    def _history_key(self, key: str, snap: dict) -> str:
        """One history per rank, with the instance that runs it. A pod runs several ranks (one per
        GPU; a pipelined pod several stages), and one history per pod interleaved their records:
        whichever rank was read last won, so a DDP pod's slow GPU other than its last went unseen.
        Every rank's key is `<instance>/<rank>`, a pipelined rank's with its place kept beside it:
        a pod given other ranks after a restart, or a replacement that runs the ranks of the pod
        it replaced, starts new histories. NB: a pipelined rank was keyed by its rank alone, so
        after S4 the replaced pod's slow steps became its replacement's: the old slowdown was
        found again on the new pod, priced from its old onset, and S4 replaced the replacement
        again and again (each time cordoning a node) while a later straggler went unreplaced."""
        instance = snap.get("replica") or key
        if "rank" not in snap:
            self.instance_of[instance] = instance
            return instance  # a runtime without ranks: one history per instance
        rank = int(snap["rank"])
        self.instance_of[history_key := f"{instance}/{rank}"] = instance
        pipeline = (snap.get("parameters") or {}).get("pipeline") or {}
        stages = len(pipeline.get("stage_layers") or ()) or int(pipeline.get("stages") or 0)
        if stages >= 1:
            # rank = replica × stages + stage (runtime/pipeline/topology.py)
            self.positions[history_key] = failslow.PipelineRank(instance, rank, rank // stages, rank % stages)
        return history_key

    def build_table(self) -> steptable.StepTable | None:
        """The replicas' recent steps as the detector's generic table (compute/comm split)."""
        rows = [{"iteration": step, "worker": replica, "time": r["step_seconds"],
                 "compute": r["compute_seconds"], "comm": r["comm_seconds"]}
                for replica, steps in self.history.items() for step, r in sorted(steps.items())[-512:]]
        if not rows:
            return None
        return steptable.build_table(rows, (*steptable.REQUIRED, *steptable.OPTIONAL))

    def build_pipeline_table(self) -> failslow.PipelineTable | None:
        """The ranks' recent steps with their places (failslow.build_pipeline_table)."""
        recent = {w: sorted(self.history.get(w, {}).items())[-512:] for w in self.positions}
        return failslow.build_pipeline_table(recent, self.positions)

    def _healthy_step_seconds(self) -> float | None:
        finding = self.ladder.finding
        if finding is None:
            return None
        before = [r["step_seconds"] for h in self.history.values() for s, r in h.items()
                  if s < finding.onset_iteration]
        return sorted(before)[len(before) // 2] if before else None

    # -- events ----------------------------------------------------------------------------------
    def _events_for(self, graph: model.Graph, decision: ladder.Decision,
                    replicas: tuple[str, ...]) -> list[managers.Event]:
        if decision.level is MitigationLevel.REBALANCE and "microbatches" in decision.plan:
            return build_rebalance_events(graph, decision)
        if decision.level is MitigationLevel.RESPLIT and "stageLayers" in decision.plan:
            # S3's way back down carries S2's even counts too when S2 held before it (ladder)
            extra = build_rebalance_events(graph, decision) if "microbatches" in decision.plan else []
            return build_resplit_events(graph, decision) + extra
        if decision.level is not MitigationLevel.RESTART or decision.action == "capped":
            return []
        live = set(graph.instance_names())
        events = []
        for replica in replicas:
            vertex = next((v.name for v in graph.vertices.values()
                           if any(i.name == replica for i in v.instances)), None)
            if vertex is not None and replica in live:
                events.append(managers.Event(managers.INSTANCE_FAILED, vertex, {
                    "instance": replica, "reason": f"remediation S4 ({decision.action}) at step "
                                                   f"{decision.plan.get('atStep')}: {decision.reason}",
                }))
        return events + build_restore_events(graph, decision)


def last_restart_step(graph: model.Graph) -> int:
    """The latest step at which the graph records an S4 (-1 if none): from its replacements'
    reasons, or, for an S4 that replaced no pod, from the trainer's `mitigation` parameter, where
    the operator records it (`plan.atStep`, and `restartedAtStep` in every later rung's value).
    A rebuilt policy (a restarted operator, an edited spec) learns from it which findings that S4
    already ended, as the operator's reconcile learns from its status stamps (controlVersion,
    resplitVersion, cordonedVersion) what it already did."""
    steps = [int(m[1]) for mutation in graph.log
             if mutation.action == "replace" and (m := S4_AT_STEP.match(mutation.reason))]
    for trainer in graph.vertices_with_role("trainer"):
        mitigation = trainer.params.get("mitigation")
        if not isinstance(mitigation, Mapping):
            continue
        if isinstance(mitigation.get("restartedAtStep"), int):  # kept by every rung after the S4
            steps.append(int(mitigation["restartedAtStep"]))
        if mitigation.get("level") != MitigationLevel.RESTART.value:
            continue
        plan = mitigation.get("plan")
        if isinstance(plan, Mapping) and isinstance(plan.get("atStep"), int):
            steps.append(int(plan["atStep"]))
    return max(steps, default=-1)


def replaced_pods(graph: model.Graph) -> set[str]:
    """The pods the graph's log records an S4 replacement of (what `last_restart_step` reads)."""
    return {str(mutation.detail.get("old")) for mutation in graph.log
            if mutation.action == "replace" and S4_AT_STEP.match(mutation.reason)}


def _culprit_ranks(finding: failslow.SlowFinding, found: list[failslow.SlowFinding]) -> list[int]:
    """The ranks a pipelined finding names, with the other ranks of its replica that slowed at
    the same time: a replica slow as a whole is all its stages, and the decisions carry them all."""
    if finding.rank is None:
        return []
    return sorted({f.rank for f in found if f.rank is not None and f.replica == finding.replica
                   and f.factor > 1 and f.kind == finding.kind
                   and abs(f.onset_iteration - finding.onset_iteration) <= failslow.ONSET_TOLERANCE})


def build_restore_events(graph: model.Graph, decision: ladder.Decision) -> list[managers.Event]:
    """S4's way back to the even split: S2's counts and S3's layers in force were fitted to the
    pod S4 replaces (ladder.MitigationLadder._restart), and left in force they would hold the
    healthy gang back with nothing left to restore them."""
    out = []
    for key, what in (("microbatches", "S2's micro-batch counts"), ("stageLayers", "S3's stage layers")):
        if key not in decision.plan:
            continue
        trainers = [v for v in graph.vertices_with_role("trainer")
                    if key == "microbatches" or int(v.params.get("pipelineStages", 1)) > 1]
        value = [int(n) for n in decision.plan[key]]  # type: ignore[attr-defined]
        if trainers:
            out.append(managers.Event(managers.PARAMETER_DECISION, trainers[0].name, {
                "key": key, "value": value,
                "reason": f"remediation S4 ({decision.action}): {decision.reason}; {what} go back to the "
                          f"even split {value}"}))
    return out


def build_rebalance_events(graph: model.Graph, decision: ladder.Decision) -> list[managers.Event]:
    """S2's plan (micro-batches per DP rank or pipeline replica) as the trainer's `microbatches`
    set-param."""
    trainers = graph.vertices_with_role("trainer")
    plan = decision.plan
    reason = (f"remediation S2 ({decision.action}): {decision.reason}; counts {plan['microbatches']} "
              f"predict {plan['predictedStepSeconds']:.3f}s per step (even split "
              f"{plan['stepSecondsBefore']:.3f}s)")
    if not trainers:
        return []
    return [managers.Event(managers.PARAMETER_DECISION, trainers[0].name, {
        "key": "microbatches", "value": list(plan["microbatches"]), "reason": reason})]  # type: ignore[call-overload]


def build_resplit_events(graph: model.Graph, decision: ladder.Decision) -> list[managers.Event]:
    """S3's plan (stage start boundaries) as the trainer's `stageLayers` set-param."""
    trainers = [v for v in graph.vertices_with_role("trainer") if int(v.params.get("pipelineStages", 1)) > 1]
    if not trainers:
        return []
    plan = decision.plan
    split = [int(n) for n in plan["stageLayers"]]  # type: ignore[attr-defined]
    reason = (f"remediation S3 ({decision.action}): {decision.reason}; stage layers {split} predict "
              f"{plan['predictedStageSeconds']:.3f}s for the slowest stage (now "
              f"{plan['stageSecondsBefore']:.3f}s)")
    return [managers.Event(managers.PARAMETER_DECISION, trainers[0].name, {
        "key": "stageLayers", "value": split, "reason": reason})]


def build_pipeline_shape(snapshots: Mapping[str, dict], window: int = SHAPE_WINDOW) -> ladder.JobShape | None:
    """S3's and S2's inputs from a pipeline job's telemetry. S3: every layer costs the same (the
    decoder's blocks are identical), and a stage's speed is the fastest stage's seconds per layer
    over its own (its slowest replica's median compute time divided by the layers it holds).
    S2: a replica's seconds per micro-batch are its slowest stage's (module docstring), its fixed
    seconds a step one micro-batch through its other stages (the pipeline's fill and drain, which
    do not shrink with its count), with the step's micro-batches; only once every rank of the
    gang reports them. Each figure is the median of the last `window` steps. None until every
    stage has published SHAPE_WINDOW steps."""
    per_layer: dict[int, float] = {}
    per_replica: dict[int, float] = {}  # slowest stage's seconds per micro-batch
    summed: dict[int, float] = {}  # all stages' seconds for one micro-batch
    splits, totals, worlds, ranks = set(), set(), set(), set()
    noise = 0.0
    for snap in snapshots.values():
        pipeline = (snap.get("parameters") or {}).get("pipeline") or {}
        split = pipeline.get("stage_layers")
        steps = (snap.get("steps") or [])[-max(window, SHAPE_WINDOW):]
        if not split or len(steps) < SHAPE_WINDOW:
            return None
        splits.add(tuple(int(n) for n in split))
        rank = int(snap["rank"])
        stage, replica = rank % len(split), rank // len(split)  # rank = replica × stages + stage
        compute = statistics.median(float(r["compute_seconds"]) for r in steps)
        per_layer[stage] = max(per_layer.get(stage, 0.0), max(compute, 1e-6) / split[stage])
        series = _microbatch_series(snap, steps)
        noise = max(noise, median_uncertainty([float(r["compute_seconds"]) for r in steps]))
        if series is not None:
            seconds = statistics.median(series)
            noise = max(noise, median_uncertainty(series))
            per_replica[replica] = max(per_replica.get(replica, 0.0), seconds)
            summed[replica] = summed.get(replica, 0.0) + seconds
            totals.add(int(snap["parameters"]["micro_batches"]["total"]))
            ranks.add(rank)
        worlds.add(int(snap.get("world_size", 0)))
    if len(splits) != 1:
        return None
    split = splits.pop()
    if sorted(per_layer) != list(range(len(split))):
        return None
    fastest = min(per_layer.values())
    shape = ladder.JobShape(layer_costs=[1.0] * sum(split),
                            stage_speeds=[fastest / per_layer[s] for s in range(len(split))],
                            layer_seconds=fastest, noise=noise)
    world = worlds.pop() if len(worlds) == 1 else 0
    if len(totals) == 1 and world and sorted(ranks) == list(range(world)):
        replicas = range(world // len(split))
        shape.microbatch_seconds = [per_replica[r] for r in replicas]
        # one micro-batch through the other stages: the fill and drain around the slowest one
        shape.fixed_seconds = [summed[r] - per_replica[r] for r in replicas]
        shape.total_microbatches = totals.pop()
    return shape


def _microbatch_series(snap: dict, steps: list[dict]) -> list[float] | None:
    """A rank's recent seconds per micro-batch, a figure a step: the runtime's own when it
    publishes one, else compute over the micro-batches it holds; None when it reports no
    micro-batches."""
    batches = (snap.get("parameters") or {}).get("micro_batches")
    if not batches or not batches.get("mine"):
        return None
    if all(r.get("microbatch_seconds") for r in steps):
        return [max(float(r["microbatch_seconds"]), 1e-6) for r in steps]
    return [max(float(r["compute_seconds"]), 1e-6) / int(batches["mine"]) for r in steps]


def _uneven(split: object) -> list[int] | None:
    """A per-unit split (counts or layers) as ints, or None if absent or the even split."""
    if not isinstance(split, list | tuple) or len(split) < 2:
        return None
    values = [int(n) for n in split]
    return None if values == rebalance.even_split(sum(values), len(values)) else values


def median_uncertainty(values: list[float]) -> float:
    """How far, relative to it, the median of one rank's recent figures may lie from the rank's
    true figure: the robust spread (MAD scaled to a normal σ) through the median's standard error
    (1.2533 σ / √n). The ladder compares plans only beyond it (ladder.MitigationLadder.delta)."""
    centre = statistics.median(values)
    deviation = statistics.median(abs(v - centre) for v in values)
    return 1.2533 * 1.4826 * deviation / max(centre, 1e-9) / len(values) ** 0.5


def build_shape(snapshots: Mapping[str, dict], window: int = SHAPE_WINDOW) -> ladder.JobShape | None:
    """S2's inputs from the ranks' telemetry: seconds per micro-batch by rank (the runtime's own
    figure when it publishes one, else compute over micro-batches; the median of the last
    `window` steps), and the step's micro-batches. None until every rank of one gang has published
    SHAPE_WINDOW steps."""
    per_rank: dict[int, float] = {}
    totals, world = set(), set()
    noise = 0.0
    for snap in snapshots.values():
        parameters = snap.get("parameters") or {}
        if parameters.get("pipeline"):
            return None  # S2's unit is the pipeline replica there: build_pipeline_shape
        steps = (snap.get("steps") or [])[-max(window, SHAPE_WINDOW):]
        series = _microbatch_series(snap, steps) if len(steps) >= SHAPE_WINDOW else None
        if series is None:
            return None
        per_rank[int(snap["rank"])] = statistics.median(series)
        noise = max(noise, median_uncertainty(series))
        totals.add(int(parameters["micro_batches"]["total"]))
        world.add(int(snap["world_size"]))
    if len(totals) != 1 or len(world) != 1 or sorted(per_rank) != list(range(world.pop())):
        return None
    return ladder.JobShape(microbatch_seconds=[per_rank[r] for r in sorted(per_rank)],
                           total_microbatches=totals.pop(), noise=noise)
