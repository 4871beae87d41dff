"""Stopping or shrinking a running gang so that others get its GPUs: a lender's reclaim, or a job of
higher priority.

A shrink is a graph mutation like any other: the resize, naming exactly the replicas to give up,
goes into the job's status first; then those pods are deleted gracefully (SIGTERM, checkpoint),
and the rest of the gang goes on at its smaller size.

Every live trainer pod of the victim is replaced with drain (a new generation each), which is how
an S3 roll restarts a gang; the decision goes into the victim's status first, then the old pods
are deleted gracefully (SIGTERM, checkpoint, exit). The successors wait until the old pods are
gone, then queue for GPUs again (huorn.operator.queue), all or none, and restart from the
checkpoint. These replacements do not spend the victim's restart budget
(`status.preemptReplacements`). Repeatable: a restarted operator finds the replacements in status
and the old pods deleting, and neither decides nor deletes anything twice.
"""

from __future__ import annotations

import logging

from huorn.graph import mutate, serialise
from huorn.operator import rljobs, training
from huorn.operator.context import Context

logger = logging.getLogger("huorn.operator.preempting")


async def preempt_gang(ctx: Context, namespace: str, name: str, reason: str,
                       grace: int | None = None) -> bool:
    """Stop one gang; `grace` overrides the pods' own termination grace (a lender's
    reclaimGraceSeconds). False when it has no live trainer pod left to stop."""
    async with ctx.job_lock(namespace, name):
        body = await ctx.client.get_custom(training.PLURAL, namespace, name)
        if body is None or not (body.get("status") or {}).get("graph"):
            return False
        graph = serialise.from_status(body["status"]["graph"])
        # Only the pods of the replicas it replaces. A pod whose replica the graph already gave up
        # (a reclaim's shrink) was deleted by that decision, with its grace, though the mirror may
        # not show it deleting yet: a second DELETE with the pods' own 30 s cut that grace short.
        kept = {i.name for i in graph.vertex("trainer").instances}
        live = {p.instance: p for p in ctx.index.pods_of(namespace, name)
                if p.vertex == "trainer" and p.holds_resources and not p.deleting and p.instance in kept}
        replaced = [mutate.replace_instance(graph, i.name, drain=True, reason=reason)
                    for i in list(graph.vertex("trainer").instances) if i.name in live]
        if not replaced:
            return False
        if grace is not None:
            for m in replaced:
                m.detail[training.GRACE_KEY] = grace
        old = body.get("status") or {}
        await ctx.client.patch_status(training.PLURAL, namespace, name, {
            "graph": serialise.to_status(graph), "decisions": training.build_decisions(graph),
            "preemptReplacements": int(old.get("preemptReplacements") or 0) + len(replaced),
        })
        ctx.metrics.decisions.labels(training.KIND, "replace").inc(len(replaced))
        ctx.post_event(body, "Warning", "Preempted", f"{reason}; the gang restarts from its checkpoint "
                       "once it can be placed again"[:1024])
        for pod in live.values():
            await ctx.client.delete("Pod", pod.namespace, pod.name, grace_seconds=grace)
        fresh = await ctx.client.get_custom(training.PLURAL, namespace, name)
        if fresh is not None:
            await training.reconcile(ctx, fresh)
    return True


async def shrink_gang(ctx: Context, namespace: str, name: str, replicas: list[str], reason: str,
                      grace: int | None = None, count: int | None = None) -> bool:
    """Give up the first `count` (default: all) of the named trainer replicas that still run, in
    the order given, never below minReplicas; False when there is nothing (left) to give up."""
    async with ctx.job_lock(namespace, name):
        body = await ctx.client.get_custom(training.PLURAL, namespace, name)
        if body is None or not (body.get("status") or {}).get("graph"):
            return False
        graph = serialise.from_status(body["status"]["graph"])
        trainer = graph.vertex("trainer")
        live = {i.name for i in trainer.instances}
        pods = {p.instance: p for p in ctx.index.pods_of(namespace, name)
                if p.vertex == "trainer" and p.holds_resources and not p.deleting}
        going = [r for r in replicas if r in live and r in pods][:count]
        if not going or trainer.replicas - len(going) < trainer.min_replicas:
            return False
        m = mutate.resize(graph, "trainer", trainer.replicas - len(going), reason=reason, remove=going)
        if m is None:
            return False
        if grace is not None:
            m.detail[training.GRACE_KEY] = grace
        await ctx.client.patch_status(training.PLURAL, namespace, name, {
            "graph": serialise.to_status(graph), "decisions": training.build_decisions(graph),
            "targetReplicas": trainer.replicas,
        })
        ctx.metrics.decisions.labels(training.KIND, "resize").inc()
        event = "Reclaim" if reason.startswith("reclaim") else "Shrunk"
        ctx.post_event(body, "Normal", event, m.reason[:1024])
        for replica in going:
            pod = pods[replica]
            await ctx.client.delete("Pod", pod.namespace, pod.name, grace_seconds=grace)
        fresh = await ctx.client.get_custom(training.PLURAL, namespace, name)
        if fresh is not None:
            await training.reconcile(ctx, fresh)
    return True


async def apply_planned(ctx: Context, namespace: str, name: str) -> list[str]:
    """The preemptions a reconcile of `namespace/name` (a TrainingJob or an RLJob) planned
    (huorn.operator.training.plan_preemption); returns the victims stopped. Runs outside the
    preemptor's lock: each victim takes its own."""
    planned = ctx.preemptions.pop((namespace, name), None)
    if planned is None:
        return []
    plan, preemptor, kind = planned
    stopped = []
    for victim, replicas in plan.shrinks:
        victim_ns, victim_name = victim.split("/", 1)
        reason = (f"shrunk by {len(replicas)} for {preemptor} to place its gang: priority "
                  f"{_priority(ctx, victim)} is lower, and the job is elastic")
        if await shrink_gang(ctx, victim_ns, victim_name, list(replicas), reason):
            stopped.append(f"{victim} (shrunk by {len(replicas)})")
    for victim in plan.victims:
        victim_ns, victim_name = victim.split("/", 1)
        reason = f"preempted by {preemptor} to place its gang: priority {_priority(ctx, victim)} is lower"
        known = ctx.queue.jobs.get((victim_ns, victim_name))
        stop = rljobs.preempt if known is not None and known.kind == rljobs.KIND else preempt_gang
        if await stop(ctx, victim_ns, victim_name, reason):
            stopped.append(victim)
    if stopped:
        logger.info("%s/%s preempted %s", namespace, name, ", ".join(stopped))
        plural = rljobs.PLURAL if kind == rljobs.KIND else training.PLURAL
        body = await ctx.client.get_custom(plural, namespace, name)
        if body is not None:
            ctx.post_event(body, "Normal", "Preempting",
                           f"stopping {', '.join(stopped)} (lower priority) to place this gang; it starts "
                           "once their pods have checkpointed and exited"[:1024])
    return stopped


def _priority(ctx: Context, binding: str) -> str:
    namespace, name = binding.split("/", 1)
    known = ctx.queue.jobs.get((namespace, name))
    return str(known.priority) if known is not None else "unknown"
