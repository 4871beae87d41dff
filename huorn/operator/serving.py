"""InferenceJob in the cluster: serving replicas placed on their virtual cluster, behind a Service,
scaled to their SLO, and given GPUs back from borrowers when load rises.

The job's graph is the compiled one (a `router` vertex, which is the Service, and a `server`
vertex, one pod per instance), kept in status like a TrainingJob's, and changed only by recorded
mutations: a resize from the autoscaler (huorn.operator.autoscaling), a replacement of a lost pod,
a rolling replacement after a spec change. So `status.decisions` says why the job has the
replicas it has, and a restarted operator carries on from status.

- **Placement.** A replica asking for GPUs goes on one node of the job's virtual cluster, the
  fullest one it fits on (best fit keeps whole nodes free for training gangs), pinned there like
  a trainer. A replica that finds no room waits; its GPUs are already in the cluster's demand
  (`status.desiredReplicas × resources.gpus`, with the replicas a rolling update keeps:
  index.ClusterIndex.demand_of), so the cluster's
  next tick reclaims lent GPUs for it (huorn.operator.loans), and the borrower's pods going away
  wake this job at once.
- **Lost pods.** A replica pod that ended (evicted, its node gone), or is still Pending
  `--pod-start-seconds` after its creation, is replaced with a new generation; a crashed server
  inside a live pod is the kubelet's to restart (restartPolicy Always), as in a Deployment.
- **Rolling update.** A spec change that a running replica cannot pick up (model, quantisation,
  image, resources, env: manifests.serve_template_hash) replaces the replicas one at a time, each
  only while every other replica is ready, and the one replaced serves until its successor is
  ready (`surging`): capacity never drops where there are GPUs for one more replica, and by at
  most one where there are not. A replica of the older spec that is not ready serves no one, and
  is replaced at once.
- **Scale to zero** (`autoscaling.minReplicas: 0`). An activator pod runs beside the replicas
  (huorn.runtime.activator) and a second Service, `<job>-replicas`, always selects the replicas.
  The job's own Service selects the replicas while one is ready and the activator otherwise
  (`status.routing`), switched before the last replica is deleted, so no request reaches a
  replica on its way out. The activator holds what comes meanwhile; the autoscaler reads how
  many it holds and asks for replicas.
- **Prefix routing** (`routing.policy: prefix`). The activator pod runs as the job's router
  (huorn.runtime.router) whatever minReplicas is, and finds the ready replicas through a headless
  Service, `<job>-endpoints`. The job's Service selects the router once it is ready and the
  replicas (or, scaled to zero, the activator) otherwise, so a router that crashes or restarts
  costs the cache's hit rate, never an answer. The pod carries the hash of its image and of the
  settings it reads at its start (manifests.front_template_hash) and is replaced when they
  change, a switch of policy included.
- **Front pods** (`routing.frontReplicas`): the activator or router pods, as many as asked,
  on different nodes where the scheduler can; a lost one is replaced while the others serve, and
  stale ones are replaced one at a time, each once every other front pod is ready (a stale one
  that is not ready serves no one, and is replaced at once). The Service that front pods of
  earlier settings read (`<job>-replicas`, `<job>-endpoints`) goes once the last of them has
  (`status.frontServices`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from huorn.api import kinds
from huorn.backends.kubernetes import manifests
from huorn.graph import compiler, mutate, serialise
from huorn.graph.model import Graph, Instance
from huorn.operator import conditions, images, index, namesakes, validation
from huorn.operator.context import Context
from huorn.operator.training import build_decisions, stall, write_status
from huorn.scheduler import placement

PLURAL = "inferencejobs"
ACTIVATOR, REPLICAS, ROUTER = "activator", "replicas", "router"  # where the job's Service sends requests
ENDPOINTS = "endpoints"  # with REPLICAS, the Services front pods read (status.frontServices)
KIND = "InferenceJob"
SERVER = "server"


def is_ready(pod: index.PodRecord) -> bool:
    """Running, and ready by the kubelet's readiness probe (the model is loaded). A pod with no
    Ready condition at all is judged by its phase."""
    if pod.phase != "Running" or pod.deleting:
        return False
    ready = [status for kind, status in pod.conditions if kind == "Ready"]
    return not ready or ready[0] == "True"


def restore_graph(body: Mapping[str, Any], fresh: Graph,
                  ready: Mapping[str, bool] | None = None) -> tuple[Graph, list[str]]:
    """The graph in status with the spec's bounds and parameters laid over it (the spec owns
    them; the instances are the job's history); a replica count the new bounds exclude is
    resized into them, keeping the `ready` replicas (by instance) first. Returns the graph and the
    reasons of the mutations made."""
    old = (body.get("status") or {}).get("graph")
    if not old:
        return fresh, []
    graph = serialise.from_status(old)
    server, spec_server = graph.vertex(SERVER), fresh.vertex(SERVER)
    before = (server.min_replicas, server.max_replicas)
    server.params, server.resources = spec_server.params, spec_server.resources
    graph.vertex("router").params = fresh.vertex("router").params
    low, high = spec_server.min_replicas, spec_server.max_replicas
    server.min_replicas, server.max_replicas = min(low, server.replicas), max(high, server.replicas)
    inside = min(high, max(low, server.replicas))  # 0 only when the spec allows scaling to zero
    made = []
    if inside != server.replicas:
        reason = (f"spec.autoscaling is now {low}..{high} replicas (was {before[0]}..{before[1]}): "
                  f"{server.replicas} → {inside}")
        mutate.resize(graph, SERVER, inside, reason=reason, remove=shrink_order(graph, inside, ready or {}))
        made.append(reason)
    server.min_replicas, server.max_replicas = low, high
    return graph, made


def shrink_order(graph: Graph, replicas: int, ready: Mapping[str, bool]) -> list[str] | None:
    """The instances a shrink to `replicas` removes: those not ready first (a replica still
    waiting for GPUs or loading serves no one), then the highest ordinals."""
    instances = graph.vertex(SERVER).instances
    drop = len(instances) - replicas
    if drop <= 0:
        return None
    order = sorted(instances, key=lambda i: (ready.get(i.name, False), -i.ordinal))
    return [i.name for i in order[:drop]]


def free_gpus(ctx: Context, vc: str, node_selector: Mapping[str, str] | None = None) -> dict[str, int]:
    """GPUs free now on each schedulable member node of `vc` (of those with every label of
    `node_selector`, an RLJob's or an InferenceJob's): its GPUs less what pods (deleting ones
    too, until they are gone), this operator's reservations and other controllers' pods hold
    there (a replica was bound to GPUs another controller's pod held, and stayed Pending)."""
    free = {n.name: n.gpus for n in ctx.index.selected_members(vc, node_selector) if not n.unschedulable}
    holders = [*ctx.index.pods.values(), *ctx.index.reservations.values()]
    for pod in holders:
        if pod.node in free and pod.holds_resources and pod.gpus:
            free[pod.node] -= pod.gpus
    for node, gpus in ctx.index.held_by_others().items():
        if node in free:
            free[node] -= gpus
    return free


def nodes_in_words(ctx: Context, vc: str, node_selector: Mapping[str, str] | None) -> str:
    """The nodes a job of `vc` may use, for its waiting message: with a nodeSelector that no
    member node matches, says so (counted "0 free", a typo in a label read as a busy cluster)."""
    if not node_selector:
        return "its nodes"
    labels = placement.selector_labels(node_selector)
    if not ctx.index.selected_members(vc, node_selector):
        return (f"its nodes labelled {labels} (spec.nodeSelector), of which it has none: label nodes so, "
                "or change the selector")
    return f"its nodes labelled {labels} (spec.nodeSelector)"


def choose_nodes(free: dict[str, int], gpus: int, count: int) -> list[str]:
    """Best fit, one replica at a time: the node with the fewest free GPUs that still fits it
    (ties by name, so the choice is the same after a restart). Fewer than `count` when full."""
    chosen = []
    for _ in range(count):
        fits = sorted((left, name) for name, left in free.items() if left >= gpus)
        if not fits:
            break
        name = fits[0][1]
        free[name] -= gpus
        chosen.append(name)
    return chosen


def _not_waiting(ctx: Context, body: Mapping[str, Any]) -> None:
    """A job that places no replica now (refused, or its cluster gone) waits for no GPUs: a
    replica it waited for before stayed in ctx.serving_unplaced, and the old cluster's reclaim
    (loans.node_shortfall) stopped borrowers for it."""
    meta = body["metadata"]
    ctx.serving_waiting.pop((meta["namespace"], meta["name"]), None)
    ctx.serving_unplaced.pop((meta["namespace"], meta["name"]), None)


async def reconcile(ctx: Context, body: Mapping[str, Any]) -> str:
    """Bring one InferenceJob one step closer to its spec and its autoscaler's replica count."""
    if (taken := await namesakes.older_namesake(ctx, body)) is not None:
        _not_waiting(ctx, body)
        return await stall(ctx, body, namesakes.REASON, taken, PLURAL, KIND)
    body = await images.pin(ctx, PLURAL, body)  # before anything is built from the spec
    meta = body["metadata"]
    ns, name = meta["namespace"], meta["name"]
    old = body.get("status") or {}
    try:
        job, vc_spec = validation.load_job_on_cluster(body, ctx.index.vcs)
        assert isinstance(job, kinds.InferenceJob)
        validation.check_spec_alone(job)  # the checks `huorn validate` also makes
        fresh = compiler.compile(job)
    except (validation.InvalidSpec, ValueError) as exc:
        _not_waiting(ctx, body)
        ctx.metrics.forget_inference_job(ns, name)
        return await stall(ctx, body, "InvalidSpec", str(exc), PLURAL, KIND)
    vc = job.spec.virtual_cluster
    ref = manifests.JobRef.from_body(body)
    spec = job.spec.to_wire()
    selector = f"{manifests.LABEL_JOB}={name},{manifests.LABEL_VERTEX}={SERVER}"
    base = {"observedGeneration": meta.get("generation"), "selector": selector}
    if vc_spec is None:
        message = f"virtual cluster {vc!r} does not exist; create it or fix spec.virtualCluster"
        _not_waiting(ctx, body)
        ctx.metrics.forget_inference_job(ns, name)
        return await _report_waiting(ctx, body, base, "VirtualClusterNotFound", message)

    pods = {p.name: p for p in ctx.index.pods_of(ns, name)}
    # a lower maxReplicas keeps the replicas that serve, not the lowest ordinals
    graph, resized = restore_graph(body, fresh, {p.instance: is_ready(p) for p in pods.values()
                                                 if p.vertex == SERVER and not p.deleting})
    version = graph.version
    server = graph.vertex(SERVER)
    templates = manifests.serve_template_hashes(spec)

    def pod_of(instance: Instance) -> index.PodRecord | None:
        return pods.get(manifests.pod_name(ref, instance))

    now, start_seconds = time.time(), ctx.settings.trainer_start_seconds
    for instance in list(server.instances):
        pod = pod_of(instance)
        if pod is not None and not pod.deleting and not pod.holds_resources:
            code = f"exit code {pod.exit_code}" if pod.exit_code is not None else "no reason given"
            why = pod.ended or code
            mutate.replace_instance(graph, instance.name, failure=True,
                                    reason=f"replica pod {pod.name} {pod.phase} ({why}): replaced")
        elif pod is not None and not pod.deleting and pod.never_started(now, start_seconds):
            # Pending for good (its image not pulled, its node gone before it started): it held
            # its GPUs and the job's capacity while serving no one, and was never placed again.
            mutate.replace_instance(graph, instance.name, failure=True, reason=(
                f"replica pod {pod.name} did not start within {start_seconds:.0f} s "
                f"({pod.not_started_reason()}; --pod-start-seconds): replaced"))
    _roll_one(graph, ref, pods, templates)
    if graph.version != version:
        # Write-ahead: the mutation is in status before any pod is created or deleted for it.
        status = {**base, "graph": serialise.to_status(graph), "decisions": build_decisions(graph),
                  "desiredReplicas": server.replicas}
        await ctx.client.patch_status(PLURAL, ns, name, status)
        ctx.index.observe_inference_job({**body, "status": {**old, **status}})
        for reason in resized:
            ctx.post_event(body, "Normal", "Scaled", reason)
        for m in graph.log:
            if m.version > version:
                ctx.metrics.decisions.labels(KIND, m.action).inc()

    creating = ctx.index.creating(ns, name)  # placed, not yet seen by the watch
    missing = [i for i in server.instances
               if pod_of(i) is None and manifests.pod_name(ref, i) not in creating]
    gpus = job.spec.resources.gpus
    to_zero = job.spec.autoscaling.min_replicas == 0
    by_prefix = job.spec.routing.policy == "prefix"
    # the replicas a rolling update is replacing serve until their successors are ready
    coming = creating | {manifests.pod_name(ref, i) for i in missing}
    serving_ready = sum(1 for i in server.instances if (p := pod_of(i)) is not None and is_ready(p))
    serving_ready += len(surging(graph, ref, pods.values(), coming))
    # Leaving scale to zero (minReplicas raised from 0) with no replica ready yet: the activators
    # stay, and the Service on them, until one is. Before, they went at the edit and the Service
    # turned to replicas still loading: nothing answered for a whole model load, and what the
    # activators held was refused as they stopped.
    # (only out of scale to zero: the job's Service was on the activators, which forward through
    # `<job>-replicas`; a router left by a switch from prefix routing has no such Service)
    bridging = (not to_zero and not by_prefix and serving_ready == 0 and old.get("routing") == ACTIVATOR
                and any(p.name.startswith(manifests.activator_pod_name(ref)) and p.holds_resources
                        and not p.deleting for p in pods.values()))
    front_wanted = to_zero or by_prefix or bridging  # the front pods: they hold requests, or route them
    fronts = [pods.get(manifests.activator_pod_name(ref, i))
              for i in range(job.spec.routing.front_replicas if front_wanted else 0)]
    # the Service points at the routers once one that runs today's settings is ready; else at
    # the activators whenever no replica that stays is ready
    if by_prefix and any(f is not None and front_is_current(f, spec) and is_ready(f) for f in fronts):
        routing = ROUTER
    else:
        routing = ACTIVATOR if (to_zero or bridging) and serving_ready == 0 else REPLICAS
    writes: list[dict[str, Any]] = []
    if missing or old.get("observedGeneration") != meta.get("generation") \
            or old.get("routing", REPLICAS) != routing:
        writes += [manifests.build_serve_config_map(ref, spec),
                   manifests.build_serve_service(ref, to_activator=routing in (ACTIVATOR, ROUTER))]
        if to_zero and not by_prefix:
            writes.append(manifests.build_replicas_service(ref))
        if by_prefix:
            writes.append(manifests.build_endpoints_service(ref))
    writes += [manifests.build_activator_pod(ref, spec, i) for i, f in enumerate(fronts) if f is None]
    services = await _retire_front_services(ctx, ref, old, pods.values(), spec, to_zero, by_prefix)
    for stale in _fronts_to_replace(fronts, spec):
        # ended (evicted, its node gone), or started from other settings (the image, the policy,
        # the cache, the time-out): deleted now, a new one on the reconcile its going wakes
        await ctx.client.delete("Pod", ns, stale.name)
    placed = 0
    async with ctx.placement_lock:
        selector = job.spec.node_selector
        nodes = (choose_nodes(free_gpus(ctx, vc, selector), gpus, len(missing)) if gpus
                 else [""] * len(missing))
        pods_new = [manifests.build_serve_pod(ref, i, node, spec, vc, ctx.index.tolerations_on(node))
                    for i, node in zip(missing, nodes, strict=False)]
        ctx.index.reserve(r for r in (index.build_pod_record(p) for p in pods_new) if r is not None)
        placed = len(pods_new)
    try:
        if writes:
            await ctx.client.apply(writes[0])  # the ConfigMap before any pod that reads it
            await ctx.apply_all(writes[1:])
        await ctx.apply_all(pods_new)
    except BaseException:
        # not created (or not known to be): the next reconcile finds them missing, not creating
        ctx.index.release(r for r in (index.build_pod_record(p) for p in pods_new) if r is not None)
        raise
    wanted = {manifests.pod_name(ref, i) for i in server.instances}
    surge = surging(graph, ref, pods.values(), creating | {p["metadata"]["name"] for p in pods_new})
    wanted |= surge
    wanted |= {manifests.activator_pod_name(ref, i) for i in range(len(fronts))}
    if fronts and not any(f is not None and is_ready(f) for f in fronts):
        # frontReplicas lowered while none of the pods it keeps is ready: the ones beyond it
        # stay until one is (scaled to zero, the Service sends every request to a front pod)
        wanted |= {p.name for p in pods.values() if p.name.startswith(manifests.activator_pod_name(ref))}
    await asyncio.gather(*(ctx.client.delete("Pod", ns, p.name)
                           for p in pods.values() if p.name not in wanted and not p.deleting))

    unplaced = len(missing) - placed
    if unplaced:
        ctx.serving_waiting[(ns, name)] = vc
        ctx.serving_unplaced[(ns, name)] = (vc, gpus, unplaced, selector)
    else:
        ctx.serving_waiting.pop((ns, name), None)
        ctx.serving_unplaced.pop((ns, name), None)
    live = [pod_of(i) for i in server.instances]
    ready = sum(1 for p in live if p is not None and is_ready(p)) + len(surge)
    running = sum(1 for p in live if p is not None and p.holds_resources) + placed
    activator_ready = any(f is not None and is_ready(f) for f in fronts)
    if unplaced:
        reason = "WaitingForGPUs"
        where = "" if not selector else f" on {nodes_in_words(ctx, vc, selector)}"
        message = (f"{unplaced} of {server.replicas} replica(s) wait for {gpus} GPU(s) each on virtual "
                   f"cluster {vc!r}{where} (GPUs it lent are reclaimed for them; otherwise they wait "
                   "for GPUs to free)")
    elif ready < server.replicas:
        reason, message = "ReplicasStarting", f"{ready} of {server.replicas} replica(s) ready"
    elif server.replicas == 0 and not activator_ready:
        reason, message = "ActivatorStarting", "scaled to zero; the activator is not ready yet"
    elif server.replicas == 0:
        reason, message = "ScaledToZero", "scaled to zero: the activator holds requests and wakes a replica"
    elif surge:
        # serving, but not on the spec asked for: Ready (it answers), and Reconciling names who
        # it waits for, as a Deployment's Available and Progressing tell a rollout apart
        reason, message = "RollingUpdate", (
            f"{ready} replica(s) serving; {len(surge)} of an older spec serve until their successors "
            "are ready")
    else:
        reason, message = "AllReplicasReady", f"{ready} replica(s) serving"
    serving_now = ready > 0 or (server.replicas == 0 and activator_ready)
    phase = "Running" if serving_now else "Pending"
    status = {
        **base,
        "phase": phase,
        "replicas": running,
        "readyReplicas": ready,
        "desiredReplicas": server.replicas,
        "message": message,
        "graph": serialise.to_status(graph),
        "decisions": build_decisions(graph),
        "conditions": conditions.build_conditions(
            old.get("conditions"), meta.get("generation"),
            ready=(ready >= server.replicas and serving_now, reason, message),
            reconciling=(True, reason, message) if ready < server.replicas or not serving_now or surge
            else None,
        ),
    }
    if surge or old.get("surgingReplicas"):
        status["surgingReplicas"] = len(surge)  # in the cluster's demand (index.observe_inference_job)
    if front_wanted or "routing" in old:
        status["routing"] = routing
    if services or "frontServices" in old or "routing" in old:
        # a status from before the field that had front pods: its retired Services are recorded
        # too, or every reconcile would delete them again
        status["frontServices"] = services
    if unplaced and old.get("message") != message:
        ctx.post_event(body, "Normal", reason, message)
    await write_status(ctx, body, status, PLURAL)
    ctx.metrics.record_phase(KIND, f"{ns}/{name}", phase)
    ctx.metrics.inference_replicas.labels(ns, name, "desired").set(server.replicas)
    ctx.metrics.inference_replicas.labels(ns, name, "ready").set(ready)
    return phase


def surging(graph: Graph, ref: manifests.JobRef, pods: Iterable[index.PodRecord],
            placed: set[str]) -> set[str]:
    """The pods of replicas a rolling update replaced that keep serving until their successor is
    ready (make before break): each successor is placed beside the pod it replaces while there
    are GPUs for it. Before, the replaced pod was deleted as its successor was created, and a
    one-replica job served no one for a model load at every update.

    Only while the successor (the last of its line, if it was replaced in turn) is placed
    (`placed`: pod names created, or being created) and not ready yet, and the old pod still
    serves: a successor that finds no GPUs does not hold its predecessor, whose GPUs it then
    waits for (the update goes on, one replica down, as before), nor does one scaled away."""
    live = {i.name: i for i in graph.vertex(SERVER).instances}
    pods = [p for p in pods if p.vertex == SERVER]
    by_instance = {p.instance: p for p in pods if not p.deleting}
    now = time.time()
    # terminating ones too, but not one past its grace (its node stopped answering: it may never
    # go, and waiting for its GPUs would stall the update for good)
    holding = {p.instance for p in pods if p.holds_resources and not p.past_grace(now)}
    # every replacement, a rolling one or of a successor that failed or never started: the old
    # replica waits for the end of its chain, not only for its first successor (that one's
    # failure, or a second edit replacing it while it loaded, deleted the last serving pod)
    successor_of = {str(m.detail["old"]): str(m.detail["new"]) for m in graph.log
                    if m.action == "replace" and m.target == SERVER and "old" in m.detail}
    keep: set[str] = set()
    for m in graph.log:
        rolled = m.action == "replace" and m.target == SERVER and m.detail.get("drain")
        if not rolled or m.detail.get("failure"):
            continue  # not a rolling update's replacement
        old, name = by_instance.get(str(m.detail["old"])), str(m.detail["new"])
        seen = {name}
        while name not in live and successor_of.get(name) not in (None, *seen):
            name = successor_of[name]
            seen.add(name)
        new = live.get(name)
        if old is None or not is_ready(old) or new is None:
            continue
        if any((mid := by_instance.get(n)) is not None and is_ready(mid) for n in seen - {name}):
            continue  # a successor between them serves, and is itself kept for the newest one
        successor = by_instance.get(new.name)
        if successor is None:
            # not placed: for want of GPUs, unless a successor it replaced still holds some
            # (the one a second edit replaced as it loaded), which it takes once that one is gone
            waiting = manifests.pod_name(ref, new) in placed or bool(holding & (seen - {name}))
        else:
            waiting = successor.holds_resources and not is_ready(successor)
        if waiting:
            keep.add(old.name)
    return keep


def front_services(to_zero: bool, by_prefix: bool) -> set[str]:
    """The Services the front pods read: a router finds the replicas through the headless
    `<job>-endpoints`; an activator forwards to `<job>-replicas`, which selects them always."""
    return {ENDPOINTS} if by_prefix else {REPLICAS} if to_zero else set()


async def _retire_front_services(ctx: Context, ref: manifests.JobRef, old: Mapping[str, Any],
                                 pods: Iterable[index.PodRecord], spec: Mapping[str, Any],
                                 to_zero: bool, by_prefix: bool) -> list[str]:
    """Delete the Services that front pods of earlier settings read once none of those pods is
    left, terminating ones included; returns the ones that may exist now (status.frontServices).

    A switch of policy, or out of scale to zero, replaces the front pods one at a time: until
    the last old one goes, it still forwards through its Service (with several front pods,
    deleting that Service at the edit broke every request they took meanwhile). A job whose
    status predates the field may have either. A delete of nothing is a 404; a failed one fails
    the reconcile before the status write that forgets the Service."""
    wanted = front_services(to_zero, by_prefix)
    if "frontServices" in old:
        had = set(old["frontServices"])
    else:
        had = {ENDPOINTS, REPLICAS} if "routing" in old else set()
    retiring = had - wanted
    prefix = manifests.activator_pod_name(ref)
    # with no front pod wanted, every one left is on its way out, and reads a retiring Service;
    # one terminating still does: through its grace it forwards the answers it holds and retries
    # cut ones through the Service (deleted at its deletionTimestamp, those retries could not
    # resolve a replica). One past its grace serves no one (its node stopped answering), and
    # would keep the Service until someone removed it; a resync's reconcile finds it past.
    now = time.time()
    if retiring and not any(p.name.startswith(prefix) and not p.past_grace(now)
                            and (not wanted or not front_is_current(p, spec)) for p in pods):
        names = {ENDPOINTS: manifests.endpoints_service_name(ref),
                 REPLICAS: manifests.replicas_service_name(ref)}
        await asyncio.gather(*(ctx.client.delete("Service", ref.namespace, names[s])
                               for s in sorted(retiring)))
        retiring = set()
    return sorted(wanted | retiring)


def stale_to_replace(pods: Sequence[index.PodRecord | None],
                     stale: Callable[[index.PodRecord], bool]) -> list[int]:
    """A rolling replacement's next pods (their indices): every stale one that is not ready at
    once (it serves no one: still starting, or crash-looping on the settings being replaced, and
    it would never be ready for the others to wait on), else one stale one that serves, while
    every other pod is ready (a lone pod is replaced at once)."""
    old = {i: p for i, p in enumerate(pods) if p is not None and not p.deleting and stale(p)}
    idle = [i for i, p in old.items() if not is_ready(p)]
    if idle or not old:
        return idle
    target = next(iter(old))
    others_ready = all(p is not None and is_ready(p) for i, p in enumerate(pods) if i != target)
    return [target] if others_ready else []


def _fronts_to_replace(fronts: list[index.PodRecord | None],
                       spec: Mapping[str, Any]) -> list[index.PodRecord]:
    """The front pods to delete now: every one that has ended, and the stale ones (other
    settings) a rolling replacement takes next (`stale_to_replace`)."""
    ended = [f for f in fronts if f is not None and not f.deleting and not f.holds_resources]
    rolled = stale_to_replace(fronts, lambda f: f.holds_resources and not front_is_current(f, spec))
    return [*ended, *(f for i, f in enumerate(fronts) if i in rolled and f is not None)]


def front_is_current(pod: index.PodRecord, spec: Mapping[str, Any]) -> bool:
    """Whether the activator pod runs the settings the spec asks for now. A pod from before
    the router (no hash) was a plain activator: current while the job does not route."""
    return pod.template == manifests.front_template_hash(spec) or \
        (not pod.template and not manifests.routes_by_prefix(spec))


def _roll_one(graph: Graph, ref: manifests.JobRef, pods: Mapping[str, index.PodRecord],
              templates: set[str]) -> None:
    """Replace the replicas started from an older spec that a rolling update takes next
    (`stale_to_replace`)."""
    server = graph.vertex(SERVER)
    instances = list(server.instances)
    current = [pods.get(manifests.pod_name(ref, i)) for i in instances]
    for i in stale_to_replace(current, lambda p: bool(p.template) and p.template not in templates):
        pod, name = current[i], instances[i].name
        why = "" if pod is not None and is_ready(pod) else " and is not ready"
        mutate.replace_instance(graph, name, drain=True, counted=False,
                                reason=f"rolling update: replica {name} runs an older spec (model, image, "
                                       f"resources, quantisation or env changed){why}")


async def _report_waiting(ctx: Context, body: Mapping[str, Any], base: dict[str, Any], reason: str,
                          message: str) -> str:
    old = body.get("status") or {}
    if old.get("message") != message:
        ctx.post_event(body, "Warning", reason, message)
    status = {**base, "phase": "Pending", "message": message, "conditions": conditions.build_conditions(
        old.get("conditions"), body["metadata"].get("generation"), ready=(False, reason, message),
        reconciling=(True, reason, message))}
    await write_status(ctx, body, status, PLURAL)
    ctx.metrics.record_phase(KIND, f"{body['metadata']['namespace']}/{body['metadata']['name']}", "Pending")
    return "Pending"
