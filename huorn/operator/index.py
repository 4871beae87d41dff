"""The operator's in-memory mirror of nodes, virtual clusters and Huorn pods.

Placement needs the free GPUs of every node, and asking the API for every pod on every
reconcile is quadratic in the number of jobs (1,000 jobs × 1,000 list calls). kopf's watches
already stream every change, so the operator keeps this mirror and rebuilds it from the watches
(and one listing at startup) after a restart: it holds nothing that the API objects do not.

The one thing the API cannot show yet is a placement decided a moment ago whose pods are still
being created. Those are kept as *reservations* under the same keys the pods will have, so two
jobs placed back to back never get the same GPUs; a pod's arrival replaces its reservation.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.api import base
from huorn.backends.kubernetes import manifests
from huorn.scheduler import perfmodel, placement, snapshot

TERMINAL_POD_PHASES = frozenset({"Succeeded", "Failed"})
# NVIDIA GPU feature discovery's label (GPU operator, or the device plugin's GFD): the product name
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"


@dataclass(frozen=True)
class PodRecord:
    """What one Huorn pod holds: its job, node and GPUs, and how it is doing."""

    namespace: str
    name: str
    job: str
    vertex: str
    instance: str
    node: str
    gpus: int
    cpu_milli: int
    virtual_cluster: str
    phase: str = "Pending"
    exit_code: int | None = None
    deleting: bool = False
    ip: str = ""  # status.podIP: where the monitor reads the pod's /telemetry
    message: str = ""  # the terminated container's message: an eval pod's result (JSON)
    input: dict[str, Any] | None = None  # an eval pod's checkpoint (its huorn.io/checkpoint annotation)
    created: float = 0.0  # metadata.creationTimestamp, seconds since the epoch (0: unknown)
    waiting: str = ""  # why the container is not running yet (ErrImagePull, ...), with its message
    ended: str = ""  # why the kubelet ended the pod itself (Evicted, ...), with its message
    conditions: tuple[tuple[str, str], ...] = ()  # status.conditions as (type, status): DisruptionTarget
    template: str = ""  # a serving replica's spec hash (manifests.serve_template_hash): rolled when stale
    reclaimed_by: str = ""  # the lender whose reclaim deleted it, for a job another install serves
    kind: str = "TrainingJob"  # its job's kind (the huorn.io/kind label): which reconcile it wakes
    # a terminating pod's end of grace at the latest (seconds since the epoch; 0: not terminating
    # or unknown): its deletionTimestamp (the API's is the end of its grace; KMock's the request)
    # plus the grace. A pod still there after it is on a node that no longer answers
    grace_ends: float = 0.0

    def failure(self) -> str:
        """What a Failed pod ended with, as a person would want it in a decision."""
        if self.exit_code is not None:
            return f"failed with exit code {self.exit_code}"
        return f"failed ({self.ended or 'no exit code'})"

    @property
    def job_key(self) -> tuple[str, str]:
        return (self.namespace, self.job)

    @property
    def holds_resources(self) -> bool:
        return self.phase not in TERMINAL_POD_PHASES

    @property
    def ready_condition(self) -> str:
        """The kubelet's Ready condition ("True", "False", "Unknown"; "" when it has none): a
        serving replica is Running long before its model has loaded and it turns Ready."""
        return next((status for kind, status in self.conditions if kind == "Ready"), "")

    def past_grace(self, now: float) -> bool:
        """Terminating, and its grace surely over: a pod whose node stopped answering stays in
        the API until someone removes it, and serves no one meanwhile."""
        return self.deleting and 0 < self.grace_ends < now

    def never_started(self, now: float, limit_seconds: float) -> bool:
        """Still Pending `limit_seconds` after its creation (unschedulable, image not pulled): a
        pod that may never start, while Huorn counts its GPUs as taken."""
        return self.phase == "Pending" and self.created > 0 and now - self.created > limit_seconds

    def not_started_reason(self) -> str:
        return self.waiting or "still Pending"


def _cpu_milli(text: str | None) -> int:
    return int(base.parse_quantity(text) * 1000) if text else 0


def build_pod_record(body: Mapping[str, Any]) -> PodRecord | None:
    """A record from a pod object, None for pods that are not a Huorn job's."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    if manifests.LABEL_JOB not in labels:
        return None
    annotations = meta.get("annotations") or {}
    containers = (body.get("spec") or {}).get("containers") or [{}]
    limits = (containers[0].get("resources") or {}).get("limits") or {}
    status = body.get("status") or {}
    exit_code, message, waiting = None, "", ""
    for cs in status.get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated is not None:
            exit_code = terminated.get("exitCode")
            message = str(terminated.get("message") or "")
        held = (cs.get("state") or {}).get("waiting")
        if held is not None:
            waiting = ": ".join(str(v) for v in (held.get("reason"), held.get("message")) if v)
    if not waiting:
        unscheduled = [c for c in status.get("conditions") or []
                       if c.get("type") == "PodScheduled" and c.get("status") == "False"]
        if unscheduled:
            why = unscheduled[0]
            waiting = ": ".join(str(v) for v in (why.get("reason"), why.get("message")) if v)
    return PodRecord(
        namespace=meta.get("namespace", ""),
        name=meta["name"],
        job=labels[manifests.LABEL_JOB],
        vertex=labels.get(manifests.LABEL_VERTEX, ""),
        instance=labels.get(manifests.LABEL_INSTANCE, ""),
        node=annotations.get(manifests.ANNOTATION_NODE, "") or (body.get("spec") or {}).get("nodeName", ""),
        gpus=int(annotations.get(manifests.ANNOTATION_GPUS, "0")),
        cpu_milli=_cpu_milli(limits.get("cpu")),
        virtual_cluster=annotations.get(manifests.ANNOTATION_VC, ""),
        phase=status.get("phase", "Pending"),
        exit_code=exit_code,
        deleting=bool(meta.get("deletionTimestamp")),
        ip=status.get("podIP", "") or "",
        message=message,
        input=_parse_input(annotations.get(manifests.ANNOTATION_CHECKPOINT)),
        created=parse_time(meta.get("creationTimestamp")),
        waiting=waiting,
        ended=": ".join(str(v) for v in (status.get("reason"), status.get("message")) if v),
        conditions=tuple((str(c.get("type")), str(c.get("status"))) for c in status.get("conditions") or []
                         if c.get("type")),
        template=annotations.get(manifests.ANNOTATION_TEMPLATE, ""),
        reclaimed_by=annotations.get(manifests.ANNOTATION_RECLAIMED, ""),
        kind=labels.get(manifests.LABEL_KIND, "TrainingJob"),
        grace_ends=_grace_ends(meta, body.get("spec") or {}),
    )


