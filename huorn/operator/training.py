"""Reconcile one TrainingJob: compile → place (all or none) → record the decision → apply.

The order is what makes a kill at any moment harmless. A decision (a resize, a pod replacement)
is first written into the job's status as a graph mutation (a write-ahead log), and only then
are pods created or deleted; a restarted operator reads the graph back from status, finds the
decision already taken, and finishes applying it under the same deterministic pod names, so
nothing is decided twice and no pod is created twice. Placement is all or none: if any replica
of the gang cannot be placed, no pod is created, and the job says why in its Reconciling
condition. No mutation is written then either, but for a pod replacement: the pod it replaces
(one that never started still holds its GPUs) can only go once the decision is recorded, and in
a gang that fills its cluster its successor can only go where it was.

Restart rules for a failed trainer pod: spec.remediation.podFailurePolicy first (Kubernetes
Job's rules; huorn.operator.failures), then exit code 2 (the runtime refused its config) fails
the job, since a new pod would fail the same way; any other failure replaces the pod (a new graph
generation, so a new name) while spec.remediation.maxMitigation allows "restart" and the job has
had fewer than its replacement budget (spec.remediation.maxRestarts, 3 by default); a failure
the policy ignores spends none of it. torchrun
restarts workers inside a pod on its own; the operator only sees a pod fail when torchrun gives up.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pydantic

from huorn.api import training as training_api
from huorn.api.common import ElasticityPolicy, FailureAction
from huorn.backends import monitor
from huorn.backends.kubernetes import manifests, observe
from huorn.graph import compiler, mutate, serialise
from huorn.graph.model import Graph, Mutation, Vertex
from huorn.operator import (
    allocation,
    conditions,
    cordon,
    estimates,
    evaluation,
    failures,
    images,
    index,
    namesakes,
    queue,
    validation,
)
from huorn.operator.context import Context
from huorn.operator.index import PodRecord
from huorn.scheduler import placement
from huorn.scheduler import preemption as sched_preemption

PLURAL = "trainingjobs"
KIND = "TrainingJob"
DECISION_LIMIT = 32
REASON_LIMIT = 1024  # a decision's reason (Decision.reason); a kubelet's waiting message has no bound
RUNTIME_PARAMS = frozenset({"mitigation", "microbatches", "stageLayers", "batch", mutate.PARAM_STAMPS})
# Spec fields (wire names) a running gang follows without a restart: the scheduler's and the
# monitor's, read from the job itself. Any other edit restarts the gang from its checkpoint on the
# new spec (an uncounted drain of every trainer pod), except those in REFUSED_ONCE_STARTED.
# nodeSelector: where replicas placed from now on go; those placed before stay where they run.
LIVE_FIELDS = frozenset({"priority", "elasticity", "remediation", "suspend", "activeDeadlineSeconds",
                         "ttlSecondsAfterFinished", "nodeSelector"})
# NB: the checkpoints hold the architecture the gang started with: a gang restarted on another
# would fail to load them, so such an edit is refused once the job has started (before, it went
# into the ConfigMap at once, and the job failed at its next restart of any kind). "Started": a
# trainer pod runs, or status records a start or a checkpoint (a preempted or suspended job keeps
# its checkpoints while it has no pod).
REFUSED_ONCE_STARTED = frozenset({"model"})


def iso_time(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_decisions(graph: Graph) -> list[dict[str, Any]]:
    return [
        {"time": iso_time(m.time), "action": m.action, "reason": m.reason[:REASON_LIMIT],
         "graphVersion": m.version}
        for m in graph.log[-DECISION_LIMIT:]
    ]


async def write_status(ctx: Context, body: Mapping[str, Any], status: dict[str, Any],
                       plural: str = PLURAL) -> None:
    """Patch status only when it says something new (condition times aside): a reconcile that
    changed nothing writes nothing."""
    old = body.get("status") or {}
    if conditions.strip_times({**old, **status}) == conditions.strip_times(old):
        return
    meta = body["metadata"]
    await ctx.client.patch_status(plural, meta["namespace"], meta["name"], status)


async def write_late_terminal(ctx: Context, body: Mapping[str, Any], plural: str = PLURAL) -> None:
    """A job that finished under an older operator gets its terminal condition (and Ready False)
    here, once; only the conditions are written, the rest of a finished job's status is its own."""
    old = body.get("status") or {}
    late = conditions.late_terminal(old, body["metadata"].get("generation"))
    if late is not None:
        await write_status(ctx, body, {"conditions": late}, plural)


def _event(ctx: Context, body: Mapping[str, Any], kind: str, reason: str, message: str) -> None:
    ctx.post_event(body, kind, reason, message)


def with_rank_view(ctx: Context, entry: queue.QueuedJob, job: Any, status: Mapping[str, Any]
                   ) -> queue.QueuedJob:
    """The job's queue entry with how the goodput allocator ranks it (allocation.rank_view), at
    the prior for its virtual cluster's GPUs."""
    gpu_type = ctx.index.gpu_type(job.spec.virtual_cluster, job.spec.node_selector)
    return dataclasses.replace(entry, ranked=allocation.rank_view(job, status, gpu_type))


