"""Goodput growth for every elastic job of the cluster at once: the allocator the simulator runs.

Each TrainingJob's monitor used to run the allocator for its job alone, on the free GPUs of its own
virtual cluster. Two goodput jobs in one cluster then raced: whichever monitor ticked first took
every free GPU, however little they were worth to it and however much to the other, and none of
what makes the allocator Huorn's (goodput per GPU across jobs, the JCT weights, admission by value,
the borrowing and lending budgets) ever applied in a cluster.

Now a monitor's decision is its job's part of one allocation over every job the operator watches
with the goodput policy, on the cluster's real snapshot: the same `Allocator.allocate`, with the
settings of `huorn simulate`'s Huorn (`allocator.HUORN_RUNTIME`: `allocator.HUORN`, its greedy
charging a resize in place the in-place share of a restart). Each monitor applies only its own
job's part, so the jobs need no coordination beyond this process's memory: a peer's view is the
one its own monitor built at its last decision, and every job's size and span is read from the
pods, not from that view. A restarted operator simply has no peers until their monitors decide
again, one period later.

What others are owed comes first: the GPUs that gangs waiting in line still need (their missing
replicas) are held back from growth, as the reconcile's admission order holds them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from huorn.api.common import ElasticityPolicy
from huorn.api.training import TrainingJobSpec, declared_steps, processes_per_replica, token_budget
from huorn.backends import goodput
from huorn.graph import model, mutate, serialise
from huorn.operator import index, queue
from huorn.operator.context import Context
from huorn.scheduler import allocator, placement, snapshot

TRAINER = "trainer"
WAITING = "waiting-in-line"  # the binding that holds what waiting gangs need, per virtual cluster
OTHER_PODS = "other-pods"  # a job's pods that are not trainers (an eval): held, never decided on


def job_key(namespace: str, name: str) -> str:
    """The snapshot's name for a job (index.ClusterIndex.build_snapshot binds jobs under it)."""
    return f"{namespace}/{name}"


def rebind_trainers(snap: snapshot.ClusterSnapshot, key: str, pods: Iterable[index.PodRecord],
                    gpus_per_replica: int) -> int:
    """Bind a job's trainer pods as one replica each, and anything else it holds (an eval pod)
    under a name of its own that no decision touches. The index binds one "replica" per GPU,
    whatever the pod; the allocator reads a running gang's size and span from its binding.
    Returns the trainer replicas bound."""
    binding = snap.bindings().get(key)
    if binding is None:
        return 0
    snap.forget(key)
    # A pod being deleted (a shrink, a drain) still holds its GPUs, but is no longer part of the
    # gang: it stays held with the other pods.
    held = dict(binding.gpus_by_node)
    trainers = []
    for p in pods:
        if (p.vertex == TRAINER and p.node and p.gpus == gpus_per_replica and p.holds_resources
                and not p.deleting and held.get(p.node, 0) >= gpus_per_replica):
            held[p.node] -= gpus_per_replica
            trainers.append(p)
    if trainers:
        snap.assume(key, binding.virtual_cluster, placement.Placement([p.node for p in trainers]),
                    gpus_per_replica)
    rest = dict(binding.gpus_by_node)
    for p in trainers:
        rest[p.node] -= gpus_per_replica
    others = [node for node, gpus in sorted(rest.items()) for _ in range(gpus)]
    if others:
        snap.assume(f"{key}/{OTHER_PODS}", binding.virtual_cluster, placement.Placement(others), 1)
    return len(trainers)


Owed = dict[tuple[str, tuple[tuple[str, str], ...]], int]  # (vc, nodeSelector's items) → GPUs


def hold_for_waiting(snap: snapshot.ClusterSnapshot, owed: Owed) -> None:
    """Take the GPUs each virtual cluster's waiting gangs still need off its own free GPUs: growth
    is an extra, and every waiting gang's minimum comes before extras. Those of gangs with a
    nodeSelector are held on the nodes they admit: held anywhere, they left the selected nodes
    free for growth and the waiting gang short."""
    # those that select nodes first: held before them, a hold that may go anywhere took the
    # nodes they select, and theirs found no room
    for (vc, selector), gpus in sorted(owed.items(), key=lambda kv: (kv[0][0], not kv[0][1], kv[0][1])):
        if vc not in {v.name for v in snap.virtual_clusters()}:
            continue
        labels = dict(selector) or None
        room = sum(v.gpus_free for v in snap.node_views()
                   if v.virtual_cluster == vc and not v.cordoned and placement.fits_selector(v, labels))
        gpus = min(gpus, room)
        if gpus <= 0:
            continue
        where = snap.place(vc, gpus, 1, borrow=False, node_selector=labels)
        if isinstance(where, placement.Placement):
            key = f"{WAITING}/{vc}" + "".join(f"/{k}={v}" for k, v in selector)
            snap.assume(key, vc, where, 1)