def requested_gpus(spec: Mapping[str, Any]) -> int:
    """The GPUs a pod's spec takes from its node, as the kubelet counts them: its containers' sum,
    or its largest init container if that is more. A request or, without one, the limit (an
    extended resource's request defaults to its limit)."""
    def of(container: Mapping[str, Any]) -> int:
        resources = container.get("resources") or {}
        for part in ("requests", "limits"):
            value = (resources.get(part) or {}).get(manifests.GPU_RESOURCE)
            if value is not None:
                try:
                    return max(0, int(base.parse_quantity(str(value))))
                except (TypeError, ValueError):
                    return 0
        return 0
    running = sum(of(c) for c in spec.get("containers") or [])
    return max([running, *(of(c) for c in spec.get("initContainers") or [])])


def slim_pod(body: dict[str, Any]) -> dict[str, Any]:
    """A listed pod reduced to what the mirror reads of it: a Huorn pod whole (observe_pod reads
    most of it); any other pod its namespace and name, and, if it requests GPUs, their count,
    its node and its phase, which is all observe_foreign_pod and resync_foreign read. The lists
    of every pod (at start-up, and every foreign_resync_seconds) keep these, not the bodies."""
    meta = body.get("metadata") or {}
    labels = meta.get("labels") or {}
    if manifests.LABEL_JOB in labels:
        return body
    slim: dict[str, Any] = {"metadata": {"namespace": meta.get("namespace", ""),
                                         "name": meta.get("name", "")}}
    spec = body.get("spec") or {}
    gpus = requested_gpus(spec)
    if gpus:
        slim["spec"] = {"nodeName": spec.get("nodeName") or "",
                        "containers": [{"resources": {"requests": {manifests.GPU_RESOURCE: str(gpus)}}}]}
        slim["status"] = {"phase": (body.get("status") or {}).get("phase", "Pending")}
    return slim


def _grace_ends(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> float:
    deleted = parse_time(meta.get("deletionTimestamp"))
    if not deleted:
        return 0.0
    grace = meta.get("deletionGracePeriodSeconds")
    if grace is None:
        grace = spec.get("terminationGracePeriodSeconds", 30)
    try:
        return deleted + max(0.0, float(grace))
    except (TypeError, ValueError):
        return deleted + 30.0


def parse_time(text: str | None) -> float:
    """An RFC 3339 time as watches give it ('...Z') or as the client's lists give it
    ('...+00:00'); 0.0 when absent or unreadable."""
    try:
        stamp = datetime.datetime.fromisoformat(str(text)) if text else None
    except ValueError:
        return 0.0
    if stamp is None:
        return 0.0
    return (stamp if stamp.tzinfo else stamp.replace(tzinfo=datetime.UTC)).timestamp()


def _parse_input(text: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


# What Huorn's pods tolerate (huorn.backends.kubernetes.manifests renders it into every pod it
# pins to a node, with the node's cluster's members.tolerations); a node with a NoSchedule or
# NoExecute taint outside them takes none of them.
POD_TOLERATIONS: tuple[Mapping[str, str], ...] = (manifests.GPU_TOLERATION,)
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})


