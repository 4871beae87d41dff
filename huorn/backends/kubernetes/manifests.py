"""The Kubernetes objects of a job's graph, as plain dicts (no API calls here).

One pod per graph instance, named `<job>-<instance>` so that the name alone says which vertex
and generation it is: a replaced instance gets a new generation and therefore a new pod name,
and a stale pod can never be taken for its successor. Trainer pods are pinned to the node that
Huorn's gang placement chose (required node affinity on the hostname), because the default
scheduler knows nothing of gangs, virtual clusters or loans. The rendezvous store runs in its
own pod behind a headless Service (the graph's `rendezvous` vertex): measured on torch 2.13, the
agent that hosts the c10d store is a single point of failure, so no trainer hosts it.

The commands come from the runtime's launcher (huorn/runtime/launcher.py, docs/runtime.md), the
one runtime module the control plane may import, so a pod and a local replica run the same line:
a torchrun agent, or the trainer itself when the job resizes in place (spec.elasticity.resize).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from huorn.api import inference, training
from huorn.graph import jobs, mutate
from huorn.graph.model import Graph, Instance
from huorn.runtime import launcher

MANAGED_BY = "huorn"
LABEL_JOB = "huorn.io/job"
LABEL_KIND = "huorn.io/kind"
LABEL_VERTEX = "huorn.io/vertex"
LABEL_INSTANCE = "huorn.io/instance"
ANNOTATION_NODE = "huorn.io/node"
ANNOTATION_GPUS = "huorn.io/gpus"
ANNOTATION_VC = "huorn.io/virtual-cluster"
# On an eval pod: the checkpoint its edge handed it (JSON), which the monitor compares with the
# newest one when the pod ends (re-run on a newer checkpoint, as the OnDemandManager decides).
ANNOTATION_CHECKPOINT = "huorn.io/checkpoint"
# On a trainer pod a lender's reclaim deleted for a job another install serves (operator.loans):
# the lender. Its owner replaces it as a preemption, not a failure of the job's.
ANNOTATION_RECLAIMED = "huorn.io/reclaimed-by"
TERMINATION_LOG = "/dev/termination-log"
GPU_RESOURCE = "nvidia.com/gpu"
HOSTNAME_LABEL = "kubernetes.io/hostname"
CONFIG_DIR = "/etc/huorn"
CONFIG_FILE = "config.json"
# huorn.runtime.microbatches.CONTROL_FILE, as a key of the job's ConfigMap (remediation S2's counts)
MICROBATCHES_KEY = "microbatches.json"
# huorn.runtime.batch_control.CONTROL_FILE: the goodput allocator's global batch (batchRule goodput)
BATCH_KEY = "batch.json"
RUN_DIR = "/var/run/huorn"
STORE_PORT = 29400
TELEMETRY_PORT = 9400


@dataclass(frozen=True)
class JobRef:
    """The owning custom resource: what every child's labels and ownerReference point at."""

    kind: str
    name: str
    namespace: str
    uid: str
    api_version: str = "huorn.io/v1alpha1"

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> JobRef:
        meta = body["metadata"]
        return cls(body["kind"], meta["name"], meta["namespace"], meta.get("uid", ""), body["apiVersion"])

    @property
    def labels(self) -> dict[str, str]:
        return {LABEL_JOB: self.name, LABEL_KIND: self.kind, "app.kubernetes.io/managed-by": MANAGED_BY}

    @property
    def owner_reference(self) -> dict[str, Any]:
        # controller=true lets `kubectl get pods -o wide` and the garbage collector of a real
        # cluster find the job; blockOwnerDeletion keeps a foreground delete waiting for pods.
        return {
            "apiVersion": self.api_version,
            "kind": self.kind,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


AGENT_SHUTDOWN_SECONDS = 86400  # the longest grace the operator deletes a trainer pod with


def pod_name(job: JobRef, instance: Instance) -> str:
    return f"{job.name}-{instance.name}"


def store_service_name(job: JobRef) -> str:
    return f"{job.name}-rdzv"


def config_map_name(job: JobRef) -> str:
    return f"{job.name}-config"


def rendezvous_endpoint(job: JobRef) -> str:
    return f"{store_service_name(job)}.{job.namespace}.svc:{STORE_PORT}"


def job_metadata(job: JobRef, name: str, extra_labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": job.namespace,
        "labels": {**job.labels, **(extra_labels or {})},
        "ownerReferences": [job.owner_reference],
    }


def job_pod_metadata(spec: Mapping[str, Any]) -> dict[str, Any]:
    """spec.podMetadata as it bears on pods: its non-empty maps. `podMetadata: {}` or `labels: {}`
    (a wrapper chart's empty default) render the same pods as no podMetadata, and must neither
    roll a serving replica nor restart a gang."""
    return {k: dict(v) for k, v in (spec.get("podMetadata") or {}).items() if v}


def pod_metadata(job: JobRef, name: str, spec: Mapping[str, Any], extra_labels: Mapping[str, str],
                 annotations: Mapping[str, str]) -> dict[str, Any]:
    """A pod's metadata: the job's spec.podMetadata under Huorn's own labels and annotations,
    which win. The model refuses a job's key among them; winning here too keeps the operator's
    selectors (app.kubernetes.io/managed-by, huorn.io/job) whole whatever a stored spec holds."""
    metadata = job_metadata(job, name, extra_labels)
    own = job_pod_metadata(spec)
    metadata["labels"] = {**(own.get("labels") or {}), **metadata["labels"]}
    metadata["annotations"] = {**(own.get("annotations") or {}), **annotations}
    return metadata


def build_run_config(job: JobRef, spec: Mapping[str, Any],
                     stage_layers: list[int] | None = None) -> dict[str, Any]:
    """The runtime's resolved config (huorn.runtime.config.RunConfig, camelCase on the wire);
    `stage_layers` is remediation S3's split, which the trainer reads only when it starts."""
    config: dict[str, Any] = {
        "jobName": job.name,
        "spec": dict(spec),
        "runDir": RUN_DIR,
        "controlDir": CONFIG_DIR,
        "telemetryHost": "0.0.0.0",
        "telemetryPort": TELEMETRY_PORT,
    }
    if stage_layers:
        config["stageLayers"] = [int(n) for n in stage_layers]
    # A pod with GPUs must train on them: "auto" would fall back to the CPU, unnoticed, in an
    # image whose torch is a CPU-only build; "cuda" makes the trainer fail at start instead.
    if int((spec.get("resources") or {}).get("gpus", 1)) > 0:
        config["device"] = "cuda"
    return config


@dataclass(frozen=True)
class MicroBatchControl:
    """Remediation S2's per-rank micro-batch counts, as the trainer reads them from its control
    directory; `version` is the graph version of the set-param that chose them."""

    counts: tuple[int, ...]
    reason: str
    version: int


# The version of a value whose set-param neither the log nor a stamp holds any more (one set by
# an operator from before the stamps): a constant, not the graph's version, which every later
# mutation moves, and which rolled an S3 split again after each of them.
UNKNOWN_VERSION = -1


def micro_batch_control(graph: Graph) -> MicroBatchControl | None:
    """The trainer's current `microbatches` parameter, with the reason and version of the
    set-param that set it (mutate.param_setting: the log, else the stamp beside the value; the
    graph's version only for a value set without one, whose set-param the log no longer holds)."""
    counts = graph.vertex("trainer").params.get("microbatches")
    if not counts:
        return None
    version, reason = mutate.param_setting(graph, "trainer", "microbatches") or (UNKNOWN_VERSION, "")
    return MicroBatchControl(tuple(int(c) for c in counts), reason, version)


@dataclass(frozen=True)
class BatchControl:
    """The goodput allocator's global batch for the trainers (the trainer vertex's `batch`
    parameter), with the set-param that chose it."""

    global_batch: int
    reason: str
    version: int


def batch_control(graph: Graph) -> BatchControl | None:
    """The trainer's current `batch` parameter with the set-param that set it (as for
    `micro_batch_control`); None while the allocator has chosen none (the spec's globalBatch)."""
    batch = graph.vertex("trainer").params.get("batch")
    if not batch:
        return None
    version, reason = mutate.param_setting(graph, "trainer", "batch") or (UNKNOWN_VERSION, "")
    return BatchControl(int(batch), reason, version)


def control_version(control: MicroBatchControl | None, batch: BatchControl | None) -> int | None:
    """The newest set-param of what the ConfigMap carries at run time (S2's counts, the batch):
    status.controlVersion, so the ConfigMap is written again once either changes."""
    versions = [c.version for c in (control, batch) if c is not None]
    return max(versions) if versions else None


@dataclass(frozen=True)
class StageSplit:
    """Remediation S3's layers per pipeline stage; `version` is the graph version of the
    set-param that chose them, which status.resplitVersion records once the gang was rolled."""

    layers: tuple[int, ...]
    reason: str
    version: int


def stage_split(graph: Graph) -> StageSplit | None:
    """The trainer's current `stageLayers` parameter with the set-param that set it (as for
    `micro_batch_control`). A version that moved with every mutation would roll the gang again
    each time (training._plan_resplit)."""
    layers = graph.vertex("trainer").params.get("stageLayers")
    if not layers:
        return None
    version, reason = mutate.param_setting(graph, "trainer", "stageLayers") or (UNKNOWN_VERSION, "")
    return StageSplit(tuple(int(n) for n in layers), reason, version)


def build_config_map(job: JobRef, spec: Mapping[str, Any],
                     control: MicroBatchControl | None = None,
                     split: StageSplit | None = None,
                     batch: BatchControl | None = None) -> dict[str, Any]:
    """The run config, S2's counts and the goodput allocator's batch when there are any. NB: the
    pods mount this ConfigMap
    as a volume (no subPath), so the kubelet swaps in an update atomically within its sync
    period (about a minute), and the trainer applies it at the next step boundary: that is how
    a rebalance reaches a running gang without a restart. S3's split is part of the run config,
    which a trainer reads only at start: the operator rolls the gang to apply it."""
    config = build_run_config(job, spec, list(split.layers) if split is not None else None)
    data = {CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True)}
    if control is not None:
        data[MICROBATCHES_KEY] = json.dumps(
            {"counts": list(control.counts), "reason": control.reason, "version": control.version}) + "\n"
    if batch is not None:
        data[BATCH_KEY] = json.dumps(
            {"globalBatch": batch.global_batch, "reason": batch.reason, "version": batch.version}) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": job_metadata(job, config_map_name(job)),
        "data": data,
    }


