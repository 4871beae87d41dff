"""The registry of Huorn's custom resources: one entry per kind, read by CRD generation,
manifest validation, the operator and the CLI, so that adding a kind touches one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from huorn.api import rules
from huorn.api.base import API_VERSION, GROUP, VERSION, ObjectMeta
from huorn.api.common import JobStatus
from huorn.api.inference import InferenceJobSpec, InferenceJobStatus
from huorn.api.rl import RLJobSpec, RLJobStatus
from huorn.api.training import TrainingJobSpec, TrainingJobStatus
from huorn.api.virtualcluster import VirtualClusterSpec, VirtualClusterStatus


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: str = "string"
    priority: int = 0
    description: str = ""


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    scope: Literal["Namespaced", "Cluster"]
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: tuple[PrinterColumn, ...] = field(default=())
    # JSON paths of the scale subresource, None when the kind does not scale.
    scale_spec_path: str | None = None
    scale_status_path: str | None = None

    @property
    def api_version(self) -> str:
        return API_VERSION

    @property
    def group(self) -> str:
        return GROUP

    @property
    def version(self) -> str:
        return VERSION


_JOB_COLUMNS = (
    PrinterColumn("Phase", ".status.phase"),
    PrinterColumn("Replicas", ".status.replicas", "integer"),
    PrinterColumn("Ready", '.status.conditions[?(@.type=="Ready")].status'),
    PrinterColumn("VCluster", ".spec.virtualCluster", priority=1),
    PrinterColumn("Image", ".status.image", priority=1, description="The image the job's pods run."),
    PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
)

TRAINING_JOB = Kind(
    kind="TrainingJob", plural="trainingjobs", singular="trainingjob", short_names=("tj",),
    scope="Namespaced", spec=TrainingJobSpec, status=TrainingJobStatus,
    columns=(
        *_JOB_COLUMNS[:2],
        PrinterColumn("Step", ".status.step", "integer"),
        PrinterColumn("Loss", ".status.loss", "number"),
        PrinterColumn("Progress", ".status.progressPercent", "integer"),
        PrinterColumn("ETA", ".status.estimatedRemaining"),
        PrinterColumn("Restarts", ".status.restartsUsed", "integer", priority=1),
        PrinterColumn("Batch", ".status.batchSize", "integer", priority=1,
                      description="The global batch of the newest step (the goodput rule's)."),
        *_JOB_COLUMNS[2:],
    ),
    scale_spec_path=".spec.elasticity.minReplicas",
    scale_status_path=".status.replicas",
)
RL_JOB = Kind(
    kind="RLJob", plural="rljobs", singular="rljob", short_names=("rlj",),
    scope="Namespaced", spec=RLJobSpec, status=RLJobStatus,
    columns=(
        *_JOB_COLUMNS[:2],
        PrinterColumn("Step", ".status.step", "integer"),
        PrinterColumn("Reward", ".status.meanReward", "number"),
        PrinterColumn("Progress", ".status.progressPercent", "integer"),
        PrinterColumn("Trainers", ".status.roleReplicas.actorTrain", "integer", priority=1,
                      description="Training actors (one data-parallel group) of the last step"),
        PrinterColumn("Rollout", ".status.rolloutWorkers", "integer", priority=1,
                      description="Rollout workers the controller runs now"),
        PrinterColumn("Restarts", ".status.restarts", "integer", priority=1),
        *_JOB_COLUMNS[2:],
    ),
)
INFERENCE_JOB = Kind(
    kind="InferenceJob", plural="inferencejobs", singular="inferencejob", short_names=("ij",),
    scope="Namespaced", spec=InferenceJobSpec, status=InferenceJobStatus,
    columns=(
        *_JOB_COLUMNS[:2],
        PrinterColumn("Serving", ".status.readyReplicas", "integer",
                      description="Replicas ready to serve (the Service's endpoints)"),
        PrinterColumn("Desired", ".status.desiredReplicas", "integer",
                      description="Replicas the autoscaler asks for"),
        PrinterColumn("RPS", ".status.requestsPerSecond", "number"),
        PrinterColumn("P99ms", ".status.p99LatencyMs", "number"),
        PrinterColumn("Util", ".status.utilization", "number", priority=1),
        PrinterColumn("Cached", ".status.cachedPromptShare", "number", priority=1,
                      description="Share of prompt tokens from the prefix caches"),
        PrinterColumn("Routing", ".status.routing", priority=1,
                      description="Where the Service sends requests: replicas, activator or router"),
        *_JOB_COLUMNS[2:],
    ),
    scale_spec_path=".spec.autoscaling.minReplicas",
    scale_status_path=".status.replicas",
)
VIRTUAL_CLUSTER = Kind(
    kind="VirtualCluster", plural="virtualclusters", singular="virtualcluster", short_names=("vc",),
    scope="Cluster", spec=VirtualClusterSpec, status=VirtualClusterStatus,
    columns=(
        PrinterColumn("Purpose", ".spec.purpose"),
        PrinterColumn("Capacity", ".status.capacity", "integer"),
        PrinterColumn("Allocated", ".status.allocated", "integer"),
        PrinterColumn("Lent", ".status.lent", "integer"),
        PrinterColumn("Borrowed", ".status.borrowed", "integer"),
        PrinterColumn("Waiting", ".status.waitingJobs", "integer",
                      description="TrainingJobs and RLJobs waiting in line for this cluster's GPUs"),
        PrinterColumn("Forecast", ".status.forecast.gpus", "integer", priority=1,
                      description="GPUs the forecast request rate needs (lending.forecast)"),
        PrinterColumn("Next", ".status.line[0].job", priority=1,
                      description="The job first in line for this cluster's GPUs (status.line)"),
        PrinterColumn("Age", ".metadata.creationTimestamp", "date"),
    ),
)

KINDS: dict[str, Kind] = {k.kind: k for k in (TRAINING_JOB, RL_JOB, INFERENCE_JOB, VIRTUAL_CLUSTER)}
JOB_KINDS = (TRAINING_JOB, RL_JOB, INFERENCE_JOB)


class _Resource(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    api_version: Literal["huorn.io/v1alpha1"] = Field(alias="apiVersion")
    metadata: ObjectMeta = Field(default_factory=ObjectMeta)


class TrainingJob(_Resource):
    kind: Literal["TrainingJob"]
    spec: TrainingJobSpec
    status: TrainingJobStatus | None = None


class RLJob(_Resource):
    kind: Literal["RLJob"]
    spec: RLJobSpec
    status: RLJobStatus | None = None


class InferenceJob(_Resource):
    kind: Literal["InferenceJob"]
    spec: InferenceJobSpec
    status: InferenceJobStatus | None = None


class VirtualCluster(_Resource):
    kind: Literal["VirtualCluster"]
    spec: VirtualClusterSpec
    status: VirtualClusterStatus | None = None


# Any of the four typed resources, as huorn.api.manifests.load_manifest returns it.
Resource = TrainingJob | RLJob | InferenceJob | VirtualCluster

RESOURCE_MODELS: dict[str, type[_Resource]] = {
    "TrainingJob": TrainingJob,
    "RLJob": RLJob,
    "InferenceJob": InferenceJob,
    "VirtualCluster": VirtualCluster,
}

# Every cross-field rule with the model class it sits on (all model modules are imported above).
RULES = rules.registered()

__all__ = ["JOB_KINDS", "KINDS", "RESOURCE_MODELS", "RULES", "JobStatus", "Kind", "PrinterColumn", "Resource"]