def placement_hints(graph: model.Graph, vertex: str = TRAINER) -> dict[str, str]:
    """Instance → the node the goodput allocator placed it on, from the resizes that added it
    (write-ahead in status, so a restarted operator places it there too)."""
    hints: dict[str, str] = {}
    for m in graph.log:
        if m.action == "resize" and m.target == vertex and m.detail.get("nodes"):
            added = sorted(m.detail.get("added") or [])
            hints.update(zip(added, mutate.decode_nodes(m.detail["nodes"]), strict=False))
    return hints


def place_missing(snap: snapshot.ClusterSnapshot, vc: str, missing: list[str], gpus_per_replica: int,
                  hints: dict[str, str], node_selector: Mapping[str, str] | None = None
                  ) -> placement.Placement | placement.Unplaceable:
    """Nodes for the missing instances (in their order): where the allocator placed them while
    those GPUs are still free and the limits allow them, the others where the gang fits now, on
    nodes with the job's `node_selector` labels. A hint can be stale (a peer the allocator
    counted on shrinking has not yet, a node was cordoned, the selector was edited since): then
    every missing instance is placed afresh, as before hints existed."""
    hinted = [name for name in missing if name in hints]
    admitted = {v.name for v in snap.node_views() if placement.fits_selector(v, node_selector)}
    if any(hints[name] not in admitted for name in hinted):
        hinted = []
    if hinted:
        at = snap.place_at(vc, [hints[name] for name in hinted], gpus_per_replica)
        rest = [name for name in missing if name not in hints]
        if isinstance(at, placement.Placement) and not rest:
            return at
        if isinstance(at, placement.Placement):
            with snap.simulate():
                snap.assume(f"{vc}/hinted", vc, at, gpus_per_replica)
                where = snap.place(vc, len(rest), gpus_per_replica, node_selector=node_selector)
            if isinstance(where, placement.Placement):
                nodes = dict(zip(hinted, at.assignments, strict=True))
                nodes.update(zip(rest, where.assignments, strict=True))
                return placement.Placement([nodes[name] for name in missing])
    return snap.place(vc, len(missing), gpus_per_replica, node_selector=node_selector)


def gpus_per_node(snap: snapshot.ClusterSnapshot) -> int:
    """What a gang spans is predicted from the largest node (the allocator's table assumes perfect
    packing onto nodes of this size)."""
    return max((n.gpus_total for n in snap.node_views()), default=8) or 8


def ranks_per_replica(spec: TrainingJobSpec) -> int:
    """The trainer processes of one pod (training.processes_per_replica), each with its own
    telemetry port, and the unit a step log's world size is divided by to count replicas."""
    return processes_per_replica(spec.parallelism.pipeline_stages, spec.resources.gpus)


def goodput_policy(job: Any, arbiter: Callable[[allocator.JobView, float], allocator.Decision] | None,
                   gpu_type: str) -> goodput.GoodputPolicy | None:
    """A TrainingJob's goodput policy as its monitor runs it, starting from its prior (None unless
    its elasticity policy is goodput). `arbiter`: arbiter_for's, where its decisions come from."""
    spec = job.spec
    if spec.elasticity.policy != ElasticityPolicy.GOODPUT:
        return None
    gpus = spec.resources.gpus
    return goodput.GoodputPolicy(
        job=job.metadata.name, virtual_cluster=spec.virtual_cluster,
        # A job of no GPUs competes for none: it grows within its own bounds, alone.
        slots=spec.elasticity.max_replicas if not gpus else 0, gpus_per_replica=max(1, gpus),
        arbiter=arbiter if gpus else None,
        global_batch=float(spec.optimization.global_batch), total_steps=declared_steps(spec),
        priority=spec.priority, tokens=token_budget(spec), context=spec.model.context,
        batch_rule=goodput.batch_rule_priced(spec), micro_batch=spec.optimization.micro_batch,
        ranks_per_replica=ranks_per_replica(spec),
        node_selector=spec.node_selector,
        # each pipeline's stages make one data-parallel rank
        data_ranks_per_replica=ranks_per_replica(spec) // spec.parallelism.pipeline_stages,
        perf=goodput.prior_model(spec, gpu_type),
    )