def build_service(job: JobRef, name: str, vertex: str, port: tuple[str, int, int],
                  **spec: Any) -> dict[str, Any]:
    """A Service in front of one vertex's pods; `port` is (name, port, targetPort)."""
    port_name, number, target = port
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": job_metadata(job, name),
        "spec": {
            **spec,
            "selector": {LABEL_JOB: job.name, LABEL_VERTEX: vertex},
            "ports": [{"name": port_name, "port": number, "targetPort": target, "protocol": "TCP"}],
        },
    }


def build_store_service(job: JobRef) -> dict[str, Any]:
    """Headless: the agents resolve the store pod's own IP, with no kube-proxy hop to fail over."""
    return build_service(job, store_service_name(job), "rendezvous", ("c10d", STORE_PORT, STORE_PORT),
                    clusterIP="None", publishNotReadyAddresses=True)


def _elastic_settings(job: JobRef, graph: Graph, nproc_per_node: int) -> launcher.ElasticSettings:
    """The gang's rendezvous settings as a pod sees them: the store behind its Service, and the
    job's uid as the rendezvous id (a re-created job of the same name never meets the old one).
    No local address: the rendezvous names a pod by its own hostname, unique per pod."""
    trainer = graph.vertex("trainer")
    return launcher.ElasticSettings(
        min_nodes=trainer.min_replicas,
        max_nodes=trainer.max_replicas,
        rdzv_endpoint=rendezvous_endpoint(job),
        rdzv_id=job.uid or job.name,
        nproc_per_node=nproc_per_node,
    )