async def reconcile(ctx: Context, body: Mapping[str, Any]) -> str:
    """Bring one job one step closer to its spec; returns the phase written."""
    if (taken := await namesakes.older_namesake(ctx, body)) is not None:
        return await stall(ctx, body, namesakes.REASON, taken)
    body = await images.pin(ctx, PLURAL, body)  # before anything is built from the spec
    meta = body["metadata"]
    ns, name, generation = meta["namespace"], meta["name"], meta.get("generation")
    old = body.get("status") or {}
    if old.get("phase") in ("Succeeded", "Failed"):
        # Before validation: a finished job stays finished whatever its VirtualCluster or a newer
        # operator's rules say of its spec now (the API server checked its TTL's type at admission).
        ctx.queue.forget(ns, name)
        await write_late_terminal(ctx, body)
        await _clean_terminal(ctx, body, old["phase"])
        await _expire_finished(ctx, body, (body.get("spec") or {}).get("ttlSecondsAfterFinished"))
        return old["phase"]
    try:
        job, vc_spec = validation.load_job_on_cluster(body, ctx.index.vcs)
        validation.check_spec_alone(job)  # the checks `huorn validate` also makes
    except validation.InvalidSpec as exc:
        ctx.queue.forget(ns, name)
        return await stall(ctx, body, "InvalidSpec", str(exc))
    known = ctx.queue.jobs.get((ns, name))
    queued = with_rank_view(ctx, queue.build_entry(job, meta, known.missing if known is not None else 0),
                            job, old)
    ctx.queue.record(queued)

    fresh = compiler.compile(job)
    graph = serialise.from_status(old["graph"]) if old.get("graph") else fresh
    trainer, spec_trainer = graph.vertex("trainer"), fresh.vertex("trainer")
    trainer.min_replicas, trainer.max_replicas = spec_trainer.min_replicas, spec_trainer.max_replicas
    # Parameters the monitor set at run time (the mitigation rung) survive; the spec owns the rest.
    kept = {k: v for k, v in trainer.params.items() if k in RUNTIME_PARAMS}
    in_force = trainer.params.get("spec") if old.get("graph") else None  # what the pods started from
    trainer.params, trainer.resources = {**spec_trainer.params, **kept}, spec_trainer.resources
    ref = manifests.JobRef.from_body(body)
    spec = body.get("spec") or {}
    selector = f"{manifests.LABEL_JOB}={name},{manifests.LABEL_VERTEX}=trainer"
    base_status: dict[str, Any] = {"observedGeneration": generation, "selector": selector}

    pods = {p.name: p for p in ctx.index.pods_of(ns, name)}
    new: list[Mutation] = []
    running = [p for p in pods.values() if p.vertex == "trainer" and p.holds_resources and not p.deleting]
    started = bool(running) or bool(old.get("startTime") or old.get("lastCheckpoint"))
    changed = spec_changes(in_force, trainer.params["spec"]) if started else []
    refused = [k for k in changed if k in REFUSED_ONCE_STARTED]
    if refused:
        # the spec in force keeps the refused fields: the graph, the ConfigMap and any pod placed
        # from here (a replacement, growth) carry what the gang started with
        assert in_force is not None
        kept_fields = {k: in_force[k] for k in refused if k in in_force}
        trainer.params["spec"] = {**trainer.params["spec"], **kept_fields}
        spec = {**spec, **kept_fields}
        base_status["specChangeRefused"] = (
            f"spec.{refused[0]} changed after the job started and is not applied: the checkpoints hold the "
            f"architecture the gang started with, which it keeps; revert spec.{refused[0]}, or train the "
            "new one as a new TrainingJob (task.kind cpt with task.initCheckpoint set to this job's "
            "checkpoint)")
        if old.get("specChangeRefused") != base_status["specChangeRefused"]:
            _event(ctx, body, "Warning", "SpecChangeRefused", base_status["specChangeRefused"])
    elif old.get("specChangeRefused"):
        base_status["specChangeRefused"] = None
    # only a running gang has processes to restart; without one the next gang starts on the spec
    changed = [k for k in changed if k not in refused] if running else []
    if job.spec.suspend and not _all_succeeded(ref, trainer, pods):
        return await _suspend(ctx, body, ref, graph, pods, base_status)
    if vc_spec is None:
        msg = (
            f"virtual cluster {job.spec.virtual_cluster!r} does not exist; "
            "create it or fix spec.virtualCluster"
        )
        return await _waiting(ctx, body, base_status, "Pending", "VirtualClusterNotFound", msg)
    if not trainer.active:
        # Resume. The pods the suspension stopped may still be checkpointing: their successors
        # would load a checkpoint half written, so they go first.
        stopping = [p for p in pods.values() if p.holds_resources]
        if stopping:
            message = (f"resuming: waiting for {len(stopping)} pods stopped by the suspension to "
                       "checkpoint and exit")
            return await _waiting(ctx, body, base_status, "Pending", "Resuming", message, event="Normal")
        checkpoint = (old.get("lastCheckpoint") or {}).get("step")
        since = f"the checkpoint of step {checkpoint}" if checkpoint is not None else "its last checkpoint"
        resumed = mutate.resume(graph, suspendable_vertices(graph), reason=(
            f"spec.suspend is false: resuming at {trainer.replicas} trainer replicas from {since}"))
        if resumed is not None:
            new.append(resumed)
    started = _start_time(old, [pods.get(manifests.pod_name(ref, i)) for i in trainer.instances])
    if started and not old.get("startTime"):
        base_status["startTime"] = iso_time(started)
    deadline = job.spec.active_deadline_seconds
    if deadline is not None and started and not _all_succeeded(ref, trainer, pods):
        ran = time.time() - started
        if ran >= deadline:
            why = (f"the job ran {ran:.0f} s since status.startTime, past spec.activeDeadlineSeconds "
                   f"({deadline} s); its pods were stopped (trainers checkpoint on SIGTERM)")
            return await _fail(ctx, body, graph, base_status, why, reason="DeadlineExceeded")
        ctx.wake_later(ns, name, deadline - ran)
    budget = job.spec.remediation.max_restarts
    now, start_seconds = time.time(), ctx.settings.trainer_start_seconds
    # From the log as this reconcile found it: the pods failing now are one incident, and all
    # are replaced together or all wait.
    backoff = failures.replacement_backoff(graph.log, now, ctx.settings.replacement_backoff_seconds,
                                           ctx.settings.replacement_backoff_max_seconds)
    held: list[str] = []
    # The store pod too: restartPolicy Always restarts its container in place, but an evicted store
    # pod stays Failed (and one that never starts stays Pending), and the gang cannot rendezvous
    # without it. Its successor gets a new name behind the same Service.
    for instance in [*trainer.instances, *graph.vertex("rendezvous").instances]:
        pod = pods.get(manifests.pod_name(ref, instance))
        if pod is None:
            continue
        stuck = not pod.deleting and pod.never_started(now, start_seconds)
        if pod.phase != "Failed" and not stuck:
            continue
        what = (f"pod {pod.name} did not start within {start_seconds:.0f} s ({pod.not_started_reason()})"
                if stuck else f"pod {pod.name} {pod.failure()}")
        if pod.reclaimed_by and not stuck:
            # deleted by the reclaim of a lender another install lends (operator.loans): the
            # lender's, not the job's failure, so neither the budget nor the back-off counts it
            why = (f"{what}: virtual cluster {pod.reclaimed_by} reclaimed its GPUs; replacing it, not "
                   "counted against spec.remediation.maxRestarts")
            new.append(mutate.replace_instance(graph, instance.name, reason=why[:REASON_LIMIT],
                                               counted=False))
            continue
        verdict = failures.judge(pod, job.spec.remediation.pod_failure_policy, never_started=stuck)
        allowed = job.spec.remediation.max_mitigation.value == "restart"
        # An S3 roll or a preemption replaces healthy pods on purpose, and a failure the
        # podFailurePolicy ignores is not the job's; none of those spend the failure budget.
        used = restarts_used(graph, old)
        ignored = verdict.action == FailureAction.IGNORE
        if verdict.action == FailureAction.FAIL_JOB or not allowed or (used >= budget and not ignored):
            why = f"{what}; " + (
                verdict.why
                if verdict.action == FailureAction.FAIL_JOB
                else "restarts are not allowed (spec.remediation.maxMitigation)"
                if not allowed
                else f"replacement budget of {budget} used up"
            )
            reason = "PodFailurePolicy" if verdict.rule is not None else "Failed"
            return await _fail(ctx, body, graph, base_status, why[:REASON_LIMIT], reason=reason)
        if backoff.seconds > 0:
            held.append(what)
            continue
        because = f" ({verdict.why}, not counted against spec.remediation.maxRestarts)" if ignored else ""
        reason = f"{what}; replacing it{because}"[:REASON_LIMIT]
        new.append(mutate.replace_instance(graph, instance.name, reason=reason, counted=not ignored,
                                           failure=True))
    base_status["restartsUsed"] = restarts_used(graph, old)
    if (ignored := ignored_failures(graph)) is not None:
        base_status["ignoredFailures"] = ignored
    if held:
        # Out of line until the back-off ends, as an RLJob in back-off: a job behind it would
        # otherwise step back for it ("ahead and fits") while it waits, and free GPUs stay idle.
        ctx.queue.record(dataclasses.replace(queued, missing=0))
        ctx.wake_later(ns, name, backoff.seconds)
        more = f" (and {len(held) - 1} more)" if len(held) > 1 else ""
        # An absolute time, so the message (and its Event) stays the same until then.
        message = (f"{held[0]}{more}; replacing at {iso_time(now + backoff.seconds)}: back-off after "
                   f"{backoff.incidents} failure{'s' if backoff.incidents > 1 else ''} in the last "
                   f"{failures.BACKOFF_WINDOW_SECONDS / 60:.0f} min")
        phase = old.get("phase") if old.get("phase") in ("Running", "Resizing") else "Placing"
        return await _waiting(ctx, body, base_status, phase, "BackOff", message[:REASON_LIMIT])

    trainer_pods = [pods.get(manifests.pod_name(ref, i)) for i in trainer.instances]
    finished = trainer_pods and all(p is not None and p.phase == "Succeeded" for p in trainer_pods)
    last = evaluation.final_checkpoint(graph, job) if finished and not new else None
    # The previous eval's pod goes first (evaluation.still_leaving): this reconcile deletes it.
    leaving = last is not None and evaluation.still_leaving(graph, pods.values())
    if last is not None and not leaving and not evaluation.in_flight(graph):
        # The last checkpoint is evaluated before the job is done, through the shared loop as any
        # other: the edge fires and the CheckpointEdgeManager activates the eval vertex.
        observation = monitor.Observation(time=time.time(), checkpoint=last, finished=True)
        new += monitor.Monitor(graph, observe.ObservedBackend(observation), []).tick().mutations
    # An eval in flight finishes first (its result, or a re-run on a newer checkpoint, still counts).
    if finished and not new and not leaving and not evaluation.in_flight(graph):
        status = {
            **base_status,
            "phase": "Succeeded",
            "completionTime": iso_time(time.time()),
            "replicas": 0,
            "progressPercent": 100,
            "estimatedRemainingSeconds": 0,
            "estimatedRemaining": estimates.human_seconds(0),
            "graph": serialise.to_status(graph),
            "conditions": conditions.build_conditions(
                old.get("conditions"), generation, ready=(False, "Succeeded", "training finished"),
                terminal=(conditions.SUCCEEDED, "Succeeded", "training finished"),
            ),
        }
        await write_status(ctx, body, status)
        _event(ctx, body, "Normal", "Succeeded", "every trainer pod finished")
        await _clean_terminal(ctx, body, "Succeeded")
        ctx.metrics.record_phase(KIND, f"{ns}/{name}", "Succeeded")
        return "Succeeded"

    desired = desired_replicas(job, trainer.replicas)
    if trainer.replicas != desired:
        bound = "minReplicas" if desired == job.spec.elasticity.min_replicas else "maxReplicas"
        value = getattr(job.spec.elasticity, "min_replicas" if bound == "minReplicas" else "max_replicas")
        resized = mutate.resize(
            graph,
            "trainer",
            desired,
            reason=f"scale {trainer.replicas}→{desired}: spec.elasticity.{bound} is {value}",
        )
        if resized is not None:
            new.append(resized)

    new += _plan_resplit(graph, ref, pods, old, base_status)
    if changed and not any(m.detail.get("drain") for m in new):
        rolled = roll_for_spec(graph, ref, pods, changed)
        if rolled:
            _event(ctx, body, "Normal", "SpecChanged", rolled[0].reason)
        new += rolled
    waiting = await _drain_replaced(ctx, body, ref, graph, spec, pods, new, base_status)
    if waiting is not None:
        return waiting

    await cordon.ensure_cordoned(ctx, body, graph)
    placed = set(pods) | ctx.index.creating(ns, name)
    missing = [i for i in graph.vertex("trainer").instances if manifests.pod_name(ref, i) not in placed]
    reserved: list[PodRecord] = []
    assignments: dict[str, str] = {}
    tolerations: dict[str, list[dict[str, Any]]] = {}  # by node, read with the placement
    # In line once it could not be placed, and only below its minimum (a new gang, a lost
    # member): growth is an extra, which comes after every waiting gang and stops no one. A job
    # that has not tried yet is not in line, so a burst of new jobs places as fast as before.
    below_minimum = len(graph.vertex("trainer").instances) - len(missing) < trainer.min_replicas
    in_line = dataclasses.replace(queued, missing=len(missing) if below_minimum else 0)
    going: list[PodRecord] = []  # pods of replicas a resize in status removed, deleted unlocked
    wait: tuple[str, str, str, str] | None = None  # phase, reason, message, event: not placed
    if not missing:
        ctx.queue.record(dataclasses.replace(queued, missing=0))
    else:
        # Only the snapshot, the line and the reservation under the lock, no API call: every
        # job's placement waits on it, and a write retried through 429s would stall them all.
        async with ctx.placement_lock:
            gpus = job.spec.resources.gpus
            snap = ctx.index.build_snapshot()
            phase = old.get("phase") if old.get("phase") in ("Running", "Resizing") else "Pending"
            ahead = ctx.queue.first_ahead_that_fits(queued, snap, growth=not below_minimum)
            hints = allocation.placement_hints(graph)
            where = None if ahead is not None else allocation.place_missing(
                snap, job.spec.virtual_cluster, [i.name for i in missing], gpus, hints,
                job.spec.node_selector)
            if not isinstance(where, placement.Placement):
                # Replicas a resize in status removed (a move to the allocator's nodes) go now, as a
                # shrink's do: kept while the new ones wait, they ran outside the graph, unseen by
                # the monitor, the loans and the preemptions. So do the pods this reconcile
                # replaces (one that never started still holds its GPUs here): their decisions are
                # written below before they go, else a gang that fills its cluster could never
                # place a successor while its stuck pod holds the GPUs, and would wait forever.
                going = _removed_pods(ref, graph, pods, unwritten=[m for m in new if m.action != "replace"])
                ctx.queue.record(in_line)
            if ahead is not None:
                ctx.wake_queued(ahead)
                message = (f"queued behind {ahead.binding} (priority {ahead.priority}), which waited "
                           "first and fits in the free GPUs" if below_minimum else
                           f"growth waits: {ahead.binding} (priority {ahead.priority}) waits for GPUs and "
                           "fits in the free ones, and growth comes after the line")
                wait = (phase, "Queued", message, "Normal")
            elif not isinstance(where, placement.Placement):
                assert where is not None
                ctx.metrics.decisions.labels(KIND, "unplaceable").inc()
                # (not for the GPUs of its own pods it is deleting: the mirror still counts them
                # held, and lower-priority gangs would be stopped for what it is freeing itself)
                message = (plan_preemption(ctx, queued, len(missing), where.reason)
                           if below_minimum and not going else where.reason)
                wait = (phase, "Unplaceable", message, "Warning")
            else:
                for instance, node in zip(missing, where.assignments, strict=True):
                    assignments[instance.name] = node
                    tolerations.setdefault(node, ctx.index.tolerations_on(node))
                    reserved.append(
                        PodRecord(
                            namespace=ns,
                            name=manifests.pod_name(ref, instance),
                            job=name,
                            vertex="trainer",
                            instance=instance.name,
                            node=node,
                            gpus=gpus,
                            cpu_milli=0,
                            virtual_cluster=job.spec.virtual_cluster,
                        )
                    )
                ctx.index.reserve(reserved)
                if not base_status.get("startTime", old.get("startTime")):
                    # In the write-ahead patch below; a resume cleared it, so its clock starts again.
                    base_status["startTime"] = iso_time(time.time())
                ctx.queue.record(dataclasses.replace(queued, missing=0))
                if queued.missing:
                    # The line moved: those that stepped back behind this job try again now.
                    ctx.wake_line(queued.virtual_cluster)
    if wait is not None:
        phase, reason, message, event = wait
        replaced = [m for m in new if m.action == "replace"]
        if replaced:
            # Write-ahead, in the waiting status itself: the replacements (and whatever else this
            # reconcile decided) are recorded, so the budget is spent once and the pods they
            # replace can go; their successors are placed once the GPUs are free.
            base_status.update(graph=serialise.to_status(graph), decisions=build_decisions(graph),
                               targetReplicas=desired)
            # not Unplaceable: the GPUs it waits for may be those of the pods it replaces
            reason, event = "Replacing", "Normal"
            message = (f"replacing {len(replaced)} pod(s): the successors are placed once the pods they "
                       f"replace are gone (now: {message})")[:REASON_LIMIT]
        waited = await _waiting(ctx, body, base_status, phase, reason, message, event=event)
        for m in new if replaced else []:
            ctx.metrics.decisions.labels(KIND, m.action).inc()
            _event(ctx, body, "Normal", m.action.capitalize(), m.reason)
        await _delete_pods(ctx, graph, going)  # (set only where placement failed, so wait is)
        return waited

    # Write-ahead: the decision is in status before any pod changes.
    try:
        if new or missing:
            phase = _phase(graph, trainer_pods_running=0, total=1, has_new=True, old=old)
            await write_status(
                ctx,
                body,
                {
                    **base_status,
                    "phase": phase,
                    "graph": serialise.to_status(graph),
                    "decisions": build_decisions(graph),
                    "targetReplicas": desired,
                },
            )
        for m in new:
            ctx.metrics.decisions.labels(KIND, m.action).inc()
            _event(ctx, body, "Normal", m.action.capitalize(), m.reason)
        if assignments:
            ctx.metrics.decisions.labels(KIND, "place").inc()
            chosen = list(assignments.values())
            nodes = ", ".join(f"{n}×{chosen.count(n)}" for n in sorted(set(chosen)))
            _event(ctx, body, "Normal", "Placed", f"placed {len(assignments)} trainer replicas: {nodes}")
        control, batch = manifests.micro_batch_control(graph), manifests.batch_control(graph)
        await _apply_children(ctx, body, ref, graph, spec, assignments, job.spec.virtual_cluster, pods,
                              control, tolerations, batch)
        if (version := manifests.control_version(control, batch)) is not None:
            base_status["controlVersion"] = version  # only once the ConfigMap has it
    except BaseException:
        ctx.index.release(reserved)
        raise
    created = {manifests.pod_name(ref, i) for i in graph.vertex("trainer").instances if i.name in assignments}
    return await _report(ctx, body, graph, base_status, created)


