"""An RLJob's children: one Ray cluster per job, as KubeRay would give a Ray job.

- `<job>-ray`, a headless Service in front of the head pod: the workers join the head's GCS
  through it (port 6379), and publishNotReadyAddresses lets them do so before any readiness.
- `<job>-config`, the ConfigMap holding the controller's run config
  (huorn.runtime.rl.controller.RLRunConfig, camelCase on the wire).
- The head pod (vertex `ray-head`): Ray's head node and the single controller, no GPU, placed by
  the default scheduler like the rendezvous store of a TrainingJob. Its exit code is the job's.
- The worker pods (vertex `ray-worker`): Ray worker nodes of `spec.resources.gpus` GPUs each,
  pinned to the nodes Huorn chose and counted by annotation like trainers.

Every pod has restartPolicy Never: the operator judges a failure (podFailurePolicy, the restart
budget) and restarts the whole gang, since the actors of a lost Ray node are gone and the
controller resumes from the last checkpoint on a fresh cluster.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

from huorn.api import common, rl
from huorn.backends.kubernetes import manifests
from huorn.graph.model import Instance
from huorn.runtime import launcher

HEAD = "ray-head"
WORKER = "ray-worker"
# The runtime's name for it (huorn.runtime.rl.controller.WAIT_GPUS_ENV), which this module does
# not import: the controller imports Ray and torch.
WAIT_GPUS_ENV = "HUORN_RL_WAIT_GPUS"
# How long the controller waits for its actors; worker pods may wait for GPUs or images first.
START_TIMEOUT_SECONDS = 1800.0


# Spec fields that no pod of a running gang reads, or that the head re-reads from the ConfigMap
# when it needs them (controllerRetries): changing them restarts nothing.
# nodeSelector: where workers placed from now on go; those placed before stay where they run.
UNROLLED_FIELDS = frozenset({"priority", "remediation", "suspend", "controllerRetries", "nodeSelector"})


# Roles whose replica count a running controller follows (it re-reads the ConfigMap at every
# step: huorn.runtime.rl.pools), so a change of it restarts no pod.
LIVE_ROLES = ("actorTrain", "rollout", "reference", "reward")


def template_hash(spec: Mapping[str, Any], live_roles: tuple[str, ...] = LIVE_ROLES) -> str:
    """What a gang was started from: a pod with another hash runs an old spec. Fields a running
    gang follows are left out too: `gpus` (more Ray workers join the running cluster; fewer
    restart it, which the operator decides itself) and the replicas of `live_roles`."""
    live = {k: v for k, v in spec.items() if k != "gpus"}
    roles = dict(live.get("roles") or {})
    for role in live_roles:
        if isinstance(roles.get(role), Mapping):
            roles[role] = {k: v for k, v in roles[role].items() if k != "replicas"}
    if roles:
        live["roles"] = roles
    return manifests.template_hash(live, UNROLLED_FIELDS)


# What the RLJob CRD defaulted spec.elasticity to while an RLJob had it (stored in every RLJob
# of that time, pruned on read since): pods started then hashed it.
FORMER_ELASTICITY = common.Elasticity().to_wire()


def template_hashes(spec: Mapping[str, Any]) -> set[str]:
    """Every hash a gang started from `spec` may carry, by the operator version that started it:
    today's; before the training, reference and reward actors scaled live (rollout only); and
    before any field was left out. Each also as it was while an RLJob had `elasticity`, at its
    default. A gang whose spec has not changed is not restarted by an upgrade."""
    specs = [spec] if "elasticity" in spec else [spec, {**spec, "elasticity": FORMER_ELASTICITY}]
    return {h for s in specs for h in (template_hash(s), template_hash(s, ("rollout",)),
                                       manifests.template_hash(s, UNROLLED_FIELDS))}


def config_hash(job: manifests.JobRef, spec: Mapping[str, Any]) -> str:
    """What the job's ConfigMap holds: written again when this changes."""
    return manifests.template_hash(build_rl_config(job, spec), frozenset())


def head_service_name(job: manifests.JobRef) -> str:
    return f"{job.name}-ray"


def head_address(job: manifests.JobRef) -> str:
    return f"{head_service_name(job)}.{job.namespace}.svc:{launcher.RAY_PORT}"


def whole_cpus(quantity: object) -> int:
    """A CPU quantity ('4', '500m', 2.5) as the whole CPUs Ray is told it has, at least one."""
    text = str(quantity)
    value = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    return max(1, math.floor(value))


def build_rl_config(job: manifests.JobRef, spec: Mapping[str, Any]) -> dict[str, Any]:
    """The controller's run config; it serves its progress where the operator polls it."""
    config = {"jobName": job.name, "spec": dict(spec), "runDir": manifests.RUN_DIR,
              "startTimeoutS": START_TIMEOUT_SECONDS,
              "progressHost": "0.0.0.0", "progressPort": manifests.TELEMETRY_PORT}
    # As a trainer's (manifests.build_run_config): a job with GPUs runs its model roles on them,
    # or they refuse to start (huorn.runtime.rl.workers._device); "auto" fell back to the CPU,
    # unnoticed, in an image whose torch is a CPU-only build, while Ray held the GPUs for them.
    if rl.ray_layout(rl.RLJobSpec.model_validate(spec)).gpus > 0:
        config["device"] = "cuda"
    return config