def build_agent_args(job: JobRef, graph: Graph, nproc_per_node: int) -> list[str]:
    """The runtime launcher's own agent line (the one a local replica runs), for a pod."""
    return launcher.build_agent_command(f"{CONFIG_DIR}/{CONFIG_FILE}",
                                        _elastic_settings(job, graph, nproc_per_node), python="python")


def build_trainer_command(job: JobRef, graph: Graph, nproc_per_node: int) -> list[str]:
    """A trainer pod's command: the trainer itself in the rendezvous when the trainer vertex
    resizes in place (a membership change then keeps the pod's process and state; the pod is
    one process, so `nproc_per_node` is 1), otherwise a torchrun agent of `nproc_per_node`
    workers."""
    if jobs.resizes_in_place(graph.vertex("trainer")):
        return launcher.build_in_place_command(f"{CONFIG_DIR}/{CONFIG_FILE}",
                                               _elastic_settings(job, graph, nproc_per_node), python="python")
    return build_agent_args(job, graph, nproc_per_node)


# What every pod Huorn pins to a GPU node tolerates (the device plugin's usual taint).
GPU_TOLERATION: Mapping[str, str] = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
TOLERATION_FIELDS = ("key", "operator", "value", "effect", "tolerationSeconds")
# The node lifecycle controller's taints on a lost node. Kubernetes' DefaultTolerationSeconds
# admission gives a pod these two for 300 s unless one of its tolerations already matches them.
NODE_LOST_TAINTS = ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
NODE_LOST_SECONDS = 300