def tolerated(taint: Mapping[str, Any], tolerations: Iterable[Mapping[str, Any]] = POD_TOLERATIONS) -> bool:
    """Whether a pod with `tolerations` may be placed where the taint is, and stay. Kubernetes
    reads each taint's first matching toleration (manifests.toleration_matches); on a NoExecute
    taint, one with tolerationSeconds evicts the pod when they run out (at once for 0), so a pod
    placed there would be replaced on the same node again and again."""
    first = next((t for t in tolerations if manifests.toleration_matches(t, taint)), None)
    if first is None:
        return False
    return taint.get("effect") != "NoExecute" or first.get("tolerationSeconds") is None


@dataclass
class NodeRecord:
    name: str
    gpus: int
    labels: dict[str, str]
    # Whether new pods must not go there: cordoned (spec.unschedulable), not Ready, or tainted
    # NoSchedule/NoExecute with a taint Huorn's pods do not tolerate. Every reader (placement,
    # a serving cluster's free GPUs, reclaim's capacity) asks the same thing, so it is one flag;
    # the pods already there stay counted as holding their GPUs.
    unschedulable: bool = False
    unavailable: str = ""  # why, for status and messages: "cordoned", "not Ready (Unknown)", a taint
    # What no toleration helps with ("cordoned", "not Ready (...)"), and the NoSchedule/NoExecute
    # taints the node lists: with its owner's tolerations (VirtualCluster members.tolerations),
    # they decide the two fields above (judge), again whenever the owner or its tolerations change.
    down: str = ""
    taints: tuple[Mapping[str, Any], ...] = ()

    @property
    def why(self) -> str:
        return self.unavailable or ("cordoned" if self.unschedulable else "")

    def judge(self, tolerations: Iterable[Mapping[str, Any]] = ()) -> None:
        """Whether new pods may go there, for pods that carry `tolerations` beside Huorn's own."""
        tolerations = manifests.pod_tolerations(list(tolerations))  # what the pods will carry
        blocking = next((t for t in self.taints if not tolerated(t, tolerations)), None)
        why = self.down or (f"taint {blocking.get('key')}:{blocking.get('effect')}" if blocking else "")
        self.unschedulable, self.unavailable = bool(why), why

    def cordon(self) -> None:
        """What the node watch will say shortly after Huorn cordons it (huorn.operator.cordon)."""
        self.down = "cordoned"
        self.judge()