def build_rl_config_map(job: manifests.JobRef, spec: Mapping[str, Any]) -> dict[str, Any]:
    data = {manifests.CONFIG_FILE: json.dumps(build_rl_config(job, spec), indent=2, sort_keys=True)}
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": manifests.job_metadata(job, manifests.config_map_name(job)), "data": data}


def build_head_service(job: manifests.JobRef) -> dict[str, Any]:
    return manifests.build_service(job, head_service_name(job), HEAD,
                                   ("gcs", launcher.RAY_PORT, launcher.RAY_PORT),
                                   clusterIP="None", publishNotReadyAddresses=True)


def _pod(job: manifests.JobRef, instance: Instance, spec: Mapping[str, Any], command: list[str],
         gpus: int, node: str, virtual_cluster: str,
         extra_env: tuple[dict[str, str], ...] = (),
         tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    resources = spec.get("resources", {})
    limits: dict[str, Any] = {"cpu": str(resources.get("cpu", "4")),
                              "memory": str(resources.get("memory", "16Gi"))}
    if gpus:
        limits[manifests.GPU_RESOURCE] = str(gpus)
    mounts, volumes = manifests.config_and_run_volumes(job)
    checkpoint = spec.get("checkpoint", {})
    if checkpoint.get("volume"):  # read-write: the training actor saves there, the head reads it back
        mounts.append({"name": "checkpoints", "mountPath": checkpoint.get("path", "/checkpoints")})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": checkpoint["volume"]}})
    metadata = manifests.pod_metadata(job, manifests.pod_name(job, instance), spec,
                                      {manifests.LABEL_VERTEX: instance.vertex,
                                       manifests.LABEL_INSTANCE: instance.name},
                                      {manifests.ANNOTATION_NODE: node, manifests.ANNOTATION_GPUS: str(gpus),
                                       manifests.ANNOTATION_VC: virtual_cluster,
                                       manifests.ANNOTATION_TEMPLATE: template_hash(spec)})
    env = [{"name": "HUORN_JOB", "value": job.name}, {"name": "HUORN_REPLICA", "value": instance.name},
           {"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "OMP_NUM_THREADS", "value": "1"},
           # Ray 2.60 turns token authentication on for `ray start`, with a token each node would
           # generate for itself (~/.ray/auth_token): the job's nodes could never join. Off by
           # default, like the c10d store and NCCL of a TrainingJob; spec.env comes after, so
           # RAY_AUTH_MODE=token with one RAY_AUTH_TOKEN for every pod turns it back on.
           {"name": "RAY_AUTH_MODE", "value": "disabled"}, *extra_env,
           *manifests.spec_env(spec)]
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{
            "name": instance.vertex,
            "image": spec["image"],
            "command": command,
            "env": env,
            "ports": [{"name": "gcs", "containerPort": launcher.RAY_PORT},
                      {"name": "progress", "containerPort": manifests.TELEMETRY_PORT}]
            if instance.vertex == HEAD else [],
            "resources": {"limits": limits, "requests": dict(limits)},
            "volumeMounts": mounts,
            "securityContext": manifests.security_context(),
            # the controller's refusal ("error: spec...") becomes the pod's termination message
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }],
        "volumes": volumes,
        # SIGTERM: the controller finishes its step and checkpoints it (huorn.runtime.rl.controller)
        "terminationGracePeriodSeconds": 120,
        **manifests.pod_access(spec),
    }
    if gpus and node:
        term = {"matchExpressions": [{"key": manifests.HOSTNAME_LABEL, "operator": "In", "values": [node]}]}
        pod_spec["affinity"] = {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}
        pod_spec["tolerations"] = manifests.pod_tolerations(tolerations)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def build_head_pod(job: manifests.JobRef, instance: Instance, spec: Mapping[str, Any],
                   virtual_cluster: str, worker_gpus: int = 0) -> dict[str, Any]:
    """`worker_gpus`: those of the gang's worker pods, created with it, which its controller
    waits for before it decides where the model roles run (controller.WAIT_GPUS_ENV)."""
    cpus = whole_cpus(spec.get("resources", {}).get("cpu", "4"))
    command = launcher.build_rl_head_command(f"{manifests.CONFIG_DIR}/{manifests.CONFIG_FILE}", cpus,
                                             python="python")
    wait = ({"name": WAIT_GPUS_ENV, "value": str(worker_gpus)},) if worker_gpus else ()
    return _pod(job, instance, spec, command, 0, "", virtual_cluster, wait)


def build_worker_pod(job: manifests.JobRef, instance: Instance, spec: Mapping[str, Any], gpus: int,
                     node: str, virtual_cluster: str,
                     tolerations: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """A Ray worker pinned to `node`, tolerating what `tolerations` (the node's cluster's) cover."""
    cpus = whole_cpus(spec.get("resources", {}).get("cpu", "4"))
    command = launcher.build_rl_worker_command(head_address(job), gpus, cpus, python="python")
    return _pod(job, instance, spec, command, gpus, node, virtual_cluster, tolerations=tolerations)