def restarts_used(graph: Graph, old: Mapping[str, Any]) -> int:
    """Replacements spent from spec.remediation.maxRestarts. S3 rolls, preemptions and the
    failures a pod failure policy ignores replace pods too, but none of them is the job failing."""
    return max(0, graph.action_counts.get("replace", 0) - graph.action_counts.get(mutate.UNCOUNTED_REPLACE, 0)
               - int(old.get("resplitReplacements") or 0) - int(old.get("preemptReplacements") or 0))


def ignored_failures(graph: Graph) -> int | None:
    """status.ignoredFailures: failed pods replaced under a pod failure policy's Ignore; None
    before the first. Not every replacement that spends no budget: a spec change's roll or an eval
    run again on a newer checkpoint replaces healthy pods, and neither is a failure."""
    return graph.action_counts.get(mutate.IGNORED_FAILURE)


def plan_preemption(ctx: Context, job: queue.QueuedJob, replicas: int, why: str) -> str:
    """Gangs of lower priority on the job's VirtualCluster's nodes that it may stop to start
    (huorn.scheduler.preemption); the handler applies them once this job's lock is released.
    Returns the waiting message, which says what is being done about it. For a TrainingJob and
    an RLJob alike (`job.kind`; an RLJob places `replicas` Ray workers on its own nodes).

    Planned on the cluster as it will be once the pods being deleted are gone: those of a gang
    shrunk for this job (or anyone) are coming free as surely as a stopped gang's. Before, only
    gangs stopping whole counted as gone; the next reconcile after a shrink, while the replicas
    given up still checkpointed, found the cluster as full as before and the shrunk gang with no
    surplus left, and stopped it (or another) whole as well."""
    # a job with a nodeSelector: only gangs on the nodes it selects free GPUs it can take
    members = {n.name for n in ctx.index.members_of(job.virtual_cluster)}
    selected = ({n.name for n in ctx.index.selected_members(job.virtual_cluster, job.node_selector)}
                if job.node_selector else None)
    candidates, stopping = ctx.queue.candidates((p for p in ctx.index.pods.values() if p.node in members),
                                                selected)
    snap = ctx.index.build_snapshot(leaving=False)
    plan = sched_preemption.plan_preemption(snap, job.virtual_cluster, replicas, job.gpus, job.priority,
                                            candidates, stopping, borrow=job.borrows,
                                            node_selector=job.node_selector)
    if plan is None:
        return why
    if not plan.victims and not plan.shrinks:
        return f"{why}; waiting for the pods of preempted jobs to checkpoint and exit"
    ctx.preemptions[job.key] = (plan, f"{job.binding} (priority {job.priority})", job.kind)
    if plan.shrinks:
        shrunk = ", ".join(f"{victim} by {len(replicas)}" for victim, replicas in plan.shrinks)
        return f"{why}; shrinking {shrunk} (lower priority, elastic) to make room"
    return f"{why}; preempting {', '.join(plan.victims)} (lower priority) to make room"


