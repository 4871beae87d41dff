"""Getting lent GPUs back: an inference VirtualCluster's demand shrinks the training jobs on its nodes.

Demand is what the lender's InferenceJobs need now: their autoscalers' replica counts
(`status.desiredReplicas × resources.gpus`, `minReplicas` before the first count, plus the
replicas a rolling update keeps serving beside their successors, `status.surgingReplicas`), or the
prediction board's forecast where that is more. Whatever the lender's own workloads cannot get from its free
GPUs is reclaimed from borrowers, up to what it has out on loan. The victims are chosen by
`huorn.scheduler.loaning.plan_reclaim` (least lost work, FaPES); the operator only applies them.

A shrink is a graph mutation like any other: the resize, naming exactly the instances on the
lender's nodes, goes into the borrower's status first; then those pods are deleted with the
lender's `reclaimGraceSeconds` as their grace period, which is SIGTERM now and time to write a
checkpoint (the runtime checkpoints on SIGTERM) before the kubelet kills them. Pods being deleted
no longer count as lent, so a restarted operator sees the debt already paid and reclaims nothing
twice.

A borrower that cannot shrink (at its minimum, or `fixed`) is preempted when the lender's
`lending.reclaimPolicy` is Preempt (the default): every live trainer pod of the job is replaced
with drain, which is how an S3 roll restarts a gang, and the old pods are deleted with the
lender's grace. A gang that lost some members would only wait at its rendezvous, so the whole
gang goes, and its successors are placed again all or none, never on GPUs the lender reserves
for its demand (`index.build_snapshot`). These replacements do not spend the job's restart
budget (`status.preemptReplacements`). With `reclaimPolicy: Shrink` the lender gets a Warning
Event instead, naming the job that keeps its GPUs.

With several installs, each serving its own namespaces, only the install that lends a cluster
(`index.ClusterIndex.serves_all_of`) reclaims for it, and it writes no decision into a borrower it does
not serve: that borrower's pods on the lender are deleted with the lender's grace (`release_pods`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.backends.kubernetes import manifests
from huorn.graph import serialise
from huorn.operator import board, index, preempting, training, validation
from huorn.operator.context import Context
from huorn.scheduler import loaning

logger = logging.getLogger("huorn.operator.loans")


@dataclass
class Borrower:
    namespace: str
    job: str
    pods: list[index.PodRecord] = field(default_factory=list)  # its trainer pods on the lender's nodes


def find_borrowers(ctx: Context, vc: str) -> dict[tuple[str, str], Borrower]:
    """Other clusters' live trainer pods on `vc`'s nodes; pods already being deleted are paid debt."""
    members = {n.name for n in ctx.index.members_of(vc)}
    out: dict[tuple[str, str], Borrower] = {}
    for pod in ctx.index.pods.values():
        if (pod.node in members and pod.virtual_cluster not in ("", vc) and pod.vertex == "trainer"
                and pod.holds_resources and not pod.deleting and pod.gpus):
            out.setdefault(pod.job_key, Borrower(pod.namespace, pod.job)).pods.append(pod)
    return out


def count_wanted(ctx: Context, vc: str, demand: int, borrowers: Mapping[Any, Borrower]) -> int:
    members = ctx.index.members_of(vc)
    capacity = sum(n.gpus for n in members if not n.unschedulable)
    names = {n.name for n in members}
    live = [p for p in ctx.index.pods.values() if p.node in names and p.holds_resources and not p.deleting]
    used = sum(p.gpus for p in live)
    own = sum(p.gpus for p in live if p.virtual_cluster == vc)  # demand already met by its own pods
    lent = sum(p.gpus for b in borrowers.values() for p in b.pods)
    return max(0, min(lent, (demand - own) - (capacity - used)))


async def reclaim(ctx: Context, vc_body: Mapping[str, Any]) -> list[loaning.Reclaim]:
    """Reclaim what an inference VirtualCluster needs back; returns the reclaims applied."""
    name = vc_body["metadata"]["name"]
    spec = vc_body.get("spec") or {}
    if spec.get("purpose") != "inference":
        return []
    borrowers = find_borrowers(ctx, name)
    lends = ctx.index.serves_all_of(name)
    if not lends:
        # Not lent by this install (the one serving all its namespaces reclaims, where there is
        # one): its own borrowers there were placed before it stopped lending, and no install
        # may ever reclaim them for a demand it does not see. They all give their GPUs back.
        borrowers = {k: b for k, b in borrowers.items() if ctx.serves(b.namespace)}
    if not borrowers:
        return []
    demand = ctx.index.demand_of(name)  # the InferenceJobs' floors, or the board's forecast
    wanted = (count_wanted(ctx, name, demand, borrowers) if lends
              else sum(p.gpus for b in borrowers.values() for p in b.pods))
    if wanted <= 0:
        return []
    jobs: dict[str, tuple[Borrower, Mapping[str, Any], Any]] = {}
    loans = []
    for b in borrowers.values():
        body = await ctx.client.get_custom(training.PLURAL, b.namespace, b.job)
        if body is None or not (body.get("status") or {}).get("graph"):
            continue
        try:
            job = validation.load_job(body)
        except validation.InvalidSpec as exc:
            # A spec that no longer validates (a rule added since the job started): the job is
            # Stalled, but its pods still hold the lender's GPUs. Reclaimed as a fixed gang, from
            # what its pods say; raising here stopped every reclaim of this lender for good.
            logger.warning("reclaim: %s/%s is invalid (%s): reclaimed as a fixed gang",
                           b.namespace, b.job, exc)
            job = None
        graph = serialise.from_status(body["status"]["graph"])
        # Pods whose instance the graph no longer holds were given up by a decision already in
        # status, their deletes still to come (an operator that died in between): debt being
        # paid. Counted as lent, they made a restarted operator reclaim twice, and the job it
        # could no longer shrink was preempted whole.
        kept = {i.name for i in graph.vertex("trainer").instances}
        going = [p for p in b.pods if p.instance not in kept]
        wanted -= sum(p.gpus for p in going)
        b.pods = [p for p in b.pods if p.instance in kept]
        if not b.pods:
            continue
        key = f"{b.namespace}/{b.job}"
        jobs[key] = (b, body, job)
        replicas = graph.vertex("trainer").replicas
        if job is None:
            min_replicas, gpus = replicas, max(p.gpus for p in b.pods)
            priority = int((body.get("spec") or {}).get("priority", 50))
        else:
            min_replicas, gpus, priority = (job.spec.elasticity.min_replicas, job.spec.resources.gpus,
                                            job.spec.priority)
            if job.spec.elasticity.policy != "goodput":
                min_replicas = replicas  # a fixed gang cannot shrink, only stop
        loans.append(loaning.LoanView(
            job=key, replicas_on_lender=len(b.pods), replicas_total=replicas,
            min_replicas=min_replicas, gpus_per_replica=gpus, priority=priority,
        ))
    if wanted <= 0 or not loans:
        return []
    view = index.build_vc_view(name, spec)
    forecast_gpus = ctx.index.forecast_demand.get(name, 0)
    if not lends:
        why = (f"this install does not serve every namespace {name} admits (spec.namespaces), so it "
               "lends it nothing and its borrowers there give their GPUs back")
    elif forecast_gpus > ctx.index.floors_of(name):
        why = f"its forecast request rate needs {forecast_gpus} GPU(s) ({board.FIELD})"
    else:
        why = f"its InferenceJobs need {demand} GPU(s)"
    plan = loaning.plan_reclaim(view, wanted, loans, time.time(), why)
    applied = []
    left = wanted
    by_job = {loan.job: loan for loan in loans}
    for planned in plan:
        b, body, _ = jobs[planned.job]
        r = as_shrink(planned, by_job[planned.job], left)
        left -= r.gpus_released
        if r.action != "shrink":
            if (spec.get("lending") or {}).get("reclaimPolicy", "Preempt") != "Preempt":
                ctx.post_event(vc_body, "Warning", "ReclaimBlocked",
                               f"{why}; {r.job} holds {r.gpus_released} lent GPU(s) but cannot shrink "
                               "(at minReplicas, or elasticity.policy fixed), and lending.reclaimPolicy "
                               "is Shrink")
                continue
            if await preempt_borrower(ctx, b, r, int(view.reclaim_grace_seconds), name):
                ctx.post_event(vc_body, "Normal", "Reclaimed", f"{r.reason} (preempted)")
                applied.append(r)
            continue
        if await shrink_borrower(ctx, b, r, int(view.reclaim_grace_seconds), name):
            ctx.post_event(vc_body, "Normal", "Reclaimed", r.reason)
            applied.append(r)
    return applied


def as_shrink(r: loaning.Reclaim, loan: loaning.LoanView, wanted: int) -> loaning.Reclaim:
    """The operator gives GPUs back by shrinking only. The planner may price a preemption lower
    per GPU (it returns more GPUs than asked); where a shrink of the same job covers what is still
    wanted, that shrink is applied instead, since it keeps the job running."""
    if r.action == "shrink" or wanted <= 0:
        return r
    shrinkable = min(loan.replicas_on_lender, loan.replicas_total - loan.min_replicas)
    replicas = -(-wanted // loan.gpus_per_replica)
    if replicas > shrinkable:
        return r
    gpus = replicas * loan.gpus_per_replica
    reason = r.reason.replace(f"gives back {r.gpus_released}", f"gives back {gpus}")
    return dataclasses.replace(r, action="shrink", replicas_released=replicas, gpus_released=gpus,
                               reason=reason + " (a shrink instead of the planned preemption)")


async def shrink_borrower(ctx: Context, b: Borrower, r: loaning.Reclaim, grace: int, vc: str) -> bool:
    """Shrink a borrower by its pods on the lender's nodes, newest instances first (they have
    done the least since the gang last (re)started), with the lender's grace."""
    victims = sorted((p.instance for p in b.pods), reverse=True)
    if not ctx.serves(b.namespace):
        return await release_pods(ctx, b, victims[:r.replicas_released], grace, vc)
    return await preempting.shrink_gang(ctx, b.namespace, b.job, victims, f"reclaim: {r.reason}", grace,
                                        count=r.replicas_released)