def rank_view(job: Any, status: Mapping[str, Any], gpu_type: str) -> allocator.JobView | None:
    """How a goodput job that no arbitration hands over (waiting in line, or running before its
    monitor's first decision) counts in its virtual cluster's rank weights: at its prior, with the
    work its spec declares past its last checkpoint, where a gang that starts again resumes. The
    simulator ranks every live job so (AllocatorConfig.jct_weight_by "rank"); ranked over the
    running jobs alone, a cluster's weights were those of 21.12 % below the best Pollux on seeds
    0-9 where the simulator's gave 22.11 %. None for a job that competes for no GPUs (no GPUs, a
    suspended one, or not goodput-elastic: its size is its spec's)."""
    spec = job.spec
    policy = goodput_policy(job, None, gpu_type)
    if policy is None or not spec.resources.gpus or spec.suspend:
        return None
    done = int(((status.get("lastCheckpoint") or {}).get("step")) or 0)
    left = max(declared_steps(spec) - done, 0) * float(spec.optimization.global_batch)
    view = policy.job_view(spec.elasticity.min_replicas, spec.elasticity.max_replicas, 0, left)
    return dataclasses.replace(view, name=ranked_name(f"{job.metadata.namespace}/{job.metadata.name}"))


def ranked_name(key: str) -> str:
    """The allocator's name for a job's rank view: its goodput table is the prior's, and under the
    job's own name it would displace the table its monitor's learned view keeps."""
    return f"{key}#ranked"


def decide(decider: allocator.Allocator, snap: snapshot.ClusterSnapshot, me: allocator.JobView,
           peers: list[allocator.JobView], now: float,
           also_ranked: Mapping[str, list[float]] | None = None) -> allocator.Decision:
    """`me`'s part of one allocation over `me` and its peers (views named by job_key, bound on
    `snap` with their trainer replicas, their `replicas` what is bound). `also_ranked`: the
    remaining seconds of the live jobs not handed over, by virtual cluster (ranked_elsewhere)."""
    jobs = [me] + [p for p in peers if p.name != me.name]
    by_name = {d.job: d for d in decider.allocate(snap, jobs, now, also_ranked=also_ranked)}
    return by_name[me.name]


def ranked_elsewhere(decider: allocator.Allocator, entries: Iterable[queue.QueuedJob],
                     handed: set[str]) -> dict[str, list[float]]:
    """By virtual cluster, the remaining seconds of the jobs in line or running (the queue's
    entries with a rank view) that an allocation does not hand over (`handed`: job_key names):
    the allocator ranks every live job, as heSRPT's weights and the simulator do."""
    out: dict[str, list[float]] = {}
    for entry in entries:
        if entry.ranked is not None and entry.binding not in handed:
            out.setdefault(entry.virtual_cluster, []).append(decider.remaining_seconds(entry.ranked))
    return out


def with_size(view: allocator.JobView, name: str, replicas: int) -> allocator.JobView:
    """A view under the snapshot's name for its job, at the size its pods have now: a peer's view
    is from its monitor's last tick, and a reconcile may have grown or shrunk it since."""
    return dataclasses.replace(view, name=name, replicas=replicas)