def _all_succeeded(ref: manifests.JobRef, trainer: Vertex, pods: Mapping[str, PodRecord]) -> bool:
    """Every trainer pod of the running gang finished: the job is done, and a suspend comes too
    late to stop anything."""
    mine = [pods.get(manifests.pod_name(ref, i)) for i in trainer.instances]
    return trainer.active and bool(mine) and all(p is not None and p.phase == "Succeeded" for p in mine)


def suspendable_vertices(graph: Graph) -> list[str]:
    """What a suspension stops: the gang, its rendezvous store, and an eval in flight."""
    return ["trainer", "rendezvous", *(v.name for v in evaluation.eval_vertices(graph))]


async def _suspend(
    ctx: Context, body: Mapping[str, Any], ref: manifests.JobRef, graph: Graph,
    pods: Mapping[str, PodRecord], base_status: dict[str, Any],
) -> str:
    """spec.suspend: record the decision, then delete every pod of the job gracefully (trainers
    checkpoint on SIGTERM within their grace period), and report Suspended. The decision renews
    the instances' names, so a resume never waits on a name a stopping pod still holds, and
    keeps their count, so it resumes at the size the allocator had chosen. Repeating any step
    is harmless: the mutation is recorded once, and deleting a pod that is going is skipped."""
    meta = body["metadata"]
    ctx.queue.forget(meta["namespace"], meta["name"])
    old = body.get("status") or {}
    trainer = graph.vertex("trainer")
    replicas = trainer.replicas
    reason = (f"spec.suspend is true: stopping {replicas} trainer replicas; they checkpoint on SIGTERM, "
              "and the job resumes from that checkpoint when spec.suspend is false"
              if pods else "spec.suspend is true: the job waits without pods until spec.suspend is false")
    suspended = mutate.suspend(graph, suspendable_vertices(graph), reason=reason, renew=bool(pods))
    if suspended is not None:
        # Write-ahead, as every decision: a restarted operator finds it and only finishes the deletes.
        wire = serialise.to_status(graph)
        decided = {"phase": "Suspended", "graph": wire, "decisions": build_decisions(graph)}
        await write_status(ctx, body, {**base_status, **decided})
        ctx.metrics.decisions.labels(KIND, "suspend").inc()
        _event(ctx, body, "Normal", "Suspended", suspended.reason)
    # A pod a recorded decision gave up with a grace of its own (a reclaim's) keeps that grace:
    # deleted again with the pod's own before the watch showed it going, it would be cut short.
    await _delete_pods(ctx, graph, [p for p in pods.values() if p.holds_resources])
    stopping = [p for p in pods.values() if p.holds_resources]
    checkpoint = (old.get("lastCheckpoint") or {}).get("step")
    if stopping:
        message = f"suspended: waiting for {len(stopping)} pods to checkpoint and exit"
    else:
        message = ("suspended: no pods run and no GPUs are held; set spec.suspend to false to resume"
                   + (f" from the checkpoint of step {checkpoint}" if checkpoint is not None else ""))
    status = {
        **base_status,
        **({"startTime": None} if old.get("startTime") else {}),  # a resume starts the deadline again
        "phase": "Suspended",
        "message": message,
        "replicas": sum(1 for p in stopping if p.vertex == "trainer"),
        "graph": serialise.to_status(graph),
        "decisions": build_decisions(graph),
        # No rate while nothing runs; the monitor writes the ETA again after the resume.
        "estimatedRemainingSeconds": None,
        "estimatedRemaining": None,
        "conditions": conditions.build_conditions(
            old.get("conditions"), base_status["observedGeneration"],
            ready=(False, "Suspended", message),
            reconciling=(True, "Suspending", message) if stopping else None,
            suspended=(True, "Suspended", message),
        ),
    }
    await write_status(ctx, body, status)
    ctx.metrics.record_phase(KIND, f"{meta['namespace']}/{meta['name']}", "Suspended")
    return "Suspended"


