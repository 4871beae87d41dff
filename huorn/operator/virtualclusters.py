"""The VirtualCluster controller: member nodes and GPU accounting in status.

A node belongs to the oldest virtual cluster (by creation time, ties by name) that lists it or
whose selector matches it, so two overlapping selectors never count one GPU twice, and a cluster
created later never takes the nodes of a running one; a cluster that loses nodes that way is
Ready=False (reason NodesClaimed), with a Warning event naming the owner and the nodes.

Lending is counted per GPU, as the scheduler's snapshot counts it: a pod of a job of cluster A
on a node of cluster B adds its GPUs to B's `lent` and to A's `borrowed`. Once A is deleted its
pods still run, so they stay in B's `lent` (and against B's maxGPUsLent) with no `borrowed` to
match them, until they are gone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from huorn.api import virtualcluster
from huorn.operator import board, conditions
from huorn.operator.context import Context

PLURAL = "virtualclusters"


def compute_usage(ctx: Context, vc: str) -> dict[str, Any]:
    members = {n.name: n for n in ctx.index.members_of(vc)}
    allocated = lent = borrowed = 0
    holders = [p for p in ctx.index.pods.values() if p.holds_resources and p.gpus]
    holders += [r for r in ctx.index.reservations.values() if r.gpus]
    for pod in holders:
        on_member = pod.node in members
        if on_member:
            allocated += pod.gpus
            # whether or not the borrower's VirtualCluster still exists: its pods hold the GPUs
            # all the same, and the scheduler counts them against maxGPUsLent
            if pod.virtual_cluster not in ("", vc):
                lent += pod.gpus
        elif (
            pod.virtual_cluster == vc
            and pod.node in ctx.index.nodes
            # Borrowed only from another virtual cluster; a node in none lends nothing.
            and ctx.index.virtual_cluster_of(ctx.index.nodes[pod.node]) not in ("", vc)
        ):
            borrowed += pod.gpus
    # GPUs other controllers' pods hold there (index.ClusterIndex.observe_foreign_pod) are allocated too
    others = ctx.index.held_by_others()
    allocated += sum(others.get(n, 0) for n in members)
    waiting = [j for j in ctx.queue.waiting() if j.virtual_cluster == vc]
    return {
        "nodes": len(members),
        "capacity": sum(n.gpus for n in members.values()),
        "allocated": allocated,
        "lent": lent,
        "borrowed": borrowed,
        "waitingJobs": len(waiting),
        "waitingGPUs": sum(j.missing * j.gpus for j in waiting),
        "line": [{"position": i, "job": j.binding, "kind": j.kind, "priority": j.priority,
                  "gpus": j.missing * j.gpus} for i, j in enumerate(waiting[:virtualcluster.LINE_SHOWN], 1)],
    }


def unavailable_note(ctx: Context, vc: str) -> str:
    """'' when every member node takes new pods; else how many GPUs do and which nodes do not,
    and why (cordoned, not Ready, a taint Huorn's pods do not tolerate: index.build_node_record).
    `capacity` counts those nodes' GPUs still, and `allocated` the pods that run there."""
    members = ctx.index.members_of(vc)
    down = sorted((n.name, n.why) for n in members if n.unschedulable)
    if not down:
        return ""
    schedulable = sum(n.gpus for n in members if not n.unschedulable)
    shown = ", ".join(f"{node} ({why})" for node, why in down[:5])
    more = f" and {len(down) - 5} more" if len(down) > 5 else ""
    hint = ("; Huorn's pods tolerate a taint the cluster lists in spec.members.tolerations"
            if any(why.startswith("taint ") for _, why in down) else "")
    return f"; {schedulable} GPUs take new pods, {len(down)} node(s) take none: {shown}{more}{hint}"


def claimed_note(ctx: Context, vc: str) -> str:
    """'' unless an older cluster owns nodes that `vc` lists or selects too: a node belongs to one
    cluster only (the oldest, index.ClusterIndex.virtual_cluster_of), and a cluster left with
    fewer nodes than its spec names must say so rather than report itself Ready."""
    lost = ctx.index.claimed_from(vc)
    if not lost:
        return ""
    parts = []
    for owner, nodes in sorted(lost.items()):
        shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
        parts.append(f"{len(nodes)} node(s) it selects belong to the older virtual cluster {owner} "
                     f"({shown})")
    return "; ".join(parts) + "; make the members of the two clusters disjoint"


async def reconcile(ctx: Context, body: Mapping[str, Any]) -> dict[str, Any]:
    meta = body["metadata"]
    name = meta["name"]
    ctx.index.observe_vc(body)
    usage = compute_usage(ctx, name)
    old = body.get("status") or {}
    message = f"{usage['nodes']} nodes, {usage['capacity']} GPUs, {usage['allocated']} allocated"
    member_nodes = ctx.index.members_of(name)
    members = {n.name for n in member_nodes}
    others = sum(gpus for node, gpus in ctx.index.held_by_others().items() if node in members)
    if others:
        message += f" ({others} by pods Huorn does not manage)"
    message += unavailable_note(ctx, name)
    ready = (True, "Tracking", message)
    claimed = claimed_note(ctx, name)
    if claimed:
        ready = (False, "NodesClaimed", f"{claimed}; {message}")
        before = [c for c in old.get("conditions") or [] if c.get("type") == conditions.READY]
        # once per change of what is claimed, not at every status tick
        if not before or before[0].get("reason") != "NodesClaimed" or not str(
                before[0].get("message") or "").startswith(claimed):
            ctx.post_event(body, "Warning", "NodesClaimed", claimed)
    # The line is each install's own: one that does not serve every namespace of the cluster
    # knows part of it, and two such would write their parts over each other at every tick.
    partial = set() if ctx.index.serves_all_of(name) else {"waitingJobs", "waitingGPUs", "line"}
    status: dict[str, Any] = {
        **{k: v for k, v in usage.items() if k not in partial},
        "observedGeneration": meta.get("generation"),
        "conditions": conditions.build_conditions(
            old.get("conditions"), meta.get("generation"), ready=ready
        ),
    }
    reading = board.status_of(ctx, name)
    if reading is not None or old.get("forecast") is not None:
        status["forecast"] = board.clearing(reading, old.get("forecast"))
    if reading is not None:
        ctx.metrics.vc_gpus.labels(name, "forecast").set(reading["gpus"])
    else:
        with contextlib.suppress(KeyError):
            ctx.metrics.vc_gpus.remove(name, "forecast")
    for state in ("capacity", "allocated", "lent", "borrowed"):
        ctx.metrics.vc_gpus.labels(name, state).set(usage[state])
    unschedulable = sum(n.gpus for n in member_nodes if n.unschedulable)
    ctx.metrics.vc_gpus.labels(name, "unschedulable").set(unschedulable)
    ctx.metrics.vc_gpus.labels(name, "waiting").set(usage["waitingGPUs"])
    ctx.metrics.vc_waiting_jobs.labels(name).set(usage["waitingJobs"])
    # A CRD older than the operator prunes `line` (docs/operator.md, upgrades): compared while the
    # stored status has none, it would differ at every tick and be written again each time.
    compared = status if "line" in old else {k: v for k, v in status.items() if k != "line"}
    if conditions.strip_times({**old, **compared}) != conditions.strip_times(old):
        await ctx.client.patch_status(PLURAL, None, name, status)
    return usage


def forget(ctx: Context, name: str) -> list[str]:
    """Drop the cluster; returns the nodes that take new pods now (index.ClusterIndex.forget_vc)."""
    opened = ctx.index.forget_vc(name)
    for state in ("capacity", "allocated", "lent", "borrowed", "waiting", "unschedulable", "forecast"):
        with contextlib.suppress(KeyError):
            ctx.metrics.vc_gpus.remove(name, state)
    with contextlib.suppress(KeyError):
        ctx.metrics.vc_waiting_jobs.remove(name)
    return opened