def toleration_matches(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """Kubernetes' rule (Toleration.ToleratesTaint): the effect is the taint's or empty, and the
    key matches (an empty key with Exists matches every key), with the value too under Equal."""
    t = toleration
    if t.get("effect") and t.get("effect") != taint.get("effect"):
        return False
    if t.get("key") and t.get("key") != taint.get("key"):
        return False
    if not t.get("key") and t.get("operator") != "Exists":
        return False
    return t.get("operator", "Equal") == "Exists" or (t.get("value") or "") == (taint.get("value") or "")


def pod_tolerations(extra: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """Huorn's own toleration, then `extra`: those of the node's VirtualCluster (its
    members.tolerations, huorn.operator.index.ClusterIndex.tolerations_on), as a pod writes
    them. With none, the list every pod had before clusters could name any, so that pods of
    clusters that name none stay byte-identical across the upgrade.

    A cluster toleration of every key (`operator: Exists` with no key) also matches a lost
    node's NoExecute taints: the admission then gives the pod no 300 s, and the taint manager,
    which reads each taint's first matching toleration, would leave it Running on a dead node
    for ever, never replaced. Where such a toleration, without seconds, is a lost taint's first
    match, the pod carries one for that taint in front of it: the cluster's own for that key
    (with its seconds) if it lists one further on, else Kubernetes' 300 s."""
    cluster = [{k: t[k] for k in TOLERATION_FIELDS if t.get(k) not in (None, "")} for t in extra]
    lost = []
    for key in NODE_LOST_TAINTS:
        taint = {"key": key, "effect": "NoExecute"}
        matching = [t for t in cluster if toleration_matches(t, taint)]
        if matching and not matching[0].get("key") and "tolerationSeconds" not in matching[0]:
            named = next((t for t in matching if t.get("key")), None)
            lost.append(dict(named) if named is not None else {"key": key, "operator": "Exists",
                                                                "effect": "NoExecute",
                                                                "tolerationSeconds": NODE_LOST_SECONDS})
    own = [dict(GPU_TOLERATION), *lost]
    for written in cluster:
        if written not in own:
            own.append(written)
    return own


def security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def build_trainer_pod(
    job: JobRef,
    graph: Graph,
    instance: Instance,
    node: str,
    spec: Mapping[str, Any],
    virtual_cluster: str,
    tolerations: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """One trainer replica, pinned to `node`, tolerating its taints that `tolerations` (the
    node's cluster's) cover."""
    resources = spec.get("resources", {})
    gpus = int(resources.get("gpus", 1))
    processes = training.processes_per_replica(int((spec.get("parallelism") or {}).get("pipelineStages", 1)),
                                               gpus)
    cpu = str(resources.get("cpu", "4"))
    memory = str(resources.get("memory", "16Gi"))
    limits: dict[str, Any] = {"cpu": cpu, "memory": memory}
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    env = [
        {"name": "HUORN_REPLICA", "value": instance.name},
        {"name": "HUORN_JOB", "value": job.name},
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
        # torch's agent SIGKILLs its workers 30 s after its own SIGTERM by default, whatever grace
        # the pod was deleted with (a reclaim's may be far longer): the kubelet's grace bounds
        # the workers' checkpoint instead (a VirtualCluster's reclaimGraceSeconds is at most a day).
        {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": str(AGENT_SHUTDOWN_SECONDS)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        {"name": "OMP_NUM_THREADS", "value": "1"},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        *spec_env(spec),
    ]
    mounts, volumes = config_and_run_volumes(job)
    checkpoint = spec.get("checkpoint", {})
    if checkpoint.get("volume"):
        mounts.append({"name": "checkpoints", "mountPath": checkpoint.get("path", "/checkpoints")})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint["volume"]}})
    metadata = pod_metadata(job, pod_name(job, instance), spec,
                            {LABEL_VERTEX: instance.vertex, LABEL_INSTANCE: instance.name},
                            {ANNOTATION_NODE: node, ANNOTATION_GPUS: str(gpus),
                             ANNOTATION_VC: virtual_cluster})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            # Never: a failed pod is the operator's to judge (restart rules, remediation); a
            # kubelet restart in place would hide the failure and keep a broken node in the gang.
            "restartPolicy": "Never",
            "hostname": pod_name(job, instance),
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": HOSTNAME_LABEL, "operator": "In", "values": [node]},
                                ]
                            }
                        ],
                    }
                }
            },
            "tolerations": pod_tolerations(tolerations),
            "containers": [
                {
                    "name": "trainer",
                    "image": spec["image"],
                    "command": build_trainer_command(job, graph, processes),
                    "env": env,
                    "ports": [{"name": "telemetry", "containerPort": TELEMETRY_PORT}],
                    "resources": {"limits": limits, "requests": dict(limits)},
                    "volumeMounts": mounts,
                    "securityContext": security_context(),
                }
            ],
            "volumes": volumes,
            "terminationGracePeriodSeconds": 30,
            **pod_access(spec),
        },
    }