def _rolled(split: manifests.StageSplit, old: Mapping[str, Any]) -> bool:
    """Whether the gang already runs `split`. One whose set-param is known by no version any more
    (manifests.UNKNOWN_VERSION: an operator from before the stamps set it) was rolled if any
    split was: the log it fell out of recorded a roll of it, or of the one before it."""
    rolled = old.get("resplitVersion")
    return rolled == split.version or (split.version == manifests.UNKNOWN_VERSION and rolled is not None)


def _plan_resplit(graph: Graph, ref: manifests.JobRef, pods: Mapping[str, PodRecord],
                  old: Mapping[str, Any], base_status: dict[str, Any]) -> list[Mutation]:
    """Remediation S3 in a cluster: a new `stageLayers` changes which layers every rank holds,
    which a running trainer cannot do, so every live trainer pod is replaced with drain (a new
    generation, so a new pod name; the old pod gets SIGTERM and checkpoints). Once per decision:
    status.resplitVersion, written in the same patch as these replacements, names the set-param
    that was rolled."""
    split = manifests.stage_split(graph)
    if split is None or _rolled(split, old):
        return []
    reason = (f"remediation S3: restart on stage layers {list(split.layers)} from the last checkpoint "
              f"(set-param of graph version {split.version})")
    out = drain_gang(graph, ref, pods, reason)
    base_status["resplitVersion"] = split.version
    base_status["resplitReplacements"] = int(old.get("resplitReplacements") or 0) + len(out)
    return out