async def preempt_borrower(ctx: Context, b: Borrower, r: loaning.Reclaim, grace: int, vc: str) -> bool:
    """Stop a borrower that cannot shrink, with the lender's grace (huorn.operator.preempting)."""
    if not ctx.serves(b.namespace):
        return await release_pods(ctx, b, [p.instance for p in b.pods], grace, vc)
    return await preempting.preempt_gang(ctx, b.namespace, b.job, f"preempted: {r.reason}", grace)


async def release_pods(ctx: Context, b: Borrower, instances: list[str], grace: int, vc: str) -> bool:
    """A borrower of a namespace another install serves (placed before that install stopped
    borrowing here, or by one that serves every namespace): its pods on the lender are deleted
    with the lender's grace (SIGTERM, a checkpoint), and nothing else. Its graph is its own
    install's to change: a decision written here raced that install's reconciles, which wrote
    their older graph back over it. The owner sees the pods go as it sees a lost node, and
    places their successors where it may: never on this lender, which lends it nothing."""
    going = [p for p in b.pods if p.instance in instances]
    for pod in going:
        # marked first: the owner replaces a pod that ends Failed (SIGTERM's exit 143) and would
        # count it against the job's restart budget; marked, it replaces it as a preemption
        await ctx.client.annotate("Pod", pod.namespace, pod.name, {manifests.ANNOTATION_RECLAIMED: vc})
        await ctx.client.delete("Pod", pod.namespace, pod.name, grace_seconds=grace)
    if going:
        logger.info("reclaim: deleted %d pod(s) of %s/%s, which another install serves", len(going),
                    b.namespace, b.job)
    return bool(going)
