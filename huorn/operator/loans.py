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

import calendar
import dataclasses
import logging
import time
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.backends.kubernetes import manifests
from huorn.graph import serialise
from huorn.operator import board, index, preempting, queue, rljobs, serving, training, validation
from huorn.operator.context import Context
from huorn.scheduler import allocator, loaning, placement

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


def lent_by(borrowers: Mapping[Any, Borrower], nodes: Container[str] | None = None) -> int:
    """GPUs the borrowers' pods hold on the lender's nodes (on `nodes` only, when given)."""
    return sum(p.gpus for b in borrowers.values() for p in b.pods if nodes is None or p.node in nodes)


def selected_nodes(ctx: Context, vc: str, node_selector: Mapping[str, str] | None) -> set[str]:
    """`vc`'s member nodes that carry every label of a job's nodeSelector."""
    return {n.name for n in ctx.index.selected_members(vc, node_selector)}


def free_gpus(ctx: Context, vc: str, nodes: Container[str] | None = None) -> int:
    """GPUs free on `vc`'s member nodes that take new pods (of `nodes` only, when given): their
    GPUs less what live Huorn pods and other controllers' pods hold there. Pods on a node taking
    no new pods (cordoned, not Ready, tainted) hold GPUs that node's capacity no longer counts:
    counted as used, they made a lender read fewer free GPUs than it had and reclaim more than it
    needed."""
    schedulable = {n.name: n.gpus for n in ctx.index.members_of(vc)
                   if not n.unschedulable and (nodes is None or n.name in nodes)}
    used = sum(p.gpus for p in ctx.index.pods.values()
               if p.node in schedulable and p.holds_resources and not p.deleting)
    # capped by the Huorn pods counted here, which leave out those being deleted
    used += sum(gpus for node, gpus in ctx.index.held_by_others(leaving=False).items() if node in schedulable)
    return max(0, sum(schedulable.values()) - used)


def count_wanted(ctx: Context, vc: str, borrowers: Mapping[Any, Borrower]) -> int:
    """GPUs an inference cluster takes back: what its demand lacks (index.unmet_demand) beyond
    its free GPUs, at most what it has lent.

    InferenceJobs with a nodeSelector are left out, their pods and their demand alike: GPUs
    reclaimed anywhere need not be where they can go, so their waiting replicas are reclaimed
    for node by node (node_shortfall). Counted here, a replica that selected no node of the
    cluster stopped a borrower, and the GPUs it freed were then held unlent for nothing."""
    names = {n.name for n in ctx.index.members_of(vc)}
    selecting = ctx.index.demand_selector
    pods = [p for p in ctx.index.pods.values()  # demand already met by its own pods
            if p.node in names and p.holds_resources and not p.deleting and p.virtual_cluster == vc]
    own = sum(p.gpus for p in pods)
    others = ctx.index.others_held(leaving=False).get(vc, 0)
    lent = lent_by(borrowers)
    # the forecast counts the whole service's load, which the selecting jobs' pods serve too
    unmet = ctx.index.unmet_demand(vc, own, others, selecting=False,
                                   own_floors=sum(p.gpus for p in pods if p.job_key not in selecting))
    return max(0, min(lent, unmet - free_gpus(ctx, vc)))


# A replica waiting for GPUs on one node: its GPUs, and its job's nodeSelector (None: any node).
WaitingReplica = tuple[int, Mapping[str, str] | None]


