"""The operator's side of the shared monitor loop: one `Monitor.tick` per running job and period.

The policies are the local backend's (`GoodputPolicy`, `RemediationPolicy`) and so is the loop
(`huorn.backends.monitor.Monitor`); only the source of observations (pod IPs, over HTTP) and
what applying means differ. Applying is: write the mutated graph into status (the write-ahead
log the reconcile already trusts), post an Event per mutation, then run the ordinary reconcile,
which cordons, deletes and places pods. A kill at any point therefore leaves either no decision
(it is simply taken again on the next tick) or a decision in status that the next reconcile
finishes; never the same decision twice.

Ladder decisions that have no pod action yet (S1-S3, and a hang capped by maxMitigation) become
`set-param` mutations of the trainer's `mitigation` parameter. That keeps them in the same
bounded history as resizes and replacements, and a decision re-derived after a restart sets the
same value, which `mutate.set_param` records as no change: exactly once again. Records that
change nothing in force (NO_OP_ACTIONS) are log-only `note` mutations, and every value written
after a job-wide S4 carries its step (`restartedAtStep`), so no later record erases either.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from huorn.api.common import MitigationLevel
from huorn.api.training import declared_steps, token_budget
from huorn.backends import goodput, monitor
from huorn.backends.kubernetes import manifests, observe
from huorn.graph import jobs, model, mutate, serialise
from huorn.operator import (
    allocation,
    conditions,
    cordon,
    daemons,
    estimates,
    evaluation,
    training,
    validation,
)
from huorn.operator.context import Context
from huorn.scheduler import allocator
from huorn.scheduler.remediation import policy

logger = logging.getLogger("huorn.operator.monitor")
MITIGATION_PARAM = "mitigation"
# ladder records that change nothing in force: they go into the log, not into `mitigation`
NO_OP_ACTIONS = frozenset({"stalled-outside-collectives", "recovered", "eased", "worsened"})
ACTIVE_PHASES = frozenset({"Running", "Resizing"})


@dataclass
class JobPolicies:
    """One job's policies; rebuilt when the job's spec (generation) or identity (uid) changes."""

    key: tuple[str, int]  # (uid, generation)
    remediation: policy.RemediationPolicy
    goodput: goodput.GoodputPolicy | None
    last_step: int = -1
    ladder_seen: int = 0
    polls: int = 0  # ticks that read some telemetry: how long the job has been watched
    progress_written: float = float("-inf")  # time of the last status.step/loss write
    # what that write measured progress by: (unit, steps or tokens done): the rate behind the ETA
    progress_done: tuple[str, int] | None = None
    total_steps: int | None = None  # what the spec declares (steps, or tokens as steps)
    # the spec's budget in tokens (training.token_budget): progress counts the tokens trained
    tokens: int | None = None
    checkpoint_written: int | None = None  # step of the last status.lastCheckpoint written
    progress_pending: dict[str, Any] | None = None  # the newest step's fields, not written yet
    pending_done: tuple[str, int] | None = None  # and what they measured progress by

    def all(self) -> list[monitor.Policy]:
        return [p for p in (self.remediation, self.goodput) if p is not None]


def build_policies(job: Any, key: tuple[str, int], graph: model.Graph | None = None,
                   arbiter: Callable[[allocator.JobView, float], allocator.Decision] | None = None,
                   gpu_type: str = "") -> JobPolicies:
    """A job's policies; with its graph, the remediation ladder takes up an S2/S3 plan the trainers
    hold (policy.RemediationPolicy.resume): a restarted operator, or one rebuilding them for an
    edited spec, must still give the even split back once the slowdown ends. `arbiter`: where the
    goodput policy's decision comes from (allocation.arbiter_for: one allocation over every job).
    `gpu_type`: its cluster's GPUs (index.gpu_type), which the performance model's prior is
    scaled to."""
    spec = job.spec
    total = declared_steps(spec)
    grow = allocation.goodput_policy(job, arbiter, gpu_type)
    remediation = policy.RemediationPolicy(spec.remediation)
    trainer = graph.vertices.get("trainer") if graph is not None else None
    if trainer is not None and remediation.resume(trainer.params):
        logger.info("monitor %s: remediation resumes the plan in force (%s)", job.metadata.name,
                    remediation.ladder.applied)
    return JobPolicies(key, remediation, grow, total_steps=total, tokens=token_budget(spec))


def _policies_for(ctx: Context, body: Mapping[str, Any], job: Any, graph: model.Graph) -> JobPolicies:
    meta = body["metadata"]
    key = (str(meta.get("uid", "")), int(meta.get("generation") or 0))
    found = ctx.monitors.get((meta["namespace"], meta["name"]))
    if found is None or found.key != key:
        found = build_policies(job, key, graph, allocation.arbiter_for(ctx, meta["namespace"], meta["name"]),
                               ctx.index.gpu_type(job.spec.virtual_cluster, job.spec.node_selector))
        ctx.monitors[(meta["namespace"], meta["name"])] = found
    return found


def record_ladder(graph: model.Graph, state: JobPolicies) -> list[model.Mutation]:
    """New ladder decisions that replace nothing become `set-param` mutations of the trainer."""
    fresh = state.remediation.decisions[state.ladder_seen:]
    state.ladder_seen = len(state.remediation.decisions)
    out = []
    for d in fresh:
        if d.level is MitigationLevel.RESTART and d.action != "capped" and d.replaced:
            continue  # S4 is the InstanceManager's replace mutation
        reason = f"remediation {d.level.value} ({d.action}): {d.reason}"
        if d.action in NO_OP_ACTIONS:
            # NB: these change nothing in force. Written into `mitigation` they overwrote the rung
            # in force, and with it the ranks a resumed S2 plan needs and a job-wide S4's step: a
            # rebuilt policy then took the old slowdown's S1 → S4 again. They go into the log only.
            out.append(mutate.note(graph, "trainer", reason, {"key": MITIGATION_PARAM}))
            continue
        # NB: an S4 that replaced nothing (a job-wide slowdown names no pod) is recorded here: it
        # used to leave no trace in status or Events. Its step rides along in every later value
        # (`restartedAtStep`), so a later rung cannot erase which findings that S4 ended.
        value = {"level": d.level.value, "action": d.action, "ranks": list(d.ranks), "plan": dict(d.plan)}
        restarted = policy.last_restart_step(graph)
        if d.level is MitigationLevel.RESTART and isinstance(d.plan.get("atStep"), int):
            restarted = max(restarted, int(d.plan["atStep"]))
        if restarted >= 0:
            value["restartedAtStep"] = restarted
        m = mutate.set_param(graph, "trainer", MITIGATION_PARAM, value, reason=reason)
        if m is not None:
            out.append(m)
    return out


def mark_cordons(ctx: Context, namespace: str, job: str, mutations: list[model.Mutation]) -> None:
    """An S4 replacement names the node of the pod it replaces, so the reconcile that applies it
    (now or after a restart) can cordon that node before placing the new pod."""
    for m in mutations:
        if m.action != "replace" or "remediation S4" not in m.reason:
            continue
        old = m.detail.get("old")
        pod = next((p for p in ctx.index.pods_of(namespace, job) if p.instance == old), None)
        if pod is not None and pod.node:
            m.detail[cordon.DETAIL_KEY] = pod.node


async def fetch_observation(
    ctx: Context, body: Mapping[str, Any], graph: model.Graph, state: JobPolicies, ranks: int
) -> monitor.Observation:
    meta = body["metadata"]
    ref = manifests.JobRef.from_body(body)
    pods = {p.name: p for p in ctx.index.pods_of(meta["namespace"], meta["name"])}
    ips = {}
    for instance in graph.vertex("trainer").instances:
        pod = pods.get(manifests.pod_name(ref, instance))
        if pod is not None and pod.phase == "Running" and pod.ip and not pod.deleting:
            ips[instance.name] = pod.ip
    # A pod runs `ranks` processes (torchrun --nproc-per-node), each on its own telemetry port.
    targets = observe.build_targets(ips, ctx.settings.telemetry_port, ranks)
    snapshots = await asyncio.to_thread(
        observe.fetch_snapshots, targets, ctx.settings.telemetry_timeout_seconds
    )
    return observe.build_observation(time.time(), snapshots, state.last_step, ranks)


async def tick_job(ctx: Context, namespace: str, name: str) -> list[model.Mutation]:
    """One monitor pass over one job; returns the mutations it recorded (and applied).

    It polls the running trainer pods, and it also runs when only an eval pod has ended (after
    the trainers finished, say), so that the eval's result and what follows it are settled."""
    mirrored = ctx.index.pods_of(namespace, name)
    polling = any(p.vertex == "trainer" and p.phase == "Running" and p.ip and not p.deleting
                  for p in mirrored)
    now, start_seconds = time.time(), ctx.settings.eval_start_seconds
    ended = any(p.input is not None and not p.deleting and evaluation.is_over(p, now, start_seconds)
                for p in mirrored)
    if not polling and not ended:
        return []  # nothing to poll or settle; the mirror says so without an API round trip
    body = await ctx.client.get_custom(training.PLURAL, namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return []
    status = body.get("status") or {}
    if status.get("phase") not in ACTIVE_PHASES or not status.get("graph"):
        return []
    try:
        job = validation.load_job(body)
    except validation.InvalidSpec:
        return []
    observed = serialise.from_status(status["graph"])
    state = _policies_for(ctx, body, job, observed)
    if polling:
        ranks = allocation.ranks_per_replica(job.spec)
        observation = await fetch_observation(ctx, body, observed, state, ranks)
    else:
        observation = monitor.Observation(time=time.time())
    settling = evaluation.has_finished_pod(observed, ctx.index.pods_of(namespace, name), now, start_seconds)
    if not observation.telemetry and not settling:
        return []
    async with ctx.job_lock(namespace, name):
        # Decide against the graph as it is now: a reconcile may have mutated it while we polled.
        body = await ctx.client.get_custom(training.PLURAL, namespace, name)
        if body is None or (body.get("status") or {}).get("phase") not in ACTIVE_PHASES:
            return []
        if observation.telemetry:
            # Under the lock, against the phase just read: written after a reconcile marked the
            # job Succeeded (progress 100, no time left), a poll from before it would leave its
            # older progress and ETA there for good.
            state.polls += 1
            await write_progress(ctx, namespace, name, state, observation)
        graph = serialise.from_status(body["status"]["graph"])
        if observation.steps:
            state.last_step = int(observation.steps[-1]["step"])
        if state.goodput is not None:
            trainer = graph.vertex("trainer")
            state.goodput.in_place = jobs.resizes_in_place(trainer)  # a resize's price
        # The eval vertex's inputs for the shared managers: a checkpoint it was not handed yet,
        # and eval pods that ended (read under the lock, against the graph as it is now).
        pods = ctx.index.pods_of(namespace, name)
        # Where each trainer runs: the goodput policy moves a resized gang to the allocator's nodes.
        observation.nodes.update(allocation.trainer_nodes(pods))
        observation.instances.update(evaluation.build_states(graph, pods, time.time(), start_seconds))
        if not evaluation.still_leaving(graph, pods):  # else handed at a later tick, once it is
            observation.checkpoint = evaluation.landed_checkpoint(graph, observation.telemetry)
        # Without telemetry (only an eval pod ended) the policies have nothing to judge.
        policies = state.all() if observation.telemetry else []
        result = monitor.Monitor(graph, observe.ObservedBackend(observation), policies).tick()
        mutations = list(result.mutations) + (record_ladder(graph, state) if policies else [])
        if not mutations:
            return []
        mark_cordons(ctx, namespace, name, mutations)
        when = conditions.now()
        results = [evaluation.build_result(p, when, why)
                   for p, why in evaluation.settled(observation.instances, graph, pods)]
        try:
            await ctx.client.patch_status(training.PLURAL, namespace, name, {
                "graph": serialise.to_status(graph), "decisions": training.build_decisions(graph),
                **evaluation.build_status(body.get("status") or {}, results),
            })
        except Exception:
            # The policies have already marked this decision made (a hang handled, a ladder rung
            # taken); unwritten, it would never be made again. Drop them: the next tick rebuilds
            # them from the graph in status, as a restarted operator does, and decides afresh.
            ctx.monitors.pop((namespace, name), None)
            raise
        for m in mutations:
            ctx.metrics.decisions.labels(training.KIND, m.action).inc()
            reason = _event_reason(m)
            ctx.post_event(body, "Warning" if reason.startswith("Remedia") else "Normal", reason, m.reason)
        for entry in results:
            ok = entry["phase"] == "Succeeded"
            ctx.post_event(body, "Normal" if ok else "Warning", "Evaluated" if ok else "EvaluationFailed",
                           evaluation.describe(entry))
        logger.info("monitor %s/%s: %s", namespace, name, "; ".join(m.reason for m in mutations))
        fresh = await ctx.client.get_custom(training.PLURAL, namespace, name)
        if fresh is not None:
            await training.reconcile(ctx, fresh)
    return mutations


def progress_measure(record: Mapping[str, Any], total_steps: int | None, tokens: int | None
                     ) -> tuple[str, int, int | None, float | None]:
    """What a step record says of the run's progress: (unit, done, total, seconds per unit).

    A budget in tokens is measured in the tokens trained: under `scale-with-replicas` a step
    above minReplicas trains more than globalBatch × context, so the steps the spec's batch makes
    of the budget are more than the run takes, and a count of them ended the job short of 100 %
    with an ETA too long by the batch's growth. A record without `tokens` (a trainer from before
    they were reported) is measured in steps, as it was."""
    if tokens is not None and record.get("tokens") is not None:
        rate = record.get("tokens_per_second")
        unit_seconds = 1.0 / float(rate) if rate is not None and float(rate) > 0 else None
        return "tokens", int(record["tokens"]), tokens, unit_seconds
    seconds = record.get("step_seconds")
    return "steps", int(record["step"]), total_steps, float(seconds) if seconds is not None else None


def build_progress(observation: monitor.Observation, total_steps: int | None = None,
                   since: tuple[float, tuple[str, int]] | None = None, tokens: int | None = None
                   ) -> dict[str, Any]:
    """status.step, loss, tokensPerSecond, batchSize and learningRate (from the newest step
    record), progressPercent and the ETA (against the declared `total_steps`, or the budget in
    `tokens` by the tokens trained: progress_measure; `since`: time and measure of the previous
    write) and lastCheckpoint (from the lowest rank's telemetry), what `kubectl get
    trainingjobs` prints; {} when nothing new."""
    progress: dict[str, Any] = {}
    if observation.steps:
        last = observation.steps[-1]
        progress["step"] = int(last["step"])
        if last.get("loss") is not None:
            progress["loss"] = round(float(last["loss"]), 6)
        if last.get("tokens_per_second") is not None:
            progress["tokensPerSecond"] = round(float(last["tokens_per_second"]), 1)
        # what the step trained with: the batch and rate the goodput rule set for the gang's size
        if last.get("global_batch") is not None:
            progress["batchSize"] = int(last["global_batch"])
        if last.get("learning_rate") is not None:
            progress["learningRate"] = float(f"{float(last['learning_rate']):.6g}")
        unit, done, total, unit_seconds = progress_measure(last, total_steps, tokens)
        before = since if since is not None and since[1][0] == unit else None  # the same unit only
        progress |= estimates.estimate_progress(
            done, total, observation.time, None if before is None else (before[0], before[1][1]),
            unit_seconds)
    if observation.telemetry:
        first = min(observation.telemetry.values(), key=lambda s: int(s.get("rank", 1 << 30)))
        landed = (first.get("parameters") or {}).get("checkpoint")
        if isinstance(landed, dict) and "step" in landed:
            progress["lastCheckpoint"] = {k: landed[k] for k in ("step", "time", "path") if k in landed}
    return progress


async def write_progress(ctx: Context, namespace: str, name: str, state: JobPolicies,
                         observation: monitor.Observation) -> bool:
    """A merge patch of the progress fields, at most every `progress_seconds` (at once for a new
    checkpoint). The caller holds the job lock and has read an active phase: a finished job's
    reconcile writes progressPercent 100 and no time left, which an older poll must not undo.

    A step seen too soon after the last write is kept, not dropped, and written once the period
    has passed: a run whose last steps come in one burst (it finished, or it paused for a resize)
    would otherwise leave status.step behind until a step that may never come."""
    since = None if state.progress_done is None else (state.progress_written, state.progress_done)
    progress = build_progress(observation, state.total_steps, since, state.tokens)
    if "step" in progress:
        state.progress_pending = {k: v for k, v in progress.items() if k != "lastCheckpoint"}
        unit, done, _, _ = progress_measure(observation.steps[-1], state.total_steps, state.tokens)
        state.pending_done = (unit, done)
    landed = progress.get("lastCheckpoint")
    checkpoint = (landed or {}).get("step")
    fresh_checkpoint = checkpoint is not None and checkpoint != state.checkpoint_written
    due = observation.time - state.progress_written >= ctx.settings.progress_seconds
    patch: dict[str, Any] = dict(state.progress_pending or {}) if due else {}
    if landed is not None and (patch or fresh_checkpoint):
        patch["lastCheckpoint"] = landed
    if not patch:
        return False
    await ctx.client.patch_status(training.PLURAL, namespace, name, patch)
    if due:
        state.progress_written = observation.time
        if state.progress_pending is not None:
            state.progress_done = state.pending_done
        state.progress_pending = state.pending_done = None
    if checkpoint is not None:
        state.checkpoint_written = checkpoint
    return True


def _event_reason(m: model.Mutation) -> str:
    if m.action in ("set-param", "note") and m.detail.get("key") == MITIGATION_PARAM:
        return "Remediation"  # a ladder's record, whether it changed the plan or only observed
    if m.action == "replace" and cordon.DETAIL_KEY in m.detail:
        return "Remediate"
    return m.action.capitalize()


async def run_daemon(ctx: Context, namespace: str, name: str, stopped: Any) -> None:
    """The body of the per-TrainingJob kopf daemon (huorn.operator.daemons.every)."""
    await daemons.every(ctx.settings.monitor_seconds, stopped, lambda: tick_job(ctx, namespace, name),
                        f"monitor tick of {namespace}/{name}", logger)