def build_store_pod(job: JobRef, instance: Instance, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The rendezvous vertex: no GPU, so the default scheduler may put it on any node."""
    metadata = pod_metadata(job, pod_name(job, instance), spec,
                            {LABEL_VERTEX: instance.vertex, LABEL_INSTANCE: instance.name},
                            {ANNOTATION_GPUS: "0"})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "restartPolicy": "Always",
            "containers": [
                {
                    "name": "store",
                    "image": spec["image"],
                    "command": launcher.build_store_command("0.0.0.0", STORE_PORT, python="python"),
                    "ports": [{"name": "c10d", "containerPort": STORE_PORT}],
                    "resources": {
                        "limits": {"cpu": "250m", "memory": "256Mi"},
                        "requests": {"cpu": "250m", "memory": "256Mi"},
                    },
                    "readinessProbe": {"tcpSocket": {"port": STORE_PORT}, "periodSeconds": 2},
                    "securityContext": security_context(),
                }
            ],
            **pod_access(spec),
        },
    }


def eval_pod_name(job: JobRef, instance: Instance, checkpoint: Mapping[str, Any] | None) -> str:
    """`<job>-<instance>-s<step>`: the step keeps a later activation of the same instance (the
    eval vertex is parked between checkpoints, and its instance names restart at eval-0) from
    ever meeting the finished pod of an earlier one under the same name."""
    step = (checkpoint or {}).get("step")
    suffix = f"s{int(step)}" if step is not None else "latest"
    return f"{pod_name(job, instance)}-{suffix}"


def build_eval_pod(job: JobRef, instance: Instance, spec: Mapping[str, Any],
                   checkpoint: Mapping[str, Any] | None) -> dict[str, Any]:
    """The eval vertex: `python -m huorn.runtime.evaluate` on one checkpoint, in a pod of its own.

    A bare pod with restartPolicy Never, like the trainers: the operator is its only controller,
    so a failure is reported once and never retried (a batch Job would add a second controller
    whose backoffLimit retries). The evaluator runs on CPU with no process group, so the pod
    asks for no GPU and the default scheduler places it; it reads the checkpoint from the job's
    checkpoint volume (read-only; shared by trainer pods on several nodes, so ReadWriteMany
    already) and the run config from the job's ConfigMap, the trainers' own. Its result comes
    back as the termination message (the operator cannot read the pod's files).
    """
    resources = spec.get("resources", {})
    limits = {"cpu": str(resources.get("cpu", "4")), "memory": str(resources.get("memory", "16Gi"))}
    ckpt = spec.get("checkpoint", {})
    root = str(ckpt.get("path", "/checkpoints"))
    target = (checkpoint or {}).get("path") or root
    mounts, volumes = config_and_run_volumes(job)
    _mount_checkpoints_read_only(ckpt, mounts, volumes)
    env = _replica_env(job, instance, spec)
    metadata = pod_metadata(job, eval_pod_name(job, instance, checkpoint), spec,
                            {LABEL_VERTEX: instance.vertex, LABEL_INSTANCE: instance.name},
                            {ANNOTATION_GPUS: "0",
                             ANNOTATION_CHECKPOINT: json.dumps(dict(checkpoint or {}), sort_keys=True)})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": metadata,
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "eval",
                    "image": spec["image"],
                    "command": launcher.build_eval_command(f"{CONFIG_DIR}/{CONFIG_FILE}", target,
                                                           python="python", result_file=TERMINATION_LOG),
                    "env": env,
                    "resources": {"limits": limits, "requests": dict(limits)},
                    "volumeMounts": mounts,
                    "securityContext": security_context(),
                    # File: the result JSON; on a crash before it is written, the log's tail
                    # (the evaluator's one-line refusal) becomes the message instead.
                    "terminationMessagePath": TERMINATION_LOG,
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }
            ],
            "volumes": volumes,
            "terminationGracePeriodSeconds": 30,
            **pod_access(spec),
        },
    }


def spec_env(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """spec.env as a container's: a value, or a Secret's or ConfigMap's key (valueFrom), which
    the kubelet reads as it starts the container; the operator never sees it."""
    return [{"name": e["name"], "valueFrom": dict(e["valueFrom"])} if e.get("valueFrom")
            else {"name": e["name"], "value": e.get("value", "")} for e in spec.get("env", [])]


def pod_access(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The pod spec's serviceAccountName and imagePullSecrets, as the job sets them; nothing
    for a job that sets neither, so its pods are those of the operators before these fields."""
    out: dict[str, Any] = {}
    if spec.get("serviceAccountName"):
        out["serviceAccountName"] = spec["serviceAccountName"]
    if spec.get("imagePullSecrets"):
        out["imagePullSecrets"] = [{"name": s["name"]} for s in spec["imagePullSecrets"]]
    return out


def config_and_run_volumes(job: JobRef) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The job's ConfigMap (read-only) and a scratch run directory: every pod of a job, trainer
    or eval, reads the same run config from the same place."""
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "run", "mountPath": RUN_DIR},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": config_map_name(job)}},
        {"name": "run", "emptyDir": {}},
    ]
    return mounts, volumes


# ---------------------------------------------------------------------------- InferenceJob
# The server vertex's replicas are pods like trainers (pinned to the node Huorn chose, GPUs
# counted by annotation); the router vertex is a ClusterIP Service, whose endpoints are the
# ready replicas: kube-proxy spreads the requests, and a replica leaves the rotation as soon as
# its readiness probe (the model loaded) fails.
SERVE_PORT = 8000
# the preStop pause, the drain of the requests in flight, and a margin (api/inference.py)
SERVE_GRACE_SECONDS = inference.SERVE_PRESTOP_SECONDS + inference.SERVE_DRAIN_SECONDS + 5
ANNOTATION_TEMPLATE = "huorn.io/template"
# Spec fields a running replica never rereads: changing them rolls no pod.
# nodeSelector: where replicas placed from now on go; those placed before keep serving where they run.
UNROLLED_FIELDS = frozenset({"autoscaling", "slo", "priority", "elasticity", "remediation", "routing",
                             "nodeSelector"})


def serve_service_name(job: JobRef) -> str:
    return job.name


def build_serve_config(job: JobRef, spec: Mapping[str, Any]) -> dict[str, Any]:
    """huorn.runtime.serve.ServeConfig, camelCase on the wire: the replica listens on every
    address, on the port the Service targets."""
    config = {"jobName": job.name, "spec": dict(spec), "host": "0.0.0.0", "port": SERVE_PORT,
              "runDir": RUN_DIR}
    # as a trainer's (build_run_config): a replica with GPUs serves on them, or refuses to start
    if int((spec.get("resources") or {}).get("gpus", 1)) > 0:
        config["device"] = "cuda"
    return config


def template_hash(spec: Mapping[str, Any], unrolled: frozenset[str]) -> str:
    """What a pod was started from, less the spec fields no running pod reads: a pod with
    another hash runs an old spec."""
    kept = {k: v for k, v in spec.items() if k not in unrolled and k != "podMetadata"}
    if "podMetadata" not in unrolled and (metadata := job_pod_metadata(spec)):
        kept["podMetadata"] = metadata
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def serve_template_hash(spec: Mapping[str, Any]) -> str:
    """What a replica was started from: a pod with another hash runs an old spec and is rolled.
    `autoscaling` is no setting of a replica, except activationTimeoutSeconds above the default
    load limit, which its startup probe waits (startup_seconds): a longer one must reach the
    running replicas, whose next container restart would kill a slower load."""
    if (startup := startup_seconds(spec)) != inference.SERVE_STARTUP_SECONDS:
        return template_hash({**spec, "startupSeconds": startup}, UNROLLED_FIELDS)
    return template_hash(spec, UNROLLED_FIELDS)


PREFIX_CACHE_DEFAULT = inference.ServingLimits.model_fields["prefix_cache_tokens"].default
# spec.serving's fields added after the first operators, newest first, with their defaults
_SERVING = inference.ServingLimits.model_fields
# (each with every default it has had: prefillChunkTokens was 2048 until 2026-12-05, and a spec
# stored then carries it)
ADDED_SERVING_FIELDS: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("maxQueued", (_SERVING["max_queued"].default,)),
    ("prefillDelayFactor", (_SERVING["prefill_delay_factor"].default,)),
    ("cudaGraphs", (_SERVING["cuda_graphs"].default,)),
    ("prefillChunkTokens", (_SERVING["prefill_chunk_tokens"].default, 2048)),
    ("batching", (_SERVING["batching"].default,)),
    ("prefixCacheTokens", (PREFIX_CACHE_DEFAULT,)))


def serve_template_hashes(spec: Mapping[str, Any]) -> set[str]:
    """Every hash a replica started from `spec` may carry: today's, and, while the spec keeps the
    serving fields added since at their defaults, those of the operators that had none of them
    (a spec stored by them has no such field): `batching` (continuous batching), then
    `prefixCacheTokens` (the prefix cache) before it. An upgrade of the operator rolls no replica;
    a replica started before it serves as it did until the spec changes."""
    hashes = {serve_template_hash(spec)}
    serving = dict(spec.get("serving") or {})
    for name, defaults in ADDED_SERVING_FIELDS:  # newest first: each older operator lacked it too
        if serving.pop(name, defaults[0]) not in defaults:
            break
        hashes.add(serve_template_hash({**spec, "serving": serving}))
    return hashes


def _mount_checkpoints_read_only(checkpoint: Mapping[str, Any], mounts: list[dict[str, Any]],
                                 volumes: list[dict[str, Any]]) -> None:
    """The job's checkpoint volume, read-only, at its path: an evaluator or a server reads the
    checkpoints the trainers write, and must never change them."""
    if checkpoint.get("volume"):
        mounts.append({"name": "checkpoints", "mountPath": str(checkpoint.get("path", "/checkpoints")),
                       "readOnly": True})
        volumes.append({"name": "checkpoints",
                        "persistentVolumeClaim": {"claimName": checkpoint["volume"], "readOnly": True}})


def _replica_env(job: JobRef, instance: Instance, spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [
        {"name": "HUORN_REPLICA", "value": instance.name},
        {"name": "HUORN_JOB", "value": job.name},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *spec_env(spec),
    ]


def build_serve_config_map(job: JobRef, spec: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": job_metadata(job, config_map_name(job)),
        "data": {CONFIG_FILE: json.dumps(build_serve_config(job, spec), indent=2, sort_keys=True)},
    }


def build_serve_service(job: JobRef, to_activator: bool = False) -> dict[str, Any]:
    """The job's Service: its ready replicas, or (scaled to zero, none ready) the activator."""
    return build_service(job, serve_service_name(job), ACTIVATOR_VERTEX if to_activator else "server",
                         ("http", 80, SERVE_PORT), type="ClusterIP")


# Scale to zero (autoscaling.minReplicas 0): an activator pod holds requests while no replica is
# ready (huorn.runtime.activator), and forwards them through a second Service that always selects
# the replicas; the job's own Service points at the activator only while no replica is ready.
ACTIVATOR_VERTEX = "activator"


def replicas_service_name(job: JobRef) -> str:
    return f"{job.name}-replicas"


def activator_pod_name(job: JobRef, index: int = 0) -> str:
    """The job's front pods (routing.frontReplicas): the first keeps the name it had when a job
    had one, so that an operator upgrade replaces nothing."""
    return f"{job.name}-activator" if index == 0 else f"{job.name}-activator-{index}"


def build_replicas_service(job: JobRef) -> dict[str, Any]:
    return build_service(job, replicas_service_name(job), "server", ("http", 80, SERVE_PORT),
                         type="ClusterIP")


# Prefix routing (routing.policy prefix): the activator pod is the job's router, in the path for
# good. It finds the ready replicas as the addresses of a headless Service's name, and the job's
# Service points at it once it is ready (at the replicas until then, and whenever it is not).
def endpoints_service_name(job: JobRef) -> str:
    return f"{job.name}-endpoints"


def build_endpoints_service(job: JobRef) -> dict[str, Any]:
    """Headless, ready replicas only: its name resolves to their pod IPs, one A record each."""
    return build_service(job, endpoints_service_name(job), "server", ("http", SERVE_PORT, SERVE_PORT),
                         clusterIP="None", publishNotReadyAddresses=False)


def routes_by_prefix(spec: Mapping[str, Any]) -> bool:
    return (spec.get("routing") or {}).get("policy") == "prefix"


def front_template_hash(spec: Mapping[str, Any]) -> str:
    """What the activator pod was started from: its image (a new one fixes or changes the
    router's code as much as the replicas'), whether it routes, and the settings it reads once
    at its start. A pod with another hash is replaced."""
    autoscaling = spec.get("autoscaling") or {}
    read = {"image": spec.get("image"), "timeout": autoscaling.get("activationTimeoutSeconds")}
    read |= pod_access(spec)  # nothing for a job that sets neither: its hash is as before
    read["podMetadata"] = spec.get("podMetadata")  # read at a pod's creation; template_hash drops it empty
    if routes_by_prefix(spec):
        # the pods' count is not a setting of any one pod: changing it adds or removes pods
        routing = {k: v for k, v in (spec.get("routing") or {}).items() if k != "frontReplicas"}
        read |= {"routing": routing,
                 "cache": (spec.get("serving") or {}).get("prefixCacheTokens", PREFIX_CACHE_DEFAULT)}
        if autoscaling.get("minReplicas") == 0:
            # a router holds requests while it knows no replica only when the job scales to zero,
            # read at its start: one started at minReplicas 1 stayed unready at zero replicas, the
            # Service had no endpoint, and nothing woke the job again (the key only when 0: the
            # routers of jobs that never scale to zero keep their hash across the upgrade)
            read["holds"] = True
    return template_hash(read, frozenset())


def build_activator_pod(job: JobRef, spec: Mapping[str, Any], index: int = 0) -> dict[str, Any]:
    """One of the job's front pods (the activator, or the router): CPU only, small, restarted in
    place by the kubelet if it crashes, and kept off the nodes of the job's other front pods when
    the scheduler can (a node's loss then takes one of them). It reads the job's serving config
    (its port and activationTimeoutSeconds) and forwards to the replicas' Service by its
    namespace-local name; with prefix routing, to the replicas themselves."""
    mounts, volumes = config_and_run_volumes(job)
    limits = {"cpu": "500m", "memory": "1Gi"}
    config = f"{CONFIG_DIR}/{CONFIG_FILE}"
    if routes_by_prefix(spec):
        command = launcher.build_router_command(
            config, replicas_dns=f"{endpoints_service_name(job)}.{job.namespace}.svc:{SERVE_PORT}",
            python="python")
    else:
        upstream = f"http://{replicas_service_name(job)}.{job.namespace}.svc:80"
        command = launcher.build_activator_command(config, upstream, python="python")
    metadata = pod_metadata(job, activator_pod_name(job, index), spec,
                            {LABEL_VERTEX: ACTIVATOR_VERTEX, LABEL_INSTANCE: f"{ACTIVATOR_VERTEX}-{index}"},
                            {ANNOTATION_TEMPLATE: front_template_hash(spec)})
    apart = {"weight": 100, "podAffinityTerm": {
        "labelSelector": {"matchLabels": {LABEL_JOB: job.name, LABEL_VERTEX: ACTIVATOR_VERTEX}},
        "topologyKey": "kubernetes.io/hostname"}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {
        "restartPolicy": "Always",
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [apart]}},
        "containers": [{
            "name": ACTIVATOR_VERTEX,
            "image": spec["image"],
            "command": command,
            "ports": [{"name": "http", "containerPort": SERVE_PORT}],
            "resources": {"limits": limits, "requests": dict(limits)},
            "volumeMounts": mounts,
            "securityContext": security_context(),
            "readinessProbe": {"httpGet": {"path": "/healthz", "port": SERVE_PORT}, "periodSeconds": 2},
            "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(inference.SERVE_PRESTOP_SECONDS)]}}},
        }],
        "volumes": volumes,
        # SIGTERM: held requests are answered 503 at once (clients retry them); those it forwarded
        # finish, in as long as a replica's own requests get, or a replacement would cut them off
        "terminationGracePeriodSeconds": SERVE_GRACE_SECONDS,
        **pod_access(spec),
    }}