def serving_replicas_waiting(ctx: Context, vc: str) -> list[WaitingReplica]:
    """The GPUs of each serving replica waiting on `vc` (ctx.serving_unplaced), of the jobs the
    index still counts as its demand (a job moved or refused since its last reconcile waits
    here for nothing), and no more replicas than that demand still lacks: a replica placed since
    the job's last reconcile (its pod or reservation already holds GPUs) was counted waiting and
    held at once, and a borrower was stopped for it. Counted in replicas, not GPUs: while a
    smaller `resources.gpus` rolls, the old replicas hold more GPUs than the demand's share, and
    a count in GPUs hid the rolled replica's successor."""
    out: list[WaitingReplica] = []
    for key, (cluster, gpus, count, selector) in ctx.serving_unplaced.items():
        demand_vc, demand = ctx.index.inference_demand.get(key, ("", 0))
        if cluster != vc or gpus <= 0 or demand_vc != vc:
            continue
        holders = [*ctx.index.pods_of(*key), *(r for (ns, _), r in ctx.index.reservations.items()
                                              if ns == key[0] and r.job == key[1])]
        held = sum(1 for p in holders if p.vertex == serving.SERVER and p.holds_resources and not p.deleting)
        out += [(gpus, selector)] * min(count, max(0, demand // gpus - held))
    return out


def node_shortfall(ctx: Context, vc: str, borrowers: Mapping[Any, Borrower], replicas: list[WaitingReplica]
                   ) -> tuple[int, set[str]]:
    """GPUs to reclaim so that the waiting replicas of `vc`'s own jobs (`replicas`: the GPUs of
    each, all on one node, as serving and gang placement put a replica, and the labels that node
    must carry) fit, and the nodes to reclaim them on. A replica of a job with a nodeSelector is
    fitted on the nodes it selects only: counted on any node, a reclaim freed GPUs where it
    could not go.

    count_wanted and line_wanted judge GPUs in total: with a borrower's pod on each of two 4-GPU
    nodes, 6 free GPUs covered a replica of 4 that no node could hold, nothing was reclaimed,
    and the replica waited for good. Here each waiting replica, largest first, takes the fullest
    node it fits (serving.choose_nodes' best fit), else the node where reclaiming costs the
    fewest GPUs: its free GPUs (counting pods being deleted as gone, as free_gpus does) plus what
    borrowers hold there must hold it, or no reclaim can place it."""
    waiting = sorted(((gpus, selector) for gpus, selector in replicas if gpus > 0), key=lambda r: -r[0])
    if not waiting:
        return 0, set()
    members = ctx.index.members_of(vc)
    labels = {n.name: n.labels for n in members}
    free = {n.name: n.gpus for n in members if not n.unschedulable}
    holders = [*ctx.index.pods.values(), *ctx.index.reservations.values()]
    for pod in holders:
        if pod.node in free and pod.holds_resources and not pod.deleting and pod.gpus:
            free[pod.node] -= pod.gpus
    for node, gpus in ctx.index.held_by_others(leaving=False).items():
        if node in free:
            free[node] -= gpus
    lent_on: dict[str, int] = {}
    for b in borrowers.values():
        for pod in b.pods:
            if pod.node in free:
                lent_on[pod.node] = lent_on.get(pod.node, 0) + pod.gpus
    need, nodes = 0, set()
    for gpus, selector in waiting:
        usable = {name: left for name, left in free.items() if placement.labels_match(labels[name], selector)}
        fits = sorted((left, name) for name, left in usable.items() if left >= gpus)
        if fits:
            free[fits[0][1]] -= gpus
            continue
        options = sorted((gpus - max(left, 0), name) for name, left in usable.items()
                         if max(left, 0) + lent_on.get(name, 0) >= gpus)
        if not options:
            continue  # no reclaim on one node can hold it
        take, name = options[0]
        need += take
        nodes.add(name)
        lent_on[name] -= take
        free[name] = 0
    return need, nodes


def on_nodes(borrowers: Mapping[Any, Borrower], nodes: set[str]) -> dict[Any, Borrower]:
    """The borrowers with pods on `nodes`, each with those pods only: a reclaim that must free
    GPUs on given nodes shrinks, and prices, only what runs there."""
    out = {}
    for key, b in borrowers.items():
        there = [p for p in b.pods if p.node in nodes]
        if there:
            out[key] = Borrower(b.namespace, b.job, there)
    return out


def over_limit(vc_spec: Mapping[str, Any], borrowers: Mapping[Any, Borrower], loans: list[loaning.LoanView]
               ) -> tuple[int, int]:
    """GPUs out on loan beyond what the lender's spec.lending allows now (maxGPUsLent, or 0 when
    not lendable), counting only what borrowers below PINNED_PRIORITY hold (a pinned job's lent
    GPUs stay in the budget when the limit drops, as the allocator keeps them); and the limit.
    Before, only a demand reclaimed: a lender that lowered maxGPUsLent, or stopped lending, kept
    every loan for as long as the borrowers ran, and nothing said so."""
    allowed = lending_allowed(vc_spec)
    lent = lent_by(borrowers)
    unpinned = sum(loan.replicas_on_lender * loan.gpus_per_replica for loan in loans
                   if loan.priority < allocator.PINNED_PRIORITY)
    return max(0, min(unpinned, lent - allowed)), allowed


def lending_allowed(vc_spec: Mapping[str, Any]) -> int:
    """GPUs the lender's spec lets it have out on loan: maxGPUsLent, or 0 when not lendable."""
    view = index.build_vc_view("", vc_spec)
    return view.max_gpus_lent if view.lendable else 0


def checkpoint_age(body: Mapping[str, Any], now: float) -> float:
    """Seconds since the job's last checkpoint landed (status.lastCheckpoint.time), else since it
    was placed (status.startTime): the work a victim that cannot checkpoint within the grace
    loses. Every borrower was priced at 0 s, so below a 10 s grace the victim was the first by
    name, whatever its checkpoint's age (one 55 minutes old stopped before one 5 s old)."""
    status = body.get("status") or {}
    for stamp in ((status.get("lastCheckpoint") or {}).get("time"), status.get("startTime")):
        try:
            then = calendar.timegm(time.strptime(str(stamp), "%Y-%m-%dT%H:%M:%SZ"))
        except ValueError:
            continue
        return max(0.0, now - then)
    return 0.0


def line_wanted(ctx: Context, vc: str, borrowers: Mapping[Any, Borrower]
                ) -> tuple[int, int, list[queue.QueuedJob]]:
    """A training lender's line: what its own jobs in line (huorn.operator.queue: gangs below
    their minimum) need, the part of it that its free GPUs cannot give (up to what it has out on
    loan: the debt due), and those jobs.

    Jobs are taken first in line first, each only while the GPUs reclaim could give (free + lent)
    still hold it: a gang larger than all of that would not be placed after a reclaim either, and
    reclaiming for it would only stop borrowers for GPUs that then sit idle.

    A job with a nodeSelector counts only the nodes it selects, and adds nothing to the debt
    returned: GPUs reclaimed anywhere need not help it, so its reclaim is the targeted one of
    `node_shortfall` (the lender's reclaim, below). Counted over every node, a lender stopped a
    borrower on a node the job could not use, and held the GPUs unlent while the job waited."""
    free = free_gpus(ctx, vc)
    lent = lent_by(borrowers)
    room, need, anywhere, jobs = free + lent, 0, 0, []
    selecting: list[tuple[set[str], int]] = []  # the nodes and GPUs of the selecting jobs taken
    for job in ctx.queue.waiting():
        gpus = job.missing * job.gpus
        if job.virtual_cluster != vc:
            continue
        if job.node_selector:
            nodes = selected_nodes(ctx, vc, job.node_selector)
            # less what jobs ahead of it that select any of its nodes were counted on
            ahead = sum(taken for others, taken in selecting if others & nodes)
            if gpus > min(room - need, free_gpus(ctx, vc, nodes) + lent_by(borrowers, nodes) - ahead):
                continue
            selecting.append((nodes, gpus))
        elif gpus > room - need:
            continue
        else:
            anywhere += gpus
        need += gpus
        jobs.append(job)
    return need, max(0, min(lent, anywhere - free)), jobs


def reserve_for_line(ctx: Context, vc: str, need: int, line: list[queue.QueuedJob] | None = None) -> None:
    """Keep `need` GPUs of a training lender unlent while its own jobs wait for them, as an
    inference cluster keeps its InferenceJobs' demand: placement's snapshot never lends a
    cluster's reserve (`index.build_snapshot`).

    Without it a reclaim went round in circles: the preempted borrower's successors, reconciled
    the moment its old pods were gone, took the freed GPUs back before the lender's job was
    placed, and the next tick reclaimed them again (6 preemptions in 60 s, none placing the
    lender's job). Once the line's jobs are placed the need is 0, and the next tick drops it."""
    if need > 0:
        ctx.index.line_reserve[vc] = need
    else:
        ctx.index.line_reserve.pop(vc, None)
    # and a job that selects nodes has its GPUs kept there (index.kept_on_nodes): counted only,
    # they were lent from another node and the borrower's successor took the selected one back
    kept = [(job.key, job.node_selector, job.missing * job.gpus, ctx.index.held_by(job.key))
            for job in line or [] if job.node_selector]
    if need > 0 and kept:
        ctx.index.line_kept[vc] = kept
    else:
        ctx.index.line_kept.pop(vc, None)


async def reclaim(ctx: Context, vc_body: Mapping[str, Any]) -> list[loaning.Reclaim]:
    """Reclaim what a lender needs back; returns the reclaims applied.

    An inference cluster needs back what its InferenceJobs' replicas (or its forecast) need; a
    training cluster, what its own jobs waiting in line need (`line_wanted`). Before, only an
    inference cluster ever reclaimed, so a training cluster that lent had its own jobs wait for as
    long as the borrowers ran."""
    name = vc_body["metadata"]["name"]
    spec = vc_body.get("spec") or {}
    inference = spec.get("purpose") == "inference"
    borrowers = find_borrowers(ctx, name)
    lends = ctx.index.serves_all_of(name)
    if not lends:
        # Not lent by this install (the one serving all its namespaces reclaims, where there is
        # one): its own borrowers there were placed before it stopped lending, and no install
        # may ever reclaim them for a demand it does not see. They all give their GPUs back.
        borrowers = {k: b for k, b in borrowers.items() if ctx.serves(b.namespace)}
    line: list[queue.QueuedJob] = []
    need = 0
    targeted: list[str] = []  # the nodes a reclaim for whole serving replicas frees GPUs on
    if lends and not inference:
        need, wanted, line = line_wanted(ctx, name, borrowers)
    reserve_for_line(ctx, name, need, line)
    if not borrowers:
        return []
    lent = lent_by(borrowers)
    if not lends:
        wanted = lent
    else:
        if inference:
            wanted = count_wanted(ctx, name, borrowers)  # the InferenceJobs' floors, or the forecast
            waiting = serving_replicas_waiting(ctx, name)
        else:  # the line's gangs, each replica whole on one node too, on the nodes it selects
            waiting = [(job.gpus, job.node_selector) for job in line for _ in range(job.missing)]
        short, nodes = node_shortfall(ctx, name, borrowers, waiting)
        if short > wanted and lent <= lending_allowed(spec):
            # the waiting replicas fit only where GPUs come back on the right nodes (not when the
            # lender is over its limit: that reclaim takes back more, wherever it is)
            wanted, borrowers, targeted = short, on_nodes(borrowers, nodes), sorted(nodes)
    if wanted <= 0 and not (lends and lent > lending_allowed(spec)):
        ctx.reclaim_blocked.pop(name, None)
        return []
    asked = wanted
    blocked: list[str] = []  # why GPUs still lent could not be reclaimed this pass
    jobs: dict[str, tuple[Borrower, Mapping[str, Any], Any]] = {}
    loans = []
    now = time.time()
    for b in borrowers.values():
        body = await ctx.client.get_custom(training.PLURAL, b.namespace, b.job)
        if body is None or not (body.get("status") or {}).get("graph"):
            blocked.append(f"{b.namespace}/{b.job} holds {sum(p.gpus for p in b.pods)} lent GPU(s) but "
                           "its TrainingJob or its graph in status cannot be read yet")
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
            seconds_since_checkpoint=checkpoint_age(body, now),
        ))
    view = index.build_vc_view(name, spec)
    forecast_gpus = ctx.index.forecast_demand.get(name, 0)
    over, allowed = over_limit(spec, borrowers, loans) if lends else (0, 0)
    if over > max(wanted, 0):
        # the limit alone asks: never a pinned job's GPUs (over_limit left them out)
        loans = [loan for loan in loans if loan.priority < allocator.PINNED_PRIORITY]
        wanted = asked = over
        why = (f"it lends more GPUs than spec.lending allows now ({allowed}: maxGPUsLent, or 0 with "
               "lendable false)")
    elif not lends:
        why = (f"this install does not serve every namespace {name} admits (spec.namespaces), so it "
               "lends it nothing and its borrowers there give their GPUs back")
    elif not inference:
        more = f" and {len(line) - 5} more" if len(line) > 5 else ""
        shown = ", ".join(j.binding for j in line[:5]) + more
        where = f" on {', '.join(targeted)}, each replica whole on one node" if targeted else ""
        why = (f"its own jobs in line need {sum(j.missing * j.gpus for j in line)} GPU(s) ({shown}) "
               f"that its free GPUs cannot give{where}")
    elif forecast_gpus > ctx.index.floors_of(name):
        why = f"its forecast request rate needs {forecast_gpus} GPU(s) ({board.FIELD})"
    elif targeted:
        why = (f"its InferenceJobs' waiting replicas need GPUs back on {', '.join(targeted)}, each "
               "replica whole on one node")
    else:
        why = f"its InferenceJobs need {ctx.index.demand_of(name)} GPU(s)"
    plan = loaning.plan_reclaim(view, wanted, loans, now, why) if wanted > 0 and loans else []
    applied = []
    left = wanted
    by_job = {loan.job: loan for loan in loans}
    for planned in plan:
        b, body, _ = jobs[planned.job]
        r = as_shrink(planned, by_job[planned.job], left)
        if r.action != "shrink":
            if (spec.get("lending") or {}).get("reclaimPolicy", "Preempt") != "Preempt":
                blocked.append(f"{r.job} holds {r.gpus_released} lent GPU(s) but cannot shrink (at "
                               "minReplicas, or elasticity.policy fixed), and lending.reclaimPolicy is "
                               "Shrink")
                continue
            if await preempt_borrower(ctx, b, r, int(view.reclaim_grace_seconds), name):
                ctx.post_event(vc_body, "Normal", "Reclaimed", f"{r.reason} (preempted)")
                applied.append(r)
                left -= r.gpus_released
            else:
                blocked.append(f"{r.job} could not be preempted (no live trainer pod left to stop)")
            continue
        if await shrink_borrower(ctx, b, r, int(view.reclaim_grace_seconds), name):
            ctx.post_event(vc_body, "Normal", "Reclaimed", r.reason)
            applied.append(r)
            left -= r.gpus_released
        else:
            blocked.append(f"{r.job} could not be shrunk (its replicas on {name} are already going)")
    if left > 0 and blocked:
        message = (f"{name} reclaims {asked} GPU(s) ({why}), {left} of them not this pass: "
                   f"{'; '.join(blocked)}"[:1024])
        if ctx.reclaim_blocked.get(name) != message:
            ctx.post_event(vc_body, "Warning", "ReclaimBlocked", message)
        ctx.reclaim_blocked[name] = message
    else:
        ctx.reclaim_blocked.pop(name, None)
    if applied and line:
        await tell_the_line(ctx, name, line, sum(r.gpus_released for r in applied), asked)
    return applied


async def tell_the_line(ctx: Context, vc: str, line: list[queue.QueuedJob], released: int,
                        asked: int) -> None:
    """A Normal Event `Reclaiming` on each job the reclaim is for: its waiting message counts only
    free and lendable GPUs, and without this nothing said that its cluster's GPUs were lent out
    and are coming back."""
    for job in line:
        plural = rljobs.PLURAL if job.kind == rljobs.KIND else training.PLURAL
        body = await ctx.client.get_custom(plural, job.namespace, job.name)
        if body is not None:
            ctx.post_event(body, "Normal", "Reclaiming",
                           f"{vc} had lent {asked} GPU(s) this job's line needs to other virtual clusters; "
                           f"{released} are being reclaimed (the borrowers checkpoint within "
                           "lending.reclaimGraceSeconds), and the job is placed once they are free")


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