async def _drain_replaced(
    ctx: Context, body: Mapping[str, Any], ref: manifests.JobRef, graph: Graph,
    spec: Mapping[str, Any], pods: Mapping[str, PodRecord], new: list[Mutation],
    base_status: dict[str, Any],
) -> str | None:
    """Pods replaced with drain still hold their GPUs while they checkpoint, so their successors
    wait for them to go rather than being placed around them (or reported Unplaceable). Writes
    the decision first, then the ConfigMap (the new split), then deletes them gracefully (the
    pod's terminationGracePeriodSeconds: SIGTERM, checkpoint, exit). Every step is repeatable:
    a restarted operator finds the decision in status and the same pods still to delete."""
    drained = {m.detail["old"] for m in graph.log if m.action == "replace" and m.detail.get("drain")}
    wanted = {manifests.pod_name(ref, i) for i in graph.vertex("trainer").instances}
    going = [p for p in pods.values() if p.vertex == "trainer" and p.instance in drained
             and p.name not in wanted and p.holds_resources]
    if not going:
        return None
    old = body.get("status") or {}
    if new:
        await write_status(ctx, body, {
            **base_status, "phase": "Remediating", "graph": serialise.to_status(graph),
            "decisions": build_decisions(graph),
        })
        for m in new:
            ctx.metrics.decisions.labels(KIND, m.action).inc()
            if not m.detail.get("drain"):
                _event(ctx, body, "Normal", m.action.capitalize(), m.reason)
    split = manifests.stage_split(graph)
    control = manifests.micro_batch_control(graph)
    if split is not None and not _rolled(split, old):
        await ctx.client.apply(manifests.build_config_map(ref, spec, control, split,
                                                          manifests.batch_control(graph)))
        _event(ctx, body, "Normal", "Resplit",
               f"restarting {len(going)} trainer pods on stage layers {list(split.layers)} "
               f"from their checkpoint: {split.reason}"[:1024])
    await _delete_pods(ctx, graph, going)
    message = (f"waiting for {len(going)} trainer pods to checkpoint and exit before their "
               f"successors start" + (f" on stage layers {list(split.layers)}" if split else ""))
    return await _waiting(ctx, body, base_status, "Remediating", "Draining", message, event="Normal")


def spec_changes(in_force: Mapping[str, Any] | None, desired: Mapping[str, Any]) -> list[str]:
    """Top-level spec fields (wire names) that differ between the spec the gang runs and the
    desired one, leaving out those a running gang follows live (LIVE_FIELDS).

    NB: the spec in force was written out by the operator version that placed the gang; read
    through this version's model first, so that a default this version adds is no change (an
    upgrade of the operator must restart no one)."""
    if in_force is None:
        return []
    try:
        in_force = training_api.TrainingJobSpec.model_validate(in_force).to_wire()
    except pydantic.ValidationError:
        return []  # a spec this version cannot read: nothing to compare, nothing to roll
    keys = (set(in_force) | set(desired)) - LIVE_FIELDS - {"podMetadata"}
    changed = [k for k in keys if in_force.get(k) != desired.get(k)]
    # an empty podMetadata (or empty maps in it) renders the pods none does: no restart for it
    if manifests.job_pod_metadata(in_force) != manifests.job_pod_metadata(desired):
        changed.append("podMetadata")
    return sorted(changed)


def roll_for_spec(graph: Graph, ref: manifests.JobRef, pods: Mapping[str, PodRecord],
                  changed: list[str]) -> list[Mutation]:
    """A spec edit the running processes cannot pick up: every live trainer is replaced with drain
    (SIGTERM, one coordinated checkpoint, exit) and its successor starts on the new spec from that
    checkpoint, the whole gang at once, since ranks of two specs cannot train together. Not
    counted against spec.remediation.maxRestarts: it is the user's restart, not a failure."""
    fields = ", ".join(f"spec.{k}" for k in changed)
    return drain_gang(graph, ref, pods, f"spec changed ({fields}): the gang restarts on the new spec from "
                                        "its checkpoint", counted=False)


def drain_gang(graph: Graph, ref: manifests.JobRef, pods: Mapping[str, PodRecord], reason: str,
               counted: bool = True) -> list[Mutation]:
    """Every live trainer replaced with drain: the gang restarts together from one checkpoint."""
    out = []
    for instance in list(graph.vertex("trainer").instances):
        pod = pods.get(manifests.pod_name(ref, instance))
        if pod is not None and not pod.deleting and pod.holds_resources:
            out.append(mutate.replace_instance(graph, instance.name, drain=True, counted=counted,
                                               reason=reason))
    return out


def desired_replicas(job: Any, current: int) -> int:
    """`fixed` follows minReplicas (the scale subresource); `goodput` keeps what the allocator
    chose through the monitor, moved back inside [minReplicas, maxReplicas] when the spec moves."""
    el = job.spec.elasticity
    if el.policy != ElasticityPolicy.GOODPUT:
        return el.min_replicas
    return min(max(current, el.min_replicas), el.max_replicas)


def _phase(graph: Graph, trainer_pods_running: int, total: int, has_new: bool, old: Mapping[str, Any]) -> str:
    if trainer_pods_running == total and not has_new:
        return "Running"
    if graph.log and graph.log[-1].action == "resize" and old.get("phase") in ("Running", "Resizing"):
        return "Resizing"
    return old.get("phase") if old.get("phase") in ("Running", "Resizing") else "Placing"


