"""RLJob in the cluster: one Ray cluster per job (a head and GPU workers), placed as a gang on the
job's virtual cluster, restarted as a gang, finished when its single controller is.

The compiled graph has one vertex per ROLL role (actor-train, rollout, reference, reward); the
controller places those as Ray actors itself. What the operator places is the Ray cluster under
them, so the first reconcile inserts two vertices into the graph, with the reason in the log:
`ray-head` (one pod: Ray's head node and the controller, no GPU) and `ray-worker` (one pod of
`spec.resources.gpus` GPUs for each share of the job's `spec.gpus`; api.rl.ray_layout).

- **Placement.** All or nothing: every worker finds room on the virtual cluster's own nodes
  (best fit, fullest node first, as InferenceJob replicas are placed), or none is created and
  the job says what it waits for. Nothing is borrowed, so an RLJob is no victim of reclaim.
- **Priority.** An RLJob is in the TrainingJobs' line (huorn.operator.queue), as a gang of Ray
  workers that borrows nothing (`borrows=False`: the line and preemption place it on its own
  nodes only). A gang steps back for a job ahead of it in line that fits, and a job behind it
  steps back for it; while it waits, it stops (`preempt`) or shrinks running gangs of lower
  priority on its virtual cluster's nodes, TrainingJobs or RLJobs, by the rules of
  huorn.scheduler.preemption; and a waiting job of higher priority may stop it.
- **Suspend.** The head is stopped first, the workers once it has gone (`_suspend`).
- **Failures.** A pod that ends while the controller runs is a gang failure: Ray's actors on a
  lost node are gone, so every pod of the gang is replaced (a new generation each) and the
  controller resumes from its last checkpoint on a fresh Ray cluster. Each failure is judged
  as a TrainingJob's (huorn.operator.failures: spec.remediation.podFailurePolicy, exit code 2 is
  the controller refusing its config and fails the job) and spends one of
  spec.remediation.maxRestarts unless a rule ignores it; restarts back off as Kubernetes Job's.
- **The end.** The head pod's exit code is the controller's: Succeeded ends the job and stops
  the workers; a refusal or a spent budget fails it, naming the pod and why. Either end writes
  its terminal condition (Succeeded or Failed, huorn.operator.conditions), as a TrainingJob's.

Every decision is a graph mutation written to status before any pod is created or deleted for
it, so a restarted operator neither restarts a gang twice nor loses a restart.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import pydantic

from huorn.api import kinds, rl
from huorn.api import training as training_api
from huorn.api.common import FailureAction
from huorn.backends.kubernetes import manifests, observe
from huorn.backends.kubernetes import rl_manifests as rlm
from huorn.graph import compiler, mutate, serialise
from huorn.graph.model import ExecutionMode, Graph, Instance, ResourceRequest, Vertex
from huorn.operator import (
    conditions,
    daemons,
    failures,
    images,
    index,
    namesakes,
    queue,
    serving,
    validation,
)
from huorn.operator.context import Context
from huorn.operator.training import (
    REASON_LIMIT,
    build_decisions,
    iso_time,
    plan_preemption,
    stall,
    write_late_terminal,
    write_status,
)

PLURAL = "rljobs"
KIND = "RLJob"
logger = logging.getLogger("huorn.operator.rljobs")


def build_ray_vertices(layout: rl.RayLayout) -> list[Vertex]:
    head = Vertex(rlm.HEAD, rlm.HEAD, 1, 1, ResourceRequest(0), ExecutionMode.GANG)
    workers = Vertex(rlm.WORKER, rlm.WORKER, layout.workers, layout.workers,
                     ResourceRequest(layout.gpus_per_worker), ExecutionMode.GANG,
                     params={"gpusPerWorker": layout.gpus_per_worker})
    return [head, workers]


def restore_graph(body: Mapping[str, Any], fresh: Graph, layout: rl.RayLayout) -> Graph:
    """The graph in status (its Ray vertices and their generations are the job's history), or
    the compiled one with the Ray cluster inserted, for a job never placed."""
    old = (body.get("status") or {}).get("graph")
    if old:
        graph = serialise.from_status(old)
        if rlm.HEAD in graph.vertices:
            return graph
    else:
        graph = fresh
    shape = (f"{layout.workers} worker(s) of {layout.gpus_per_worker} GPU(s)" if layout.workers
             else "no GPU worker (a CPU-only job: the head runs every actor)")
    mutate.insert_vertices(graph, build_ray_vertices(layout), [], reason=(
        f"placed as one Ray cluster: a head (the single controller, no GPU) and {shape}"))
    return graph


def refused_model(job: kinds.RLJob, graph: Graph, old: Mapping[str, Any],
                  pods: Mapping[str, index.PodRecord]) -> dict[str, Any] | None:
    """The model the job started with, when spec.model now names another and the job has started
    (a live pod, or a recorded checkpoint or step): its checkpoints hold that architecture, and a
    gang restarted on another would fail to resume from them. None when the edit may go through.
    The actor's vertex keeps the model it was compiled with (restore_graph keeps the graph)."""
    actor = graph.vertices.get("actor-train")
    in_force = actor.params.get("model") if actor is not None else None
    started = any(p.holds_resources and not p.deleting for p in pods.values()) or bool(
        old.get("lastCheckpoint") or old.get("step"))
    if not isinstance(in_force, dict) or not started:
        return None
    return dict(in_force) if _holds_spec_model(job, actor) is False else None


def _model_follows_spec(job: kinds.RLJob, graph: Graph) -> bool:
    """Set the actor vertex's model to the spec's (the caller has found that allowed); whether it
    changed."""
    actor = graph.vertices.get("actor-train")
    if actor is None or _holds_spec_model(job, actor):
        return False
    actor.params = {**actor.params, "model": job.spec.model.to_wire()}
    return True


def _holds_spec_model(job: kinds.RLJob, actor: Vertex | None) -> bool | None:
    """Whether the actor vertex holds the spec's model; None when what it holds no longer reads as
    a model (today's API refuses it)."""
    try:
        return training_api.ModelSpec.model_validate((actor.params if actor else {}).get("model")) \
            == job.spec.model
    except pydantic.ValidationError:
        return None


def fit_layout(graph: Graph, layout: rl.RayLayout) -> None:
    """Make the worker vertex the spec's layout. Only between gangs: the caller restarts a
    running gang whose spec changed before the pods of the new layout are made."""
    workers = graph.vertex(rlm.WORKER)
    before = (workers.replicas, int(workers.params.get("gpusPerWorker", 0)))
    if before == (layout.workers, layout.gpus_per_worker):
        return
    workers.min_replicas = min(workers.replicas, layout.workers)
    workers.max_replicas = max(workers.replicas, layout.workers)
    workers.params = {**workers.params, "gpusPerWorker": layout.gpus_per_worker}
    workers.resources = ResourceRequest(layout.gpus_per_worker)
    mutate.resize(graph, rlm.WORKER, layout.workers, reason=(
        f"spec.gpus and spec.resources.gpus now make {layout.workers} Ray worker(s) of "
        f"{layout.gpus_per_worker} GPU(s) (were {before[0]} of {before[1]})"))
    workers.min_replicas = workers.max_replicas = layout.workers


def queue_entry(job: kinds.RLJob, meta: Mapping[str, Any], missing: int = 0) -> queue.QueuedJob:
    """Its entry in the line: a gang of Ray workers that borrows nothing and never shrinks."""
    layout = rl.ray_layout(job.spec)
    return dataclasses.replace(queue.build_entry(job, meta, missing), kind=KIND,
                               gpus=max(1, layout.gpus_per_worker), min_replicas=layout.workers,
                               elastic=False, borrows=False)


def entry_from_status(job: kinds.RLJob, body: Mapping[str, Any],
                      pods: Iterable[index.PodRecord]) -> queue.QueuedJob:
    """Its entry as its API object shows it, for a restarted operator's line: waiting with the
    Ray workers that have no pod while its Reconciling condition says WaitingForGPUs."""
    status = body.get("status") or {}
    reconciling = next((c for c in status.get("conditions") or [] if c.get("type") == "Reconciling"), {})
    missing = 0
    if reconciling.get("status") == "True" and reconciling.get("reason") == "WaitingForGPUs":
        present = sum(1 for p in pods if p.vertex == rlm.WORKER and p.holds_resources and not p.deleting)
        missing = max(0, rl.ray_layout(job.spec).workers - present)
    return queue_entry(job, body.get("metadata") or {}, missing)


def grow_workers(graph: Graph, layout: rl.RayLayout) -> None:
    """More Ray workers for a running gang: they join its Ray cluster as they start, and the
    controller places the rollout workers the spec now asks for on them. No restart."""
    workers = graph.vertex(rlm.WORKER)
    before = workers.replicas
    workers.max_replicas = layout.workers
    mutate.resize(graph, rlm.WORKER, layout.workers, reason=(
        f"spec.gpus now makes {layout.workers} Ray worker(s) of {layout.gpus_per_worker} GPU(s): adding "
        f"{layout.workers - before} to the running Ray cluster, which they join as they start (no restart)"))
    workers.min_replicas = layout.workers


def shrink_unstarted(graph: Graph, layout: rl.RayLayout, names: list[str]) -> None:
    """Fewer Ray workers for a running gang, when those that go never started: a smaller spec.gpus
    that takes back a growth still waiting for GPUs. No restart."""
    workers = graph.vertex(rlm.WORKER)
    workers.min_replicas = layout.workers
    mutate.resize(graph, rlm.WORKER, layout.workers, remove=names, reason=(
        f"spec.gpus now makes {layout.workers} Ray worker(s): the {len(names)} that never started "
        "(they waited for GPUs) go, and the running gang goes on (no restart)"))
    workers.max_replicas = layout.workers


def gang(graph: Graph) -> list[Instance]:
    return [*graph.vertex(rlm.HEAD).instances, *graph.vertex(rlm.WORKER).instances]


async def reconcile(ctx: Context, body: Mapping[str, Any]) -> str:
    """Bring one RLJob one step closer to a finished controller."""
    if (taken := await namesakes.older_namesake(ctx, body)) is not None:
        return await stall(ctx, body, namesakes.REASON, taken, PLURAL, KIND)
    body = await images.pin(ctx, PLURAL, body)  # before anything is built from the spec
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    old = body.get("status") or {}
    if old.get("phase") in ("Succeeded", "Failed"):
        # Before validation: a finished job stays finished whatever its VirtualCluster or a newer
        # operator's rules say of its spec now; a Stalled one would run again once they relent.
        ctx.queue.forget(ns, name)
        await write_late_terminal(ctx, body, PLURAL)
        await _stop(ctx, [p for p in ctx.index.pods_of(ns, name) if p.holds_resources])
        ctx.metrics.record_phase(KIND, f"{ns}/{name}", old["phase"])
        return str(old["phase"])
    try:
        job, vc_spec = validation.load_job_on_cluster(body, ctx.index.vcs)
        assert isinstance(job, kinds.RLJob)
        validation.check_spec_alone(job)  # the checks `huorn validate` also makes
        layout = rl.ray_layout(job.spec)
        fresh = compiler.compile(job)
    except (validation.InvalidSpec, ValueError) as exc:
        ctx.queue.forget(ns, name)
        return await stall(ctx, body, "InvalidSpec", str(exc), PLURAL, KIND)
    # in the line (huorn.operator.queue) on its own nodes; it keeps its place until it places
    entry = queue_entry(job, meta)
    known = ctx.queue.jobs.get(entry.key)
    ctx.queue.record(dataclasses.replace(entry, missing=known.missing if known is not None else 0))
    ref = manifests.JobRef.from_body(body)
    base: dict[str, Any] = {"observedGeneration": meta.get("generation"),
                            "selector": f"{manifests.LABEL_JOB}={name}"}
    pods = {p.name: p for p in ctx.index.pods_of(ns, name)}
    vc = job.spec.virtual_cluster
    if vc_spec is None:
        ctx.queue.record(entry)  # out of line: nothing to place it on
        message = f"virtual cluster {vc!r} does not exist; create it or fix spec.virtualCluster"
        return await _waiting(ctx, body, base, "VirtualClusterNotFound", message)

    graph = restore_graph(body, fresh, layout)
    version = graph.version
    model_in_force = refused_model(job, graph, old, pods)
    if model_in_force is None and _model_follows_spec(job, graph):
        # Not started yet: the gang will start on the spec's model, and the graph (what a started
        # job keeps) says so before any pod exists; else an edit before the start was reverted
        # once the job started, and its gang restarted on the model it had never run.
        await ctx.client.patch_status(PLURAL, ns, name, {"graph": serialise.to_status(graph)})
    if model_in_force is not None:
        base["specChangeRefused"] = (
            "spec.model changed after the job started and is not applied: its checkpoints hold the "
            "architecture it started with, which it keeps; revert spec.model, or train the new one as a "
            "new RLJob (spec.initCheckpoint)")
        if old.get("specChangeRefused") != base["specChangeRefused"]:
            ctx.post_event(body, "Warning", "SpecChangeRefused", base["specChangeRefused"])
    elif old.get("specChangeRefused"):
        base["specChangeRefused"] = None
    if job.spec.suspend:
        return await _suspend(ctx, body, graph, pods, base)
    if not graph.vertex(rlm.HEAD).active:
        stopping = [p for p in pods.values() if p.holds_resources]
        if stopping:
            ctx.queue.record(entry)  # out of line until its old pods are gone
            message = (f"resuming: waiting for {len(stopping)} pod(s) stopped by the suspension to "
                       "checkpoint and exit")
            return await _waiting(ctx, body, base, "Resuming", message)
        mutate.resume(graph, [rlm.HEAD, rlm.WORKER],
                      reason="spec.suspend is false: the gang starts again, from the last checkpoint")
    members = gang(graph)

    def pod_of(instance: Instance) -> index.PodRecord | None:
        return pods.get(manifests.pod_name(ref, instance))

    head = pod_of(members[0])
    if head is not None and head.phase == "Succeeded":
        return await _finish(ctx, body, graph, {**base, "step": job.spec.steps, "progressPercent": 100}, pods)
    now, limit = time.time(), ctx.settings.trainer_start_seconds
    live_now = [p for p in (pod_of(i) for i in members) if p is not None and not p.deleting]
    # a pod that ended, or one that never started (Kueue's waitForPodsReady, as for trainers)
    ended = [p for p in live_now if not p.holds_resources or p.never_started(now, limit)]
    restarts = int(old.get("restarts") or 0)
    if ended:
        policy = job.spec.remediation.pod_failure_policy
        verdicts = [(p, failures.judge(p, policy, never_started=p.holds_resources)) for p in ended]
        what = "; ".join(_describe(p, limit) for p in ended)
        final = next((v for _, v in verdicts if v.action == FailureAction.FAIL_JOB), None)
        counted = any(v.action == FailureAction.COUNT for _, v in verdicts)
        budget = job.spec.remediation.max_restarts
        if final is not None or (counted and restarts >= budget):
            why = f"{what}; " + (final.why if final is not None else f"restart budget of {budget} used up "
                                 "(spec.remediation.maxRestarts)")
            reason = "PodFailurePolicy" if final is not None and final.rule is not None else "Failed"
            return await _fail(ctx, body, graph, base, why[:REASON_LIMIT], reason, pods)
        backoff = failures.replacement_backoff(graph.log, now, ctx.settings.replacement_backoff_seconds,
                                               ctx.settings.replacement_backoff_max_seconds)
        if backoff.seconds > 0:
            ctx.queue.record(entry)  # out of line until the back-off ends: others go meanwhile
            ctx.wake_rl_later(ns, name, backoff.seconds)
            message = (f"{what}; restarting the gang at {iso_time(now + backoff.seconds)}: back-off after "
                       f"{backoff.incidents} failure(s) in the last "
                       f"{failures.BACKOFF_WINDOW_SECONDS / 60:.0f} min")
            return await _waiting(ctx, body, base, "BackOff", message[:REASON_LIMIT])
        because = "" if counted else " (a failure spec.remediation.podFailurePolicy ignores: not counted)"
        head_pod = pod_of(members[0])
        if head_pod is not None and head_pod.phase == "Running" and all(
                p.vertex == rlm.WORKER and p.holds_resources for p in ended):
            # Ray workers that never started hold no actor (a growth's, say): the running
            # controller goes on, and only they are replaced
            reason = (f"{what}; no actor ran there, so only that Ray worker is replaced and the "
                      f"controller goes on{because}")[:REASON_LIMIT]
            for p in ended:
                mutate.replace_instance(graph, p.instance, reason=reason, counted=counted, failure=True)
            ctx.post_event(body, "Warning", "WorkerReplaced", reason)
        else:
            reason = (f"{what}; the Ray cluster's actors went with it: restarting the whole gang, which "
                      f"resumes from the last checkpoint{because}")[:REASON_LIMIT]
            for instance in list(members):
                mutate.replace_instance(graph, instance.name, reason=reason, counted=counted, failure=True)
            ctx.post_event(body, "Warning", "GangRestarted", reason)
        restarts += int(counted)
    wire = job.spec.to_wire()
    if model_in_force is not None:
        wire["model"] = model_in_force  # the gang, its config and its pods' templates keep it
    templates = rlm.template_hashes(wire)
    live = [p for p in (pod_of(i) for i in members) if p is not None and p.holds_resources and not p.deleting]
    if not ended and any(p.template not in templates for p in live):
        # Ray's nodes and the controller read the spec once, at their start: a changed spec
        # restarts the gang on it (from the last checkpoint), not counted against the budget.
        reason = ("the spec changed since this gang started (spec.* other than priority and "
                  "remediation): restarting the whole gang on it, from the last checkpoint")
        for instance in list(members):
            mutate.replace_instance(graph, instance.name, reason=reason, drain=True, counted=False)
        ctx.post_event(body, "Normal", "GangRestarted", reason)
        live = []
    running_workers = graph.vertex(rlm.WORKER).replicas
    if live and layout.workers < running_workers:
        started = {p.instance for p in live if p.vertex == rlm.WORKER}
        unplaced = [i.name for i in graph.vertex(rlm.WORKER).instances if i.name not in started]
        if running_workers - len(unplaced) <= layout.workers:
            # what goes is a growth that never started (its workers waited for GPUs): no actor
            # ran there, so they go and the gang runs on (it had restarted whole, from its checkpoint)
            shrink_unstarted(graph, layout, unplaced[:running_workers - layout.workers])
            running_workers = layout.workers
    if live and layout.workers < running_workers:
        # A Ray node cannot leave under running actors (which node holds which is Ray's choice)
        running = sum(1 for p in live if p.vertex == rlm.WORKER)
        reason = (f"spec.gpus now makes {layout.workers} Ray worker(s), fewer than the {running} "
                  "running: restarting the whole gang on them, from the last checkpoint")
        for instance in list(members):
            mutate.replace_instance(graph, instance.name, reason=reason, drain=True, counted=False)
        ctx.post_event(body, "Normal", "GangRestarted", reason)
        live = []
    if not live:
        fit_layout(graph, layout)
    elif layout.workers > running_workers:
        grow_workers(graph, layout)
    base["restarts"] = restarts
    if graph.version != version:
        # Write-ahead: the mutation is in status before any pod is created or deleted for it.
        await ctx.client.patch_status(PLURAL, ns, name, {**base, "graph": serialise.to_status(graph),
                                                          "decisions": build_decisions(graph)})
        for m in graph.log:
            if m.version > version:
                ctx.metrics.decisions.labels(KIND, m.action).inc()
        members = gang(graph)
    wanted = {manifests.pod_name(ref, i) for i in members}
    await _stop(ctx, [p for p in pods.values() if p.name not in wanted and not p.deleting])

    spec = wire
    creating = ctx.index.creating(ns, name)  # placed, not yet seen by the watch
    missing = [i for i in members if pod_of(i) is None and manifests.pod_name(ref, i) not in creating]
    missing_workers = [i for i in missing if i.vertex == rlm.WORKER]
    # workers added to a running gang: growth, which waits behind the whole line and stops nobody
    growing = bool(live) and bool(missing_workers) and len(missing) == len(missing_workers)
    in_line = dataclasses.replace(entry, missing=0 if growing else len(missing_workers))
    preempting = ""
    async with ctx.placement_lock:
        # GPUs freed for a job that goes first (a preemption's, say) are its own
        snap = ctx.index.build_snapshot()
        ahead = ctx.queue.first_ahead_that_fits(in_line, snap, growth=growing) if missing_workers else None
        nodes = [] if ahead is not None else serving.choose_nodes(
            serving.free_gpus(ctx, vc, job.spec.node_selector), layout.gpus_per_worker, len(missing_workers))
        placed = ahead is None and len(nodes) == len(missing_workers)
        new_pods = []
        if placed:
            worker_gpus = layout.gpus_per_worker * sum(i.vertex == rlm.WORKER for i in members)
            worker_node = dict(zip(missing_workers, nodes, strict=True))
            new_pods = [rlm.build_head_pod(ref, i, spec, vc, worker_gpus) if i.vertex == rlm.HEAD
                        else rlm.build_worker_pod(ref, i, spec, layout.gpus_per_worker, worker_node[i], vc,
                                                  ctx.index.tolerations_on(worker_node[i]))
                        for i in missing]
            ctx.index.reserve(r for r in (index.build_pod_record(p) for p in new_pods) if r is not None)
            was_waiting = ctx.queue.jobs[entry.key].missing
            ctx.queue.record(entry)
            if was_waiting:
                ctx.wake_line(vc)  # the line moved: those that stepped back for it try again
        else:
            ctx.queue.record(in_line)
            if ahead is None and not growing:
                # stops or shrinks gangs of lower priority (applied by the handler, outside this
                # job's lock); the message says so
                preempting = plan_preemption(ctx, in_line, len(missing_workers), "")
    config = rlm.config_hash(ref, spec)
    try:
        if new_pods or (live and old.get("configHash") != config):
            # before any pod that reads it; a running controller re-reads it at every step
            await ctx.client.apply(rlm.build_rl_config_map(ref, spec))
            base["configHash"] = config
        if new_pods:
            await ctx.client.apply(rlm.build_head_service(ref))
            await ctx.apply_all(new_pods)  # the created ones reach the mirror even if one fails
    except BaseException:
        # not created (or not known to be): the next reconcile finds them missing, not creating
        ctx.index.release(r for r in (index.build_pod_record(p) for p in new_pods) if r is not None)
        raise
    growth = ""
    if placed:
        ctx.rl_waiting.pop((ns, name), None)
    elif growing:
        ctx.rl_waiting[(ns, name)] = vc  # GPUs freed on it wake this job (ctx.wake_line)
        if ahead is not None:
            ctx.wake_queued(ahead)
        selector = job.spec.node_selector
        on = f" on {serving.nodes_in_words(ctx, vc, selector)}" if selector else ""
        growth = (f"; {len(missing_workers)} more Ray worker(s) of {layout.gpus_per_worker} GPU(s) wait for "
                  f"room on virtual cluster {vc!r}{on}, after every job waiting in line")
    else:
        ctx.rl_waiting[(ns, name)] = vc  # GPUs freed on it wake this job (ctx.wake_line)
        free = sum(max(0, n) for n in serving.free_gpus(ctx, vc, job.spec.node_selector).values())
        message = (f"waiting for {len(missing_workers)} Ray worker(s) of {layout.gpus_per_worker} GPU(s) "
                   f"each on virtual cluster {vc!r} ({free} GPU(s) free on "
                   f"{serving.nodes_in_words(ctx, vc, job.spec.node_selector)}, none borrowed); "
                   "the gang starts when all of them fit")
        if ahead is not None:
            ctx.wake_queued(ahead)
            message += (f"; {ahead.binding} (priority {ahead.priority}) is ahead in line and fits now, "
                        "so it goes first")
        message += preempting
        return await _waiting(ctx, body, {**base, "graph": serialise.to_status(graph),
                                          "decisions": build_decisions(graph)}, "WaitingForGPUs", message)

    live_pods = [pod_of(i) for i in members]
    running = sum(1 for p in live_pods if p is not None and p.phase == "Running")
    started = min((p.created for p in live_pods if p is not None and p.phase == "Running" and p.created),
                  default=0.0)
    head_runs = live_pods[0] is not None and live_pods[0].phase == "Running"
    if running == len(members) or (head_runs and old.get("phase") == "Running"):
        # a running gang stays Running while workers added to it start (or wait for room)
        phase, reason = "Running", "ControllerRunning"
        message = (f"the controller runs on a Ray cluster of {running - 1} GPU worker(s)"
                   if running > 1 else "the controller runs, every actor on the head")
        joining = len(members) - running - (len(missing_workers) if not placed else 0)
        if joining:
            message += f"; {joining} more Ray worker(s) joining as they start"
        message += growth
    else:
        phase, reason = "Pending", "GangStarting"
        message = f"{running} of {len(members)} pod(s) of the Ray cluster running"
    status = {
        **base,
        "phase": phase,
        "replicas": sum(1 for p in live_pods if p is not None and p.holds_resources) + len(new_pods),
        "message": message,
        "graph": serialise.to_status(graph),
        "decisions": build_decisions(graph),
        "conditions": conditions.build_conditions(
            old.get("conditions"), meta.get("generation"),
            ready=(phase == "Running", reason, message),
            reconciling=(True, reason, message) if phase != "Running" else None),
    }
    if started and not old.get("startTime"):
        status["startTime"] = iso_time(started)
    await write_status(ctx, body, status, PLURAL)
    ctx.metrics.record_phase(KIND, f"{ns}/{name}", phase)
    return phase


def progress_status(seen: Mapping[str, Any]) -> dict[str, Any]:
    """The status fields of what the head's controller serves on /progress."""
    step, steps = int(seen.get("step", 0)), max(1, int(seen.get("steps", 1)))
    status: dict[str, Any] = {"step": step, "progressPercent": min(100, 100 * step // steps)}
    if seen.get("rewardMean") is not None:
        status["meanReward"] = round(float(seen["rewardMean"]), 6)
    if seen.get("evalAccuracy") is not None:
        status["evalAccuracy"] = round(float(seen["evalAccuracy"]), 6)
    if seen.get("rolloutWorkers") is not None:
        status["rolloutWorkers"] = int(seen["rolloutWorkers"])
    if isinstance(seen.get("roleReplicas"), Mapping):
        status["roleReplicas"] = {str(k): int(v) for k, v in seen["roleReplicas"].items()}
    if seen.get("attempt") is not None:
        status["controllerRestarts"] = max(0, int(seen["attempt"]) - 1)
    if seen.get("lastCheckpoint"):
        status["lastCheckpoint"] = {"step": int(seen["lastCheckpoint"]["step"]),
                                    "path": str(seen["lastCheckpoint"].get("path", ""))}
    return status


async def tick(ctx: Context, namespace: str, name: str) -> dict[str, Any] | None:
    """Read a running job's progress from its head pod and write what changed into status: at
    most every `progress_seconds`, a new checkpoint at once. Returns the patch written, if any."""
    body = await ctx.client.get_custom(PLURAL, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    status = body.get("status") or {}
    if status.get("phase") != "Running" or not (status.get("graph") or {}):
        return None
    graph = serialise.from_status(status["graph"])
    if rlm.HEAD not in graph.vertices:
        return None
    ref = manifests.JobRef.from_body(body)
    head = ctx.index.pods.get((namespace, manifests.pod_name(ref, graph.vertex(rlm.HEAD).instances[0])))
    if head is None or head.phase != "Running" or not head.ip:
        return None
    url = f"http://{head.ip}:{ctx.settings.telemetry_port}/progress"
    seen = await asyncio.to_thread(observe.fetch_snapshot, url, ctx.settings.telemetry_timeout_seconds)
    if seen is None:
        return None  # starting, or gone: the reconcile judges the pod, not this poll
    async with ctx.job_lock(namespace, name):
        # Under the lock, against the phase read now: a reconcile that marked the job Succeeded
        # (step and progress at their end) while this poll waited on the head must not be undone
        # by the older reading, which no later write would correct.
        body = await ctx.client.get_custom(PLURAL, namespace, name)
        status = (body or {}).get("status") or {}
        if body is None or status.get("phase") != "Running":
            return None
        patch = {k: v for k, v in progress_status(seen).items() if status.get(k) != v}
        now, key = time.time(), (namespace, name)
        urgent = {"lastCheckpoint", "controllerRestarts"} & patch.keys()  # written at once
        if not patch or (not urgent and now - ctx.rl_progress.get(key, 0.0) < ctx.settings.progress_seconds):
            return None
        await ctx.client.patch_status(PLURAL, namespace, name, patch)
    ctx.rl_progress[key] = now
    if patch.get("controllerRestarts", 0) > int(status.get("controllerRestarts") or 0):
        ctx.post_event(body, "Warning", "ControllerRestarted", (
            f"the controller failed and the head ran it again on the same Ray cluster, from the last "
            f"checkpoint (retry {patch['controllerRestarts']} of spec.controllerRetries; the pod's log says "
            "why)"))
    return patch


async def run_daemon(ctx: Context, namespace: str, name: str, stopped: Any) -> None:
    """The body of the per-RLJob kopf daemon (huorn.operator.daemons.every)."""
    await daemons.every(ctx.settings.monitor_seconds, stopped, lambda: tick(ctx, namespace, name),
                        f"progress poll of RLJob {namespace}/{name}", logger)


async def preempt(ctx: Context, namespace: str, name: str, reason: str) -> bool:
    """Stop a running gang for a job of higher priority: every pod is replaced (drain, not
    counted against maxRestarts), the decision written first; the new gang queues for GPUs
    again and resumes from the last checkpoint. False when no pod of it holds GPUs."""
    async with ctx.job_lock(namespace, name):
        body = await ctx.client.get_custom(PLURAL, namespace, name)
        if body is None or not (body.get("status") or {}).get("graph"):
            return False
        graph = serialise.from_status(body["status"]["graph"])
        if rlm.HEAD not in graph.vertices:
            return False
        ref = manifests.JobRef.from_body(body)
        pods = {p.name: p for p in ctx.index.pods_of(namespace, name)}
        live = [p for i in gang(graph) if (p := pods.get(manifests.pod_name(ref, i))) is not None
                and p.holds_resources and not p.deleting]
        if not any(p.gpus for p in live):
            return False
        why = f"{reason}; the gang restarts from its last checkpoint once it fits again"[:REASON_LIMIT]
        for instance in gang(graph):
            mutate.replace_instance(graph, instance.name, reason=why, drain=True, counted=False)
        await ctx.client.patch_status(PLURAL, namespace, name, {"graph": serialise.to_status(graph),
                                                                "decisions": build_decisions(graph)})
        ctx.metrics.decisions.labels(KIND, "replace").inc(len(gang(graph)))
        ctx.post_event(body, "Warning", "Preempted", why)
        # all at once, for the preemptor's sake: the head's SIGTERM checkpoint may then fail, and
        # the new gang resumes from the last interval's
        await _stop(ctx, live)
        fresh = await ctx.client.get_custom(PLURAL, namespace, name)
        if fresh is not None:
            await reconcile(ctx, fresh)
    return True


async def _suspend(ctx: Context, body: Mapping[str, Any], graph: Graph,
                   pods: Mapping[str, index.PodRecord], base: dict[str, Any]) -> str:
    """spec.suspend: record the decision, then stop the head first and the workers once it has
    gone. The controller checkpoints its step on SIGTERM through the training actor, which lives
    on a worker: stopping the workers with it would lose that checkpoint. The decision renews
    the instances' names, so a resume never waits on a name a stopping pod still holds."""
    meta, old = body["metadata"], body.get("status") or {}
    ns, name = meta["namespace"], meta["name"]
    ctx.rl_waiting.pop((ns, name), None)
    ctx.queue.forget(ns, name)
    holding = [p for p in pods.values() if p.holds_resources]
    reason = ("spec.suspend is true: stopping the Ray cluster; the controller checkpoints its step on "
              "SIGTERM, and the job resumes from that checkpoint when spec.suspend is false" if holding
              else "spec.suspend is true: the job waits without pods until spec.suspend is false")
    decided = mutate.suspend(graph, [rlm.HEAD, rlm.WORKER], reason=reason, renew=bool(holding))
    if decided is not None:
        # Write-ahead: a restarted operator finds the decision and only finishes the stopping.
        await ctx.client.patch_status(PLURAL, ns, name, {**base, "phase": "Suspended",
                                                          "graph": serialise.to_status(graph),
                                                          "decisions": build_decisions(graph)})
        ctx.metrics.decisions.labels(KIND, "suspend").inc()
        ctx.post_event(body, "Normal", "Suspended", decided.reason)
    heads = [p for p in holding if p.vertex == rlm.HEAD]
    await _stop(ctx, [p for p in (heads or holding) if not p.deleting])
    if holding:
        message = (f"suspended: waiting for the controller to checkpoint and exit ({len(holding)} pod(s) "
                   "still running)")
    else:
        checkpoint = (old.get("lastCheckpoint") or {}).get("step")
        message = ("suspended: no pods run and no GPUs are held; set spec.suspend to false to resume"
                   + (f" from the checkpoint of step {checkpoint}" if checkpoint is not None else ""))
    status = {**base, "phase": "Suspended", "message": message, "replicas": len(holding),
              "graph": serialise.to_status(graph), "decisions": build_decisions(graph),
              "conditions": conditions.build_conditions(
                  old.get("conditions"), meta.get("generation"), ready=(False, "Suspended", message),
                  reconciling=(True, "Suspending", message) if holding else None,
                  suspended=(True, "Suspended", message))}
    await write_status(ctx, body, status, PLURAL)
    ctx.metrics.record_phase(KIND, f"{ns}/{name}", "Suspended")
    return "Suspended"


def _describe(pod: index.PodRecord, start_limit: float) -> str:
    if pod.holds_resources:
        return f"pod {pod.name} did not start within {start_limit:.0f} s ({pod.not_started_reason()})"
    return f"pod {pod.name} {pod.failure()}" + (f" ({_tail(pod.message)})" if pod.message else "")


def _tail(message: str) -> str:
    """The last line of a pod's termination message: the controller's `error: ...` refusal."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return lines[-1][-400:] if lines else ""


async def _stop(ctx: Context, pods: list[index.PodRecord]) -> None:
    await asyncio.gather(*(ctx.client.delete("Pod", p.namespace, p.name) for p in pods))


async def _finish(ctx: Context, body: Mapping[str, Any], graph: Graph, base: dict[str, Any],
                  pods: Mapping[str, index.PodRecord]) -> str:
    meta, old = body["metadata"], body.get("status") or {}
    message = "the controller finished every step (its step log and checkpoints are on the checkpoint volume)"
    status = {**base, "phase": "Succeeded", "replicas": 0, "message": message,
              "completionTime": old.get("completionTime") or iso_time(time.time()),
              "graph": serialise.to_status(graph), "decisions": build_decisions(graph),
              "conditions": conditions.build_conditions(
                  old.get("conditions"), meta.get("generation"), ready=(False, "Succeeded", message),
                  terminal=(conditions.SUCCEEDED, "Succeeded", message))}
    if old.get("phase") != "Succeeded":
        ctx.post_event(body, "Normal", "Completed", message)
    await write_status(ctx, body, status, PLURAL)
    await _stop(ctx, [p for p in pods.values() if p.holds_resources and not p.deleting])
    ctx.metrics.record_phase(KIND, f"{meta['namespace']}/{meta['name']}", "Succeeded")
    return "Succeeded"


async def _fail(ctx: Context, body: Mapping[str, Any], graph: Graph, base: dict[str, Any], why: str,
                reason: str, pods: Mapping[str, index.PodRecord]) -> str:
    meta, old = body["metadata"], body.get("status") or {}
    status = {**base, "phase": "Failed", "replicas": 0, "message": why,
              "completionTime": old.get("completionTime") or iso_time(time.time()),
              "graph": serialise.to_status(graph), "decisions": build_decisions(graph),
              "conditions": conditions.build_conditions(
                  old.get("conditions"), meta.get("generation"),
                  ready=(False, reason, why), stalled=(True, reason, why),
                  terminal=(conditions.FAILED, reason, why))}
    if old.get("phase") != "Failed":
        ctx.post_event(body, "Warning", reason, why)
        ctx.metrics.decisions.labels(KIND, "fail").inc()
    await write_status(ctx, body, status, PLURAL)
    await _stop(ctx, [p for p in pods.values() if p.holds_resources and not p.deleting])
    ctx.metrics.record_phase(KIND, f"{meta['namespace']}/{meta['name']}", "Failed")
    return "Failed"


async def _waiting(ctx: Context, body: Mapping[str, Any], base: dict[str, Any], reason: str,
                   message: str) -> str:
    meta, old = body["metadata"], body.get("status") or {}
    if old.get("message") != message:
        ctx.post_event(body, "Normal", reason, message)
    status = {**base, "phase": "Pending", "message": message, "conditions": conditions.build_conditions(
        old.get("conditions"), meta.get("generation"), ready=(False, reason, message),
        reconciling=(True, reason, message))}
    await write_status(ctx, body, status, PLURAL)
    ctx.metrics.record_phase(KIND, f"{meta['namespace']}/{meta['name']}", "Pending")
    return "Pending"