def startup_seconds(spec: Mapping[str, Any]) -> float:
    """How long a replica may load its model before its startup probe gives up on it."""
    activation = float((spec.get("autoscaling") or {}).get("activationTimeoutSeconds") or 0)
    return max(inference.SERVE_STARTUP_SECONDS, activation)


def build_serve_pod(job: JobRef, instance: Instance, node: str, spec: Mapping[str, Any],
                    virtual_cluster: str, tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """One serving replica, pinned to `node` when it asks for GPUs (the default scheduler places
    a CPU replica), tolerating what `tolerations` (the node's cluster's) cover. restartPolicy
    Always: a crashed server is restarted in place by the kubelet, as a Deployment's would be;
    the operator replaces a pod only when the pod itself is lost."""
    resources = spec.get("resources", {})
    gpus = int(resources.get("gpus", 1))
    limits: dict[str, Any] = {"cpu": str(resources.get("cpu", "4")),
                              "memory": str(resources.get("memory", "16Gi"))}
    if gpus:
        limits[GPU_RESOURCE] = str(gpus)
    mounts, volumes = config_and_run_volumes(job)
    _mount_checkpoints_read_only(spec.get("checkpoint", {}), mounts, volumes)
    env = _replica_env(job, instance, spec)
    metadata = pod_metadata(job, pod_name(job, instance), spec,
                            {LABEL_VERTEX: instance.vertex, LABEL_INSTANCE: instance.name},
                            {ANNOTATION_NODE: node, ANNOTATION_GPUS: str(gpus),
                             ANNOTATION_VC: virtual_cluster, ANNOTATION_TEMPLATE: serve_template_hash(spec)})
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Always",
        "tolerations": pod_tolerations(tolerations),
        "containers": [
            {
                "name": "server",
                "image": spec["image"],
                "command": launcher.build_serve_command(f"{CONFIG_DIR}/{CONFIG_FILE}", python="python"),
                "env": env,
                "ports": [{"name": "http", "containerPort": SERVE_PORT}],
                "resources": {"limits": limits, "requests": dict(limits)},
                "volumeMounts": mounts,
                "securityContext": security_context(),
                # Loading (and GLVQ-quantising) a model takes a while: ready only once /healthz
                # answers, which is after the model is in memory.
                "readinessProbe": {"httpGet": {"path": "/healthz", "port": SERVE_PORT}, "periodSeconds": 2},
                # the model's cold start: what the activator is told to wait for, 600 s at least
                "startupProbe": {"httpGet": {"path": "/healthz", "port": SERVE_PORT}, "periodSeconds": 5,
                                 "failureThreshold": math.ceil(startup_seconds(spec) / 5)},
                # Still listening while the endpoints drop the pod: SIGTERM at once closed the
                # socket to connections kube-proxy was still sending.
                "lifecycle": {"preStop": {"exec": {"command": [
                    "sleep", str(inference.SERVE_PRESTOP_SECONDS)]}}},
            }
        ],
        "volumes": volumes,
        # the preStop pause, then SIGTERM: the requests in flight get SERVE_DRAIN_SECONDS to finish
        "terminationGracePeriodSeconds": SERVE_GRACE_SECONDS,
        **pod_access(spec),
    }
    if gpus and node:
        term = {"matchExpressions": [{"key": HOSTNAME_LABEL, "operator": "In", "values": [node]}]}
        pod_spec["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