async def _apply_children(
    ctx: Context,
    body: Mapping[str, Any],
    ref: manifests.JobRef,
    graph: Graph,
    spec: Mapping[str, Any],
    assignments: Mapping[str, str],
    vc: str,
    pods: Mapping[str, PodRecord],
    control: manifests.MicroBatchControl | None,
    tolerations: Mapping[str, list[dict[str, Any]]],
    batch: manifests.BatchControl | None = None,
) -> None:
    """Write the job's children; `tolerations`: each assigned node's, read where it was placed
    (under the placement lock), since a cluster edit between there and here would pin a pod to
    a node it does not tolerate."""
    old = body.get("status") or {}
    fresh_spec = old.get("observedGeneration") != (body.get("metadata") or {}).get("generation")
    version = manifests.control_version(control, batch)
    fresh_control = version is not None and old.get("controlVersion") != version
    writes = []
    if assignments or fresh_spec or fresh_control:
        split = manifests.stage_split(graph)
        writes += [manifests.build_config_map(ref, spec, control, split, batch),
                   manifests.build_store_service(ref)]
    for instance in graph.vertex("rendezvous").instances:
        if manifests.pod_name(ref, instance) not in pods:
            writes.append(manifests.build_store_pod(ref, instance, spec))
    for instance in graph.vertex("trainer").instances:
        node = assignments.get(instance.name)
        if node is not None:
            writes.append(manifests.build_trainer_pod(ref, graph, instance, node, spec, vc,
                                                      tolerations[node]))
    writes += evaluation.build_pods(ref, graph, spec, pods.values())
    # Independent objects, written concurrently: a gang of 64 pods is one round trip deep, not 64.
    # The ConfigMap goes first so that no pod ever starts without its config.
    if writes and writes[0]["kind"] == "ConfigMap":
        await ctx.client.apply(writes.pop(0))
    written = await ctx.apply_all(writes)
    for obj in written:
        # An eval pod is in the mirror at once: a reconcile right after this one (a newer
        # checkpoint handed to the vertex meanwhile) must not start a second one for the instance.
        if obj.get("kind", "Pod") == "Pod" and ((obj.get("metadata") or {}).get("labels") or {}).get(
                manifests.LABEL_VERTEX) == "eval":
            ctx.index.observe_pod(obj)
    wanted = {manifests.pod_name(ref, i) for v in graph.vertices.values() for i in v.instances}
    wanted |= evaluation.wanted_pods(graph, pods.values())
    await _delete_pods(ctx, graph, [p for p in pods.values() if p.name not in wanted])


def _removed_pods(ref: manifests.JobRef, graph: Graph, pods: Mapping[str, PodRecord],
                  unwritten: list[Mutation]) -> list[PodRecord]:
    """The trainer pods that mutations already in status removed from the graph, to delete (with
    the grace they set); those of `unwritten` ones wait for their decision's write-ahead."""
    wanted = {manifests.pod_name(ref, i) for i in graph.vertex("trainer").instances}
    held = {name for m in unwritten for name in removed_by(m)}
    return [p for p in pods.values() if p.vertex == "trainer" and p.name not in wanted
            and p.instance not in held and not p.deleting]


async def _delete_pods(ctx: Context, graph: Graph, pods: Iterable[PodRecord]) -> None:
    """Delete these pods (those not already terminating) at once, each with the grace the
    decision that removed it set (deletion_graces), else its own."""
    graces = deletion_graces(graph)
    await asyncio.gather(*(ctx.client.delete("Pod", p.namespace, p.name, grace_seconds=graces.get(p.instance))
                           for p in pods if not p.deleting))


# A mutation's detail key for the grace its pods are deleted with (a lender's reclaimGraceSeconds,
# huorn.operator.preempting): written with the decision, so an operator that dies between the
# status write and the deletes leaves it to the next reconcile, which deletes the same pods with
# the same grace. Before, that reconcile used the pods' own 30 s, cutting a longer checkpoint
# window short.
GRACE_KEY = "graceSeconds"


def removed_by(m: Mutation) -> list[str]:
    """The instances a decision took out of the graph: a resize's removed ones, a replacement's
    old one."""
    return [str(n) for n in [*m.detail.get("removed", ()), *([m.detail["old"]] if "old" in m.detail else [])]]


def deletion_graces(graph: Graph) -> dict[str, int]:
    """Instance → the grace its pod is deleted with, where the decision that removed it set one;
    other pods keep their own terminationGracePeriodSeconds."""
    graces: dict[str, int] = {}
    for m in graph.log:
        grace = m.detail.get(GRACE_KEY)
        if grace is None:
            continue
        for name in removed_by(m):
            graces[name] = int(grace)
    return graces


async def _report(
    ctx: Context, body: Mapping[str, Any], graph: Graph, base_status: dict[str, Any],
    created: set[str] | frozenset[str] = frozenset(),
) -> str:
    """Status from what the pods are doing now; pod events call reconcile again as they change.

    `created` names the pods this reconcile just created: their watch events may not have
    arrived yet, and the pod event of a new Pending pod does not reconcile again.
    """
    meta = body["metadata"]
    ref = manifests.JobRef.from_body(body)
    pods = {p.name: p for p in ctx.index.pods_of(meta["namespace"], meta["name"])}
    trainer = graph.vertex("trainer")
    names = [manifests.pod_name(ref, i) for i in trainer.instances]
    present = [pods[n] for n in names if n in pods]
    running = sum(1 for p in present if p.phase == "Running")
    existing = sum(1 for n in names if n in pods or n in created)
    total = trainer.replicas
    old = body.get("status") or {}
    phase = _phase(graph, running, total, has_new=False, old=old)
    if phase == "Running":
        conds = conditions.build_conditions(
            old.get("conditions"),
            base_status["observedGeneration"],
            ready=(True, "Running", f"{running}/{total} trainer pods running"),
        )
    else:
        message = f"{running}/{total} trainer pods running"
        held = [f"{p.name}: {p.waiting}" for p in present if p.phase == "Pending" and p.waiting]
        if held:  # why they are not: what `kubectl describe pod` would say first
            message = f"{message}; {'; '.join(held)}"[:REASON_LIMIT]
        conds = conditions.build_conditions(
            old.get("conditions"),
            base_status["observedGeneration"],
            ready=(False, "PodsNotRunning", message),
            reconciling=(True, phase, message),
        )
    status = {
        **base_status,
        "phase": phase,
        "replicas": existing,
        "graph": serialise.to_status(graph),
        "decisions": build_decisions(graph),
        "conditions": conds,
        "targetReplicas": total,
        "message": None,
    }
    await write_status(ctx, body, status)
    ctx.metrics.record_phase(KIND, f"{meta['namespace']}/{meta['name']}", phase)
    return phase