def _down(spec: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    """Why no new pod may go to the node whatever it tolerates, '' when none. A node without a
    Ready condition (one registered a moment ago, or one a test builds) counts as Ready: the
    kubelet reports the condition, and only a report of anything but True says the node does
    not run pods."""
    if spec.get("unschedulable"):
        return "cordoned"
    for c in status.get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") != "True":
            reason = ": ".join(str(v) for v in (c.get("status"), c.get("reason")) if v)
            return f"not Ready ({reason or 'no status'})"
    return ""


def build_node_record(body: Mapping[str, Any]) -> NodeRecord:
    """The node as placement sees it, judged for pods that carry Huorn's own tolerations alone
    (ClusterIndex.observe_node judges it again with its owner's)."""
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    spec = body.get("spec") or {}
    allocatable = status.get("allocatable") or status.get("capacity") or {}
    record = NodeRecord(
        name=meta["name"],
        gpus=int(allocatable.get(manifests.GPU_RESOURCE, 0) or 0),
        labels=dict(meta.get("labels") or {}),
        down=_down(spec, status),
        taints=tuple(dict(t) for t in spec.get("taints") or [] if t.get("effect") in BLOCKING_EFFECTS),
    )
    record.judge()
    return record


@dataclass
class ClusterIndex:
    nodes: dict[str, NodeRecord] = field(default_factory=dict)
    vcs: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> spec (wire form)
    # name -> metadata.creationTimestamp (seconds): the oldest cluster owns a node two select
    vc_created: dict[str, float] = field(default_factory=dict)
    pods: dict[tuple[str, str], PodRecord] = field(default_factory=dict)
    reservations: dict[tuple[str, str], PodRecord] = field(default_factory=dict)
    # InferenceJobs' GPUs ((desired + surging replicas) × GPUs each), by job: what their cluster
    # keeps unlent
    inference_demand: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)
    # The prediction board's GPUs by inference cluster (huorn.operator.board), where it has one
    forecast_demand: dict[str, int] = field(default_factory=dict)
    # GPUs a training lender keeps unlent while its own jobs wait for them (loans.reserve_for_line)
    line_reserve: dict[str, int] = field(default_factory=dict)
    # Of those, the GPUs of its waiting jobs that select nodes, kept on the nodes they select
    # (build_snapshot's `kept`): (job, nodeSelector, GPUs, what its pods held then); the
    # InferenceJobs' nodeSelectors, by job
    line_kept: dict[str, list[tuple[tuple[str, str], Mapping[str, str], int, int]]] = field(
        default_factory=dict)
    demand_selector: dict[tuple[str, str], Mapping[str, str]] = field(default_factory=dict)
    # GPUs that pods of other controllers (Kueue, notebooks, a DaemonSet) hold on a node, by pod:
    # (node, GPUs) of each one bound to a node, not ended, that requests any (observe_foreign_pod)
    foreign: dict[tuple[str, str], tuple[str, int]] = field(default_factory=dict)
    # When the watch last wrote each foreign record, in observations, its end included (a key
    # with no record): resync_foreign keeps what the watch wrote after its list began
    foreign_seen: dict[tuple[str, str], int] = field(default_factory=dict)
    # When each pod record was last written, in observations (see resync_pods)
    seen: dict[tuple[str, str], int] = field(default_factory=dict)
    observations: int = 0
    # The namespaces the operator serves (`--namespace`; empty: all), set with Context.serve_only
    served: frozenset[str] = frozenset()

    def serves_all_of(self, vc: str) -> bool:
        """Whether this install serves every namespace that may use `vc` (spec.namespaces; empty
        means all, so only an install that serves all of them): only then does it see all of
        the cluster's jobs. Only then may it place borrowers on `vc`'s GPUs: another install's
        jobs there (its InferenceJobs, say) would need GPUs back that this one never hears of
        in time, its watches seeing only its own namespaces, and a borrower placed here would be
        shrunk or stopped by an install that does not serve it, racing this one's reconciles of
        it. And only then does it write the cluster's waiting line into its status."""
        if not self.served:
            return True
        allowed = (self.vcs.get(vc) or {}).get("namespaces") or []
        return bool(allowed) and set(allowed) <= self.served

    # ----------------------------------------------------------------- updates from watches
    def observe_node(self, body: Mapping[str, Any]) -> NodeRecord:
        """Record the node, judged for the pods its owner's tolerations let go there."""
        record = build_node_record(body)
        record.judge(self.tolerations_on(record))
        self.nodes[record.name] = record
        return record

    def observe_vc(self, body: Mapping[str, Any], judge: bool = True) -> list[str]:
        """Record the cluster; returns the nodes that take new pods now and did not before (its
        tolerations, or the nodes it selects, changed). Without `judge` the caller judges the
        nodes once after recording several (judge_nodes), as the operator's start-up does."""
        meta = body.get("metadata") or {}
        spec, created = dict(body.get("spec") or {}), parse_time(meta.get("creationTimestamp"))
        if self.vcs.get(meta["name"]) == spec and self.vc_created.get(meta["name"]) == created:
            # most events are the cluster's own status writes: judging every node again for
            # each of them cost 143 ms at 4,000 nodes and 50 clusters
            return []
        self.vcs[meta["name"]], self.vc_created[meta["name"]] = spec, created
        return self.judge_nodes() if judge else []

    def forget_vc(self, name: str) -> list[str]:
        self.vcs.pop(name, None)
        self.vc_created.pop(name, None)
        self.line_reserve.pop(name, None)
        self.line_kept.pop(name, None)
        return self.judge_nodes()

    def tolerations_on(self, node: NodeRecord | str) -> list[dict[str, Any]]:
        """The tolerations Huorn's pods carry on `node` beside their own: its owner's
        members.tolerations (a borrower's pods on a lent node too); [] for a node no cluster owns."""
        record = self.nodes.get(node) if isinstance(node, str) else node
        return self._tolerations_of(self.virtual_cluster_of(record) if record is not None else "")

    def _tolerations_of(self, vc: str) -> list[dict[str, Any]]:
        return [dict(t) for t in ((self.vcs.get(vc) or {}).get("members") or {}).get("tolerations") or []]

    def judge_nodes(self) -> list[str]:
        """Judge every node with its owner's tolerations; returns those that take new pods now
        and did not before. The clusters are ordered once, not once a node (4,000 nodes and 50
        clusters took 143 ms so)."""
        owners = self.owners()
        opened = []
        for record in self.nodes.values():
            before = record.unschedulable
            record.judge(self._tolerations_of(owners[record.name]))
            if before and not record.unschedulable:
                opened.append(record.name)
        return opened

    def observe_inference_job(self, body: Mapping[str, Any], deleted: bool = False) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        spec = body.get("spec") or {}
        # A job the operator refuses (Stalled: an invalid spec, a namesake) or will refuse (its
        # namespace is not one the cluster admits) places no replica: counted as demand, it made
        # its cluster preempt other teams' borrowers, and lend nothing, for replicas that never come.
        admits = (self.vcs.get(str(spec.get("virtualCluster"))) or {}).get("namespaces") or []
        if (deleted or not spec.get("virtualCluster") or (admits and key[0] not in admits)
                or (body.get("status") or {}).get("phase") == "Stalled"):
            self.inference_demand.pop(key, None)
            self.demand_selector.pop(key, None)
            return
        try:
            # The autoscaler's count once it has one (status.desiredReplicas), the floor before:
            # the replicas the job asks for are what the cluster must not lend.
            desired = (body.get("status") or {}).get("desiredReplicas")
            floor = max(1, int((spec.get("autoscaling") or {}).get("minReplicas", 1)))
            replicas = int(desired) if desired is not None else floor
            # and those a rolling update keeps serving beside their successors (serving.surging):
            # their GPUs are held, and another job's waiting replica must still be reclaimed for
            replicas += int((body.get("status") or {}).get("surgingReplicas") or 0)
            gpus = int((spec.get("resources") or {}).get("gpus", 1))
        except (TypeError, ValueError):
            self.inference_demand.pop(key, None)  # invalid: its reconcile reports it, it holds nothing
            self.demand_selector.pop(key, None)
            return
        self.inference_demand[key] = (str(spec["virtualCluster"]), max(0, replicas) * max(0, gpus))
        if isinstance(spec.get("nodeSelector"), Mapping) and spec["nodeSelector"]:
            self.demand_selector[key] = dict(spec["nodeSelector"])
        else:
            self.demand_selector.pop(key, None)

    def floors_of(self, vc: str, selecting: bool | None = None) -> int:
        """The GPUs `vc`'s InferenceJobs ask for: of those that select nodes only (`selecting`
        True), of the others only (False), or of all. One that selects nodes asks for no more
        than they hold: a selector no node of the cluster matches kept GPUs unlent for replicas
        that could never be placed."""
        total = 0
        for key, (cluster, gpus) in self.inference_demand.items():
            selector = self.demand_selector.get(key)
            if cluster != vc or (selecting is not None and (selector is not None) != selecting):
                continue
            if selector is not None:
                room = sum(n.gpus for n in self.selected_members(vc, selector) if not n.unschedulable)
                gpus = min(gpus, room)
            total += gpus
        return total

    def held_by(self, job: tuple[str, str], leaving: bool = True) -> int:
        """GPUs the pods (and reservations) of one job hold."""
        return sum(p.gpus for p in self._holders(leaving) if p.job_key == job)

    def kept_on_nodes(self, leaving: bool = True, owner: Mapping[str, str] | None = None) -> dict[str, int]:
        """Free GPUs each node keeps for its own cluster's waiting jobs that select it (NodeView.kept):
        a training lender's line (line_kept) and the InferenceJobs with a nodeSelector whose
        pods hold less than they ask for. Each need takes the free GPUs of the nodes it selects,
        the freest first: a borrower may not land there, so GPUs a reclaim frees for the job stay
        free until it is placed, where a count over the whole cluster let the borrower's successor
        take them back."""
        if not self.line_kept and not self.demand_selector:
            return {}  # no job selects nodes: nothing to keep, at no cost to a large cluster
        owner = owner if owner is not None else self.owners()
        free = {n.name: n.gpus for n in self.nodes.values() if not n.unschedulable}
        held_by_job: dict[tuple[str, str], int] = {}
        for p in self._holders(leaving):
            if p.node in free:
                free[p.node] -= p.gpus
            held_by_job[p.job_key] = held_by_job.get(p.job_key, 0) + p.gpus
        for node, gpus in self.held_by_others(leaving).items():
            if node in free:
                free[node] -= gpus
        # a line job's need shrinks by what its pods came to hold since (placed, it holds them
        # all): kept on until the lender's next pass, it moved to another selected node for up to
        # a tick after the job was placed
        needs = [(vc, selector, gpus - max(0, held_by_job.get(key, 0) - then))
                 for vc, kept in self.line_kept.items() for key, selector, gpus, then in kept]
        needs += [(vc, self.demand_selector[key], gpus - held_by_job.get(key, 0))
                  for key, (vc, gpus) in self.inference_demand.items() if key in self.demand_selector]
        kept: dict[str, int] = {}
        for vc, selector, gpus in needs:
            nodes = [name for name in free
                     if owner.get(name) == vc and placement.labels_match(self.nodes[name].labels, selector)]
            for name in sorted(nodes, key=lambda n: (-(free[n] - kept.get(n, 0)), n)):
                take = min(gpus, max(0, free[name] - kept.get(name, 0)))
                if take <= 0:
                    break
                kept[name] = kept.get(name, 0) + take
                gpus -= take
        return kept

    def demand_of(self, vc: str) -> int:
        """What an inference cluster keeps unlent: its InferenceJobs' desired replicas' GPUs, or
        its forecast request rate's GPUs where that is more (the replicas hold even when the
        rate is idle)."""
        return max(self.floors_of(vc), self.forecast_demand.get(vc, 0))

    def unmet_demand(self, vc: str, own: int, others: int, selecting: bool | None = None,
                     own_floors: int | None = None) -> int:
        """GPUs `vc`'s demand still lacks: `own` is what its own Huorn pods hold on its nodes,
        `others` what other controllers' pods hold there (others_held). Its InferenceJobs'
        floors are met by their pods alone; the forecast counts the whole service's load, so
        the pods of a serving stack Huorn does not run (vLLM, Triton) meet it too: counted only
        as taken, their GPUs were reserved a second time, nothing was lent, and a rising
        forecast reclaimed what they already served. `selecting`: the floors of the InferenceJobs
        with a nodeSelector only, or of the others only (floors_of), `own_floors` what those
        jobs' pods hold (default `own`); the forecast is met by all of `own`."""
        floors_met = own if own_floors is None else own_floors
        forecast = self.forecast_demand.get(vc, 0)
        return max(0, self.floors_of(vc, selecting) - floors_met, forecast - own - others)

    def others_held(self, leaving: bool = True) -> dict[str, int]:
        """GPUs other controllers' pods hold on each cluster's own nodes (held_by_others)."""
        owner = self.owners()
        out: dict[str, int] = {}
        for node, gpus in self.held_by_others(leaving).items():
            if owner.get(node):
                out[owner[node]] = out.get(owner[node], 0) + gpus
        return out

    def observe_pod(self, body: Mapping[str, Any], deleted: bool = False) -> PodRecord | None:
        record = build_pod_record(body)
        if record is None:
            return None
        key = (record.namespace, record.name)
        self.reservations.pop(key, None)
        self.observations += 1
        if deleted:
            self.pods.pop(key, None)
            self.seen.pop(key, None)
        else:
            self.pods[key] = record
            self.seen[key] = self.observations
        return record

    def observe_foreign_pod(self, body: Mapping[str, Any], deleted: bool = False) -> bool:
        """Record the GPUs a pod Huorn does not manage holds on its node; returns whether it
        gave GPUs back (deleted, or ended), which may let a waiting job start."""
        meta = body.get("metadata") or {}
        if manifests.LABEL_JOB in (meta.get("labels") or {}):
            return False
        key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
        spec = body.get("spec") or {}
        node, gpus = str(spec.get("nodeName") or ""), requested_gpus(spec)
        if not gpus:
            return self.foreign.pop(key, None) is not None  # a pod's requests never change
        self.observations += 1
        self.foreign_seen[key] = self.observations  # its end too, so a list older than it can't undo it
        phase = (body.get("status") or {}).get("phase", "Pending")
        if deleted or not node or phase in TERMINAL_POD_PHASES:
            return self.foreign.pop(key, None) is not None
        self.foreign[key] = (node, gpus)
        return False

    def resync_foreign(self, listed: Iterable[Mapping[str, Any]], mark: int) -> list[tuple[str, str]]:
        """Bring the foreign records in line with a list of every pod (those of the namespaces
        served) that began when `observations` was `mark`; returns the keys whose GPUs it
        dropped. A watch that reconnects reports no pod deleted while it was away, so without
        this such a pod's GPUs stayed taken until the operator restarted. What the watch wrote
        after the list began (a record, or a pod's end) is newer than the list and stays."""
        listed_keys, dropped = set(), []
        for body in listed:
            meta = body.get("metadata") or {}
            if manifests.LABEL_JOB in (meta.get("labels") or {}):
                continue
            key = (str(meta.get("namespace", "")), str(meta.get("name", "")))
            listed_keys.add(key)
            if self.foreign_seen.get(key, -1) > mark:
                continue
            spec = body.get("spec") or {}
            node, gpus = str(spec.get("nodeName") or ""), requested_gpus(spec)
            phase = (body.get("status") or {}).get("phase", "Pending")
            if node and gpus and phase not in TERMINAL_POD_PHASES:
                self.foreign[key] = (node, gpus)
            elif self.foreign.pop(key, None) is not None:
                dropped.append(key)  # ended, the watch having missed it
        gone = [key for key in self.foreign
                if key not in listed_keys and self.foreign_seen.get(key, -1) <= mark]
        for key in gone:
            self.foreign.pop(key)
        dropped += gone
        # What the watch wrote before the list is what the list now says: only newer marks matter
        self.foreign_seen = {key: seen for key, seen in self.foreign_seen.items() if seen > mark}
        return dropped

    def foreign_gpus(self) -> dict[str, int]:
        """GPUs other controllers' pods hold, by node."""
        held: dict[str, int] = {}
        for node, gpus in self.foreign.values():
            held[node] = held.get(node, 0) + gpus
        return held

    def held_by_others(self, leaving: bool = True) -> dict[str, int]:
        """Other controllers' GPUs by node, within what Huorn's own pods there leave: a node whose
        pods of both kinds add up to more than it has (one placed before this was counted) keeps
        every Huorn pod bound to its job in a snapshot, and simply shows nothing free."""
        ours: dict[str, int] = {}
        for p in self._holders(leaving):
            ours[p.node] = ours.get(p.node, 0) + p.gpus
        return {node: min(gpus, max(0, self.nodes[node].gpus - ours.get(node, 0)))
                for node, gpus in self.foreign_gpus().items() if node in self.nodes}

    def resync_pods(self, listed: Iterable[Mapping[str, Any]], mark: int) -> list[PodRecord]:
        """Bring the mirror in line with a list of every Huorn pod that began when
        `observations` was `mark`; returns the records dropped. A record the watch wrote after
        the list began is newer than the list and stays as it is."""
        fresh = set()
        for body in listed:
            record = build_pod_record(body)
            if record is None:
                continue
            key = (record.namespace, record.name)
            fresh.add(key)
            if self.seen.get(key, -1) <= mark:
                self.observe_pod(body)
        stale = [key for key in self.pods if key not in fresh and self.seen.get(key, -1) <= mark]
        dropped = [self.pods.pop(key) for key in stale]
        for key in stale:
            self.seen.pop(key, None)
        return dropped

    def reserve(self, records: Iterable[PodRecord]) -> None:
        for r in records:
            if (r.namespace, r.name) not in self.pods:
                self.reservations[(r.namespace, r.name)] = r

    def release(self, records: Iterable[PodRecord]) -> None:
        for r in records:
            self.reservations.pop((r.namespace, r.name), None)

    # ----------------------------------------------------------------- reading
    def pods_of(self, namespace: str, job: str) -> list[PodRecord]:
        return [p for (ns, _), p in self.pods.items() if ns == namespace and p.job == job]

    def creating(self, namespace: str, job: str) -> set[str]:
        """Names of the job's pods that a placement reserved and whose arrival the watch has not
        reported yet. A reconcile counts them as placed: before, one that ran in that window saw
        its gang missing while the snapshot held its GPUs, found the cluster full, and preempted
        another job for GPUs it already had."""
        return {r.name for (ns, _), r in self.reservations.items() if ns == namespace and r.job == job}

    def _by_age(self) -> list[str]:
        """Virtual clusters oldest first (ties, and clusters of unknown age last, by name)."""
        return sorted(self.vcs, key=lambda name: (self.vc_created.get(name) or float("inf"), name))

    def _selects(self, vc: str, node: NodeRecord) -> bool:
        members = self.vcs[vc].get("members") or {}
        if node.name in (members.get("nodes") or []):
            return True
        selector = ((members.get("nodeSelector") or {}).get("matchLabels")) or None
        return bool(selector) and placement.labels_match(node.labels, selector)

    def claimants(self, node: NodeRecord) -> list[str]:
        """Every virtual cluster that lists the node or selects it, its owner first."""
        return [vc for vc in self._by_age() if self._selects(vc, node)]

    def virtual_cluster_of(self, node: NodeRecord) -> str:
        """The oldest virtual cluster (by metadata.creationTimestamp, ties by name) that lists
        the node or selects it; '' for none. By age, not by name: before, a cluster created
        later with a name sorting first took the nodes of a running one."""
        return next(iter(self.claimants(node)), "")

    def owners(self) -> dict[str, str]:
        """Every node's owner (virtual_cluster_of, '' for none), the clusters ordered once for all
        nodes rather than once a node."""
        order = self._by_age()
        return {n.name: next((vc for vc in order if self._selects(vc, n)), "") for n in self.nodes.values()}

    def claimed_from(self, vc: str) -> dict[str, list[str]]:
        """The nodes `vc` lists or selects that an older cluster owns, by that cluster."""
        lost: dict[str, list[str]] = {}
        if vc not in self.vcs:
            return lost
        for node in sorted(self.nodes.values(), key=lambda n: n.name):
            if self._selects(vc, node):
                owner = self.virtual_cluster_of(node)
                if owner != vc:
                    lost.setdefault(owner, []).append(node.name)
        return lost

    def members_of(self, vc: str) -> list[NodeRecord]:
        owners = self.owners()
        return [n for n in self.nodes.values() if owners[n.name] == vc]

    def selected_members(self, vc: str, node_selector: Mapping[str, str] | None) -> list[NodeRecord]:
        """`vc`'s member nodes that carry every label of a job's nodeSelector (None: all of them)."""
        return [n for n in self.members_of(vc) if placement.labels_match(n.labels, node_selector)]

    def gpu_type(self, vc: str, node_selector: Mapping[str, str] | None = None) -> str:
        """The GPU type (a `perfmodel.GPU_SPEED` key) of most of `vc`'s GPUs, read from GPU feature
        discovery's product label; "" where no member node names a known one (the performance
        model's prior then assumes an H200). With a job's `node_selector`, of the nodes it
        admits: a job that selects one product on a cluster of mixed GPUs is priced at it."""
        counts: dict[str, int] = {}
        for node in self.selected_members(vc, node_selector):
            kind = perfmodel.gpu_type_of(node.labels.get(GPU_PRODUCT_LABEL, ""))
            if kind and node.gpus:
                counts[kind] = counts.get(kind, 0) + node.gpus
        return max(sorted(counts), key=lambda k: counts[k], default="")

    def _holders(self, leaving: bool = True) -> list[PodRecord]:
        held = [p for p in self.pods.values() if p.holds_resources and p.gpus and (leaving or not p.deleting)]
        return held + [r for r in self.reservations.values() if r.gpus]

    def build_snapshot(self, leaving: bool = True) -> snapshot.ClusterSnapshot:
        """A scheduler snapshot with every pod and reservation already assumed, per job. Without
        `leaving`, pods being deleted are left out: the cluster as it will be once they are gone,
        which is what preemption plans against (huorn.operator.training.plan_preemption)."""
        owner = self.owners()
        others = self.held_by_others(leaving)
        kept = self.kept_on_nodes(leaving, owner)
        views = [
            placement.NodeView(
                name=n.name,
                gpus_total=n.gpus,
                gpus_free=n.gpus - others.get(n.name, 0),
                labels=n.labels,
                virtual_cluster=owner[n.name],
                cordoned=n.unschedulable,
                unavailable=n.why,
                kept=kept.get(n.name, 0),
            )
            for n in self.nodes.values()
        ]
        held: dict[str, int] = {}
        for p in self._holders(leaving):  # what each cluster's own workloads hold on its own nodes
            if p.node in owner and owner[p.node] == p.virtual_cluster:
                held[p.virtual_cluster] = held.get(p.virtual_cluster, 0) + p.gpus
        others = self.others_held(leaving)
        vcs = [dataclasses.replace(build_vc_view(name, spec),
                                   reserved_gpus=self.unmet_demand(name, held.get(name, 0),
                                                                   others.get(name, 0))
                                   + self.line_reserve.get(name, 0),
                                   **({} if self.serves_all_of(name) else {"lendable": False}))
               for name, spec in self.vcs.items()]
        snap = snapshot.ClusterSnapshot(views, vcs)
        by_job: dict[tuple[str, str, str], list[str]] = {}
        gpus_of: dict[tuple[str, str, str], int] = {}
        for p in self._holders(leaving):
            if p.node not in self.nodes:
                continue
            # A pod keeps its cluster's name after that VirtualCluster is deleted: bound with none,
            # its GPUs on another cluster's node were no longer lent, and that lender then lent
            # them again past its maxGPUsLent while the pod still ran (snapshot.ClusterSnapshot._apply).
            key = (p.namespace, p.job, p.virtual_cluster)
            by_job.setdefault(key, []).extend([p.node] * p.gpus)
            gpus_of[key] = 1
        for (ns, job, vc), gpu_nodes in by_job.items():
            # One binding per job, one "replica" per GPU: pods of a job may differ in GPUs.
            try:
                snap.assume(f"{ns}/{job}", vc, placement.Placement(gpu_nodes), gpus_per_replica=1)
            except ValueError:
                # A node shrank under running pods (a GPU went bad): the pods still run, the
                # node simply has nothing free, which the snapshot already shows.
                continue
        snap.commit()
        return snap


def build_vc_view(name: str, spec: Mapping[str, Any]) -> snapshot.VirtualClusterView:
    lending = spec.get("lending") or {}
    borrowing = spec.get("borrowing") or {}
    return snapshot.VirtualClusterView(
        name=name,
        purpose=spec.get("purpose", "training"),
        lendable=bool(lending.get("lendable", False)),
        max_gpus_lent=int(lending.get("maxGPUsLent", 0)),
        max_gpus_borrowed=int(borrowing.get("maxGPUsBorrowed", 0)),
        reclaim_grace_seconds=float(lending.get("reclaimGraceSeconds", 30)),
    )