def arbiter_for(ctx: Context, namespace: str, name: str
                ) -> Callable[[allocator.JobView, float], allocator.Decision]:
    """The job's GoodputPolicy.arbiter: its part of an allocation over every job whose monitor
    has decided with the goodput policy, on the cluster as the index mirrors it now."""
    me = (namespace, name)

    def cluster(gpus_per_replica: int) -> tuple[snapshot.ClusterSnapshot, int]:
        """The snapshot with this job bound by its running trainers, and how many there are."""
        snap = ctx.index.build_snapshot()
        running = rebind_trainers(snap, job_key(namespace, name), ctx.index.pods_of(namespace, name),
                                  gpus_per_replica)
        return snap, running

    def arbitrate(view: allocator.JobView, now: float) -> allocator.Decision:
        snap, running = cluster(view.gpus_per_replica)
        if not running:
            return _keep(view, "no trainer of it runs: nothing to decide from")
        # Sized by what runs, as its peers are: a resize in flight (new pods not placed yet, old
        # ones being deleted) is decided again from what the gang is, not from what it was told.
        mine = with_size(view, job_key(namespace, name), running)
        known = {v.name for v in snap.virtual_clusters()}
        peers: list[allocator.JobView] = []
        for (ns, job), state in sorted(ctx.monitors.items()):
            seen = getattr(getattr(state, "goodput", None), "view", None)
            if (ns, job) == me or seen is None or seen.virtual_cluster not in known:
                continue  # a peer of a cluster the index does not hold has no budget to weigh
            bound = rebind_trainers(snap, job_key(ns, job), ctx.index.pods_of(ns, job), seen.gpus_per_replica)
            if bound:  # a job with no trainer running has nothing to decide
                peers.append(with_size(seen, job_key(ns, job), bound))
        owed = _owed(ctx, me)
        hold_for_waiting(snap, owed)
        size = gpus_per_node(snap)
        decider = ctx.allocators.get(size)
        if decider is None:
            decider = ctx.allocators[size] = allocator.Allocator(
                dataclasses.replace(allocator.HUORN_RUNTIME, gpus_per_node=size))
        handed = {mine.name, *(p.name for p in peers)}
        decision = decide(decider, snap, mine, peers, now,
                          ranked_elsewhere(decider, ctx.queue.jobs.values(), handed))
        now_snap, _ = cluster(view.gpus_per_replica)
        hold_for_waiting(now_snap, owed)
        if decision.replicas > running:
            # Grow only into GPUs free now: what a peer's part would give up is given up by the
            # peer's own monitor, and a growth planned on it would wait, unplaceable, until then.
            fits = _placeable(now_snap, mine, decision.replicas - running)
            if fits < decision.replicas - running:  # a plain grow, placed where it fits
                decision = dataclasses.replace(decision, replicas=running + fits, assignments=[])
        if not _movable(now_snap, mine, decision, ctx.index.pods_of(namespace, name)):
            decision = dataclasses.replace(decision, assignments=[])
        return dataclasses.replace(decision, job=view.name)

    return arbitrate


def _owed(ctx: Context, me: tuple[str, str]) -> Owed:
    """GPUs each virtual cluster's waiting gangs still need, by the nodes they may use, the job
    itself left out."""
    owed: Owed = {}
    for w in ctx.queue.waiting():
        if w.key != me:
            where = (w.virtual_cluster, tuple(sorted((w.node_selector or {}).items())))
            owed[where] = owed.get(where, 0) + w.missing * w.gpus
    return owed


def _placeable(snap: snapshot.ClusterSnapshot, job: allocator.JobView, extra: int) -> int:
    """The most of `extra` new replicas of `job` that fit the snapshot as it is."""
    for n in range(extra, 0, -1):
        where = snap.place(job.virtual_cluster, n, job.gpus_per_replica, node_selector=job.node_selector)
        if isinstance(where, placement.Placement):
            return n
    return 0


def trainer_nodes(pods: Iterable[index.PodRecord]) -> dict[str, str]:
    """Instance → node of the trainers that hold their GPUs. One map for the monitor's repack
    (which replicas a move keeps) and `_movable` (whether the move fits): a failed pod not yet
    deleted had counted as running in the one and not in the other, so the fit was checked for a
    different move than the one written. A gang with a failed replica is not moved: its
    replacement is placed wherever it fits, and the resize keeps the others where they run."""
    return {p.instance: p.node for p in pods if p.vertex == TRAINER and p.node and not p.deleting
            and p.holds_resources}


def _movable(snap: snapshot.ClusterSnapshot, job: allocator.JobView, decision: allocator.Decision,
             pods: Iterable[index.PodRecord]) -> bool:
    """Whether the replicas a move to the decision's nodes adds fit there now, beside the pods
    that run (the goodput policy then moves the gang: backends.goodput.repack). A move placed on
    GPUs a peer has not given up yet would delete the replicas it replaces and leave the job
    waiting for the new ones: without the nodes, the resize keeps every replica and places the
    new ones where they fit."""
    if not decision.assignments:
        return True
    running = trainer_nodes(pods)
    leaving, new_nodes = placement.match_replicas(running, decision.assignments)
    if not leaving or not new_nodes:
        return True  # it only grows beside its replicas, or only shrinks
    if len(mutate.encode_nodes(new_nodes)) > serialise.LONG_SCALARS["nodes"]:
        return False  # the status log would drop where the new ones go: a restart for no packing
    where = snap.place_at(job.virtual_cluster, new_nodes, job.gpus_per_replica)
    return isinstance(where, placement.Placement)


def _keep(view: allocator.JobView, why: str) -> allocator.Decision:
    return allocator.Decision(view.name, "keep", view.replicas, view.replicas, reason=why)