async def _waiting(
    ctx: Context,
    body: Mapping[str, Any],
    base_status: dict[str, Any],
    phase: str,
    reason: str,
    message: str,
    event: str = "Warning",
) -> str:
    old = body.get("status") or {}
    previous = next((c for c in old.get("conditions") or [] if c.get("type") == conditions.RECONCILING), {})
    if previous.get("message") != message:
        _event(ctx, body, event, reason, message)
    status = {
        **base_status,
        "phase": phase,
        "message": message,
        "conditions": conditions.build_conditions(
            old.get("conditions"),
            base_status["observedGeneration"],
            ready=(old.get("phase") == "Running", reason, message),
            reconciling=(True, reason, message),
        ),
    }
    await write_status(ctx, body, status)
    meta = body["metadata"]
    ctx.metrics.record_phase(KIND, f"{meta['namespace']}/{meta['name']}", phase)
    return phase


async def stall(ctx: Context, body: Mapping[str, Any], reason: str, message: str,
                plural: str = PLURAL, kind: str = KIND) -> str:
    """`Stalled` with the reason and a message naming the field and the fix (an invalid spec):
    kstatus readers stop waiting, and the job's Event says it once."""
    meta = body["metadata"]
    old = body.get("status") or {}
    if old.get("message") != message:
        _event(ctx, body, "Warning", reason, message)
    status = {
        "phase": "Stalled",
        "observedGeneration": meta.get("generation"),
        "message": message,
        "conditions": conditions.build_conditions(
            old.get("conditions"),
            meta.get("generation"),
            ready=(False, reason, message),
            stalled=(True, reason, message),
        ),
    }
    await write_status(ctx, body, status, plural)
    ctx.metrics.record_phase(kind, f"{meta['namespace']}/{meta['name']}", "Stalled")
    return "Stalled"


async def _fail(
    ctx: Context,
    body: Mapping[str, Any],
    graph: Graph,
    base_status: dict[str, Any],
    why: str,
    reason: str = "Failed",
) -> str:
    """`reason` is the Ready and Stalled conditions' (Kubernetes Job's names where they exist:
    DeadlineExceeded, PodFailurePolicy), so `kubectl wait` and alerts can tell failures apart."""
    old = body.get("status") or {}
    status = {
        **base_status,
        "phase": "Failed",
        "message": why,
        "completionTime": old.get("completionTime") or iso_time(time.time()),
        "replicas": 0,
        "graph": serialise.to_status(graph),
        "conditions": conditions.build_conditions(
            old.get("conditions"),
            base_status["observedGeneration"],
            ready=(False, reason, why),
            stalled=(True, reason, why),
            terminal=(conditions.FAILED, reason, why),
        ),
    }
    await write_status(ctx, body, status)
    ctx.metrics.decisions.labels(KIND, "fail").inc()
    _event(ctx, body, "Warning", reason, why)
    await _clean_terminal(ctx, body, "Failed")
    meta = body["metadata"]
    ctx.metrics.record_phase(KIND, f"{meta['namespace']}/{meta['name']}", "Failed")
    return "Failed"


def _start_time(old: Mapping[str, Any], trainer_pods: list[PodRecord | None]) -> float:
    """status.startTime in seconds; without one, the oldest trainer pod's creation (a job placed
    by a Huorn that did not write it, or whose write was lost); 0.0 while nothing was placed."""
    if old.get("startTime"):
        return index.parse_time(old["startTime"])
    created = [p.created for p in trainer_pods if p is not None and p.created > 0]
    return min(created) if created else 0.0


async def _expire_finished(ctx: Context, body: Mapping[str, Any], ttl: int | None) -> None:
    """spec.ttlSecondsAfterFinished: delete the finished job once its time is up (its finalizer
    then deletes the children); until then, a wake at that moment rather than the next resync."""
    if ttl is None:
        return
    meta, old = body["metadata"], body.get("status") or {}
    finished = index.parse_time(old.get("completionTime"))
    if not finished:
        # Finished before completionTime was written: its clock starts now, and never earlier.
        finished = time.time()
        await write_status(ctx, body, {"completionTime": iso_time(finished)})
    left = finished + ttl - time.time()
    if left > 0:
        ctx.wake_later(meta["namespace"], meta["name"], left)
        return
    if await ctx.client.delete_custom(PLURAL, meta["namespace"], meta["name"]):
        _event(ctx, body, "Normal", "Expired",
               f"deleted {ttl} s after it {str(old.get('phase')).lower()} (spec.ttlSecondsAfterFinished)")


async def _clean_terminal(ctx: Context, body: Mapping[str, Any], phase: str) -> None:
    """A finished job frees its rendezvous store; a failed one frees every GPU too."""
    meta = body["metadata"]
    ctx.queue.forget(meta["namespace"], meta["name"])
    for pod in ctx.index.pods_of(meta["namespace"], meta["name"]):
        if pod.deleting or (phase == "Succeeded" and pod.vertex == "trainer"):
            continue
        # A finished eval pod goes too: its result is in status already.
        if pod.vertex in ("rendezvous", "eval") or pod.holds_resources:
            await ctx.client.delete("Pod", pod.namespace, pod.name)


async def delete_children(ctx: Context, body: Mapping[str, Any]) -> int:
    """Delete every child the job owns, found by label, from the API rather than the mirror; 404s
    count as done. Only its own: a namesake of another kind (refused, namesakes) shares the label."""
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    deleted = 0
    labels = {manifests.LABEL_JOB: name}
    for kind in ("Pod", "Service", "ConfigMap"):
        for obj in await ctx.client.list(kind, namespace, labels):
            if namesakes.owns(body, obj):
                deleted += await ctx.client.delete(kind, namespace, obj["metadata"]["name"])
    if not namesakes.refused(body):  # else the reservations are its namesake's
        ctx.index.release([r for r in ctx.index.reservations.values() if r.job_key == (namespace, name)])
    return deleted
