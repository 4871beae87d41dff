"""Spec and status fragments that every job kind shares."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from huorn.api import rules
from huorn.api.base import (
    LABEL_KEY_LIMIT,
    LABEL_KEY_PATTERN,
    LABEL_VALUE_PATTERN,
    ApiModel,
    DnsLabel,
    DnsSubdomain,
    Duration,
    Quantity,
    kubernetes_string,
    shown,
)


class ElasticityPolicy(StrEnum):
    GOODPUT = "goodput"
    FIXED = "fixed"


class ResizeMode(StrEnum):
    """How a trainer gang changes its membership (docs/runtime.md, "In-place resizing").

    torchrun's agent restarts every worker of the gang on any membership change, which costs a
    process start, a model build and a checkpoint load on every replica; a trainer that takes
    part in the rendezvous itself keeps its process and state, but only as one process per
    replica. `auto` lets the compiler pick (huorn.api.training.resolve_resize)."""

    AUTO = "auto"
    IN_PLACE = "inPlace"
    RESTART = "restart"


MAX_GPUS_PER_REPLICA = 16


class Resources(ApiModel):
    """What one replica asks for. GPUs are whole devices; shared GPUs are not scheduled by Huorn."""

    gpus: int = Field(default=1, ge=0, le=MAX_GPUS_PER_REPLICA, description="Whole GPUs per replica.")
    cpu: Quantity = Field(default="4", description="CPU per replica, e.g. '4' or '500m'.")
    memory: Quantity = Field(default="16Gi", description="Memory per replica, e.g. '16Gi'.")


@rules.attach(
    rules.Rule(
        name="elasticity-min-le-max",
        field="minReplicas",
        cel="self.minReplicas <= self.maxReplicas",
        holds=lambda e: e.min_replicas <= e.max_replicas,
        message="must be ≤ maxReplicas",
        detail=lambda e: f"{e.min_replicas} > {e.max_replicas}",
        fix="set minReplicas to at most maxReplicas, or raise maxReplicas",
    ),
)
class Elasticity(ApiModel):
    min_replicas: int = Field(default=1, ge=1, le=4096, description="Never run with fewer replicas.")
    max_replicas: int = Field(default=1, ge=1, le=4096, description="Never run with more replicas.")
    policy: ElasticityPolicy = Field(
        default=ElasticityPolicy.GOODPUT,
        description="goodput: Huorn picks the replica count and batch size; fixed: keep minReplicas.",
    )
    resize: ResizeMode = Field(
        default=ResizeMode.AUTO,
        description="How a TrainingJob's trainers live through a membership change. restart: a torchrun "
        "agent per replica, and every join, leave or failure restarts every worker from the last "
        "checkpoint. inPlace: each replica is one trainer process that joins the rendezvous itself, so "
        "joins, graceful leaves and lost peers (gloo reports them; on NCCL a heartbeat watch finds them and "
        "aborts the groups) keep the surviving processes and their in-memory state; it needs one process per "
        "replica, i.e. parallelism.pipelineStages 1 and resources.gpus at most 1. auto: inPlace when a "
        "replica is one process, restart otherwise.",
    )


class Checkpoint(ApiModel):
    volume: DnsLabel | None = Field(
        default=None, description="Name of a PersistentVolumeClaim that holds the checkpoints."
    )
    path: str = Field(
        default="/checkpoints", min_length=1, max_length=4096,
        description="Directory of the checkpoints in the pods, on the volume. `huorn run` writes them under "
        "its run directory instead.",
    )
    interval: Duration = Field(default="10m", description="Time between periodic checkpoints.")
    interval_steps: int | None = Field(
        default=None, ge=1, description="Checkpoint every N steps (overrides interval when set)."
    )


class MitigationLevel(StrEnum):
    """The FALCON ladder. Each level includes those below it."""

    OBSERVE = "observe"  # S1
    REBALANCE = "rebalance"  # S2
    RESPLIT = "resplit"  # S3
    RESTART = "restart"  # S4


class FailureAction(StrEnum):
    """What a pod failure that a podFailurePolicy rule matches does to the job (Kubernetes Job's
    actions, FailIndex aside: a gang has no indexes to fail alone)."""

    FAIL_JOB = "FailJob"  # the job fails now; no replacement
    IGNORE = "Ignore"  # replace the pod without spending spec.remediation.maxRestarts
    COUNT = "Count"  # replace the pod and spend one restart (what an unmatched failure does)


class ExitCodeOperator(StrEnum):
    IN = "In"
    NOT_IN = "NotIn"


@rules.attach(
    rules.Rule(
        name="exit-codes-unique",
        field="values",
        cel="self.values.all(v, self.values.exists_one(w, w == v))",
        holds=lambda e: len(set(e.values)) == len(e.values),
        message="must be distinct",
        detail=lambda e: ", ".join(str(v) for v in e.values),
        fix="list each exit code once",
    ),
    rules.Rule(
        name="exit-codes-in-not-zero",
        field="values",
        cel="self.operator != 'In' || self.values.all(v, v != 0)",
        holds=lambda e: e.operator != ExitCodeOperator.IN or 0 not in e.values,
        message="must not hold 0 with operator In (a container that exited 0 did not fail)",
        fix="remove 0, or use operator NotIn",
    ),
)
class OnExitCodes(ApiModel):
    """Matches a pod whose trainer container terminated with an exit code in (In) or not in
    (NotIn) the values. A pod the kubelet ended without running its container to an exit
    (Evicted before it started) has no exit code and matches no exit-code rule."""

    operator: ExitCodeOperator
    values: list[Annotated[int, Field(ge=0, le=255)]] = Field(min_length=1, max_length=255)


class OnPodCondition(ApiModel):
    """Matches a pod that has this condition with this status, e.g. DisruptionTarget, which
    Kubernetes sets on a pod it evicts (a node drain, the kubelet under node pressure, the
    scheduler's preemption, a tainted node)."""

    type: str = Field(min_length=1, max_length=316, pattern=r"^([a-z0-9.-]+/)?[A-Za-z0-9][-A-Za-z0-9_.]*$")
    status: Literal["True", "False", "Unknown"] = "True"


@rules.attach(
    rules.Rule(
        name="failure-rule-one-matcher",
        field="",
        cel="has(self.onExitCodes) != has(self.onPodConditions)",
        holds=lambda r: (r.on_exit_codes is None) != (r.on_pod_conditions is None),
        message="a podFailurePolicy rule needs exactly one of onExitCodes and onPodConditions",
        fix="split a rule that has both into two, or add the one that is missing",
    ),
)
class PodFailureRule(ApiModel):
    action: FailureAction
    on_exit_codes: OnExitCodes | None = None
    on_pod_conditions: list[OnPodCondition] | None = Field(
        default=None, min_length=1, max_length=20,
        description="Matches when the pod has any of these conditions.",
    )


class PodFailurePolicy(ApiModel):
    """Kubernetes Job's podFailurePolicy for a TrainingJob's trainer and store pods: the rules are
    tried in order on each failed pod, and the first that matches decides. A failure no rule
    matches follows Huorn's own restart rules (exit code 2 fails the job, anything else counts)."""

    rules: list[PodFailureRule] = Field(min_length=1, max_length=20)


class Remediation(ApiModel):
    hang_timeout: Duration = Field(
        default="30s", description="A rank stuck this long in one collective counts as hung."
    )
    fail_slow_detection: bool = Field(default=True, description="Run FALCON-style fail-slow detection.")
    max_mitigation: MitigationLevel = Field(
        default=MitigationLevel.RESTART, description="The highest rung of the mitigation ladder allowed."
    )
    max_restarts: int = Field(
        default=3, ge=0, le=1000,
        description="Pod replacements the job may spend on failures: a trainer or store pod that failed, "
        "was evicted or never started, and remediation restarts. The next failure after that fails the "
        "job. Moves made on purpose (S3 re-splits, loan reclaims, suspensions) and failures that an "
        "Ignore rule of podFailurePolicy matches do not count (Kubeflow's backoffLimit).",
    )
    pod_failure_policy: PodFailurePolicy | None = Field(
        default=None,
        description="Kubernetes Job's podFailurePolicy, for a TrainingJob's trainer and store pods: fail "
        "the job at once on an exit code that means the failure is final, or replace an evicted pod "
        "(DisruptionTarget) without spending maxRestarts. Rules are tried in order; the first match decides.",
    )


class KeyRef(ApiModel):
    """One key of a Secret or ConfigMap in the job's namespace (Kubernetes' SecretKeySelector,
    ConfigMapKeySelector): the kubelet reads it when it starts the container, so the operator
    needs no access to it."""

    name: DnsSubdomain = Field(description="The Secret's or ConfigMap's name, in the job's namespace.")
    key: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="The key whose value the variable gets.")
    optional: bool = Field(
        default=False,
        description="true: a missing object or key leaves the variable unset; false: the pod does not "
                    "start (CreateContainerConfigError) until it exists.")


@rules.attach(
    rules.Rule(
        name="env-source-one-ref",
        field="",
        cel="has(self.secretKeyRef) != has(self.configMapKeyRef)",
        holds=lambda s: (s.secret_key_ref is None) != (s.config_map_key_ref is None),
        message="valueFrom needs exactly one of secretKeyRef and configMapKeyRef",
        fix="keep one of them; a second variable can read the other",
    ),
)
class EnvVarSource(ApiModel):
    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A key of a ConfigMap.")


@rules.attach(
    rules.Rule(
        name="env-value-or-value-from",
        field="valueFrom",
        cel="!has(self.valueFrom) || self.value == ''",
        holds=lambda e: e.value_from is None or e.value == "",
        message="must not be set with a non-empty value: a variable takes its value from one place",
        fix="remove value, or remove valueFrom",
    ),
)
class EnvVar(ApiModel):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)
    value: str = Field(default="", max_length=32768)
    value_from: EnvVarSource | None = Field(
        default=None,
        description="The value from a key of a Secret (secretKeyRef) or ConfigMap (configMapKeyRef) in "
                    "the job's namespace, e.g. an HF_TOKEN or WANDB_API_KEY, instead of value.")


class LocalObjectReference(ApiModel):
    name: DnsSubdomain = Field(description="A Secret of type kubernetes.io/dockerconfigjson in the job's "
                                           "namespace.")


# Keys of a pod's labels and annotations that Huorn writes itself: the operator finds its pods by
# labels (app.kubernetes.io/managed-by in every list, huorn.io/job per job) and reads its own
# annotations back (huorn.io/node, huorn.io/gpus, huorn.io/template), so a job may not set them.
RESERVED_KEY_DOMAIN = "huorn.io"
RESERVED_LABELS = frozenset({"app.kubernetes.io/managed-by"})


def _check_key(key: str, lowered: bool) -> str:
    """A key as Kubernetes takes it for a label (IsQualifiedName) or, `lowered`, an annotation
    (IsQualifiedName of the lowercased key: `Example.com/x` is a valid annotation key), and none of
    Huorn's domain.

    Checked here, not in the CRD: a CEL rule over a map's keys has no length bound the API
    server's cost estimate could use (docs/api.md, "Known differences from a real API server")."""
    prefix = _check_key_syntax(key, lowered)
    if prefix.lower() == RESERVED_KEY_DOMAIN or prefix.lower().endswith("." + RESERVED_KEY_DOMAIN):
        raise ValueError(f"key {shown(key)} is in {RESERVED_KEY_DOMAIN}, whose keys Huorn sets on its pods; "
                         "use a key of your own domain")
    return key


def _check_key_syntax(key: str, lowered: bool) -> str:
    """The key's DNS prefix (before '/'), once its syntax is that of a label (or, `lowered`, an
    annotation) key."""
    judged = key.lower() if lowered else key
    prefix = judged.rpartition("/")[0]
    if len(prefix) > 253:
        raise ValueError(f"key {shown(key)}: its prefix (before '/') has {len(prefix)} characters; a DNS "
                         "prefix has at most 253")
    if not judged or len(judged) > LABEL_KEY_LIMIT or not re.fullmatch(LABEL_KEY_PATTERN, judged):
        raise ValueError(
            f"key {shown(key)} is not {'an annotation' if lowered else 'a label'} key: use "
            "a name of at most 63 letters, digits, '-', '_' and '.' (starting and ending with a letter or "
            "digit), with an optional DNS prefix and '/', as in example.com/team")
    return prefix


def _check_annotation_key(key: str) -> str:
    return _check_key(key, lowered=True)


def _check_label_key(key: str) -> str:
    _check_key(key, lowered=False)
    if key in RESERVED_LABELS:
        raise ValueError(f"key {key!r} is a label Huorn sets on its pods and finds them by; use a key of "
                         "your own")
    return key


def _at_most(limit: int, what: str) -> Any:
    """A map's count, said as kubectl says it, before pydantic's "Dictionary should have at most
    32 items after validation, not more"."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and len(value) > limit:
            raise ValueError(f"{len(value)} {what}: at most {limit}; remove some")
        return value

    return BeforeValidator(check)


def _check_node_label_key(key: str) -> str:
    """A node's label key, which may be Kubernetes' or a device plugin's own
    (kubernetes.io/hostname, nvidia.com/gpu.product): its syntax alone is judged."""
    _check_key_syntax(key, lowered=False)
    return key


AnnotationKey = Annotated[str, AfterValidator(_check_annotation_key)]
LabelKey = Annotated[str, AfterValidator(_check_label_key)]
NodeLabelKey = Annotated[str, AfterValidator(_check_node_label_key)]
LabelValue = kubernetes_string(
    LABEL_VALUE_PATTERN, 63,
    "a label value: at most 63 letters, digits, '-', '_' and '.', starting and ending with a letter or "
    "digit, or empty")
# Kubernetes refuses a pod whose annotations (keys and values) exceed 256 KiB in all. These bounds
# keep a job's own under it with room for Huorn's: 32 × (317 + 7,680) characters is 255,904 bytes
# of ASCII; a value in another script takes up to 4 bytes a character, which only the model counts.
ANNOTATION_LIMIT = 32
ANNOTATION_VALUE_LIMIT = 7680
ANNOTATIONS_BYTES = 256 * 1024 - 6 * 1024
AnnotationValue = Annotated[str, Field(max_length=ANNOTATION_VALUE_LIMIT)]


class PodMetadata(ApiModel):
    """Labels and annotations for every pod the job creates, as a Deployment's template carries
    them: a service mesh's injector, a cost report, a NetworkPolicy or a log pipeline select pods
    by them, and read them when the pod is created."""

    labels: Annotated[dict[LabelKey, LabelValue] | None, _at_most(32, "labels")] = Field(
        default=None, max_length=32,
        description="Labels of every pod of the job (at most 32), e.g. team: nlp. Keys under huorn.io/ "
                    "and app.kubernetes.io/managed-by are Huorn's own.")
    annotations: Annotated[dict[AnnotationKey, AnnotationValue] | None,
                           _at_most(ANNOTATION_LIMIT, "annotations")] = Field(
        default=None, max_length=ANNOTATION_LIMIT,
        description="Annotations of every pod of the job (at most 32, values up to 7,680 characters), "
                    "e.g. sidecar.istio.io/inject: \"false\". Keys under huorn.io/ are Huorn's own.")

    @model_validator(mode="after")
    def _annotations_fit(self) -> PodMetadata:
        size = sum(len(k.encode()) + len(v.encode()) for k, v in (self.annotations or {}).items())
        if size > ANNOTATIONS_BYTES:
            raise ValueError(f"annotations: {size} bytes of keys and values, over the {ANNOTATIONS_BYTES} a "
                             "pod can carry beside Huorn's own; shorten or remove some")
        return self


# The operator's job image when `--job-image` is not given: the release this API ships with. A
# job that names no image runs the operator's job image, pinned in status.image at its first
# reconcile (huorn.operator.images); the Helm chart passes its own image, so a mirror is used.
DEFAULT_IMAGE = "ghcr.io/huorn-io/huorn:0.1.0"
# Job pods' default (huorn operator --job-image): the image's CUDA build, which GPU jobs need
DEFAULT_JOB_IMAGE = f"{DEFAULT_IMAGE}-cu126"


# Fields that JobBasics, JobCommon and ElasticJobCommon all declare, defined once: one
# description, one set of bounds.
def _virtual_cluster_field() -> Any:
    return Field(description="The VirtualCluster whose GPUs this job uses.")


def _image_field() -> Any:
    return Field(
        default=None, min_length=1,
        description="Container image of the pods (a CUDA build for a job with GPUs). Unset: the "
                    "operator's job image (the Helm chart's jobImage, by default its own image's CUDA "
                    "build), kept in status.image for the job's life.",
    )


def _env_field() -> Any:
    return Field(default_factory=list, max_length=128,
                 description="Environment overrides of every container of the job's pods that runs its "
                             "code: a value, or a key of a Secret or ConfigMap (valueFrom).")


# Unset (None, not an empty list): a job that sets neither renders pods, and pod template hashes,
# exactly as before these fields existed, so an operator upgrade rolls nothing.
def _image_pull_secrets_field() -> Any:
    return Field(default=None, max_length=32,
                 description="Secrets that hold the credentials of a private registry, for every pod of "
                             "the job (the pod's imagePullSecrets).")


def _pod_metadata_field() -> Any:
    return Field(default=None,
                 description="Labels and annotations of every pod of the job. Unset: Huorn's own alone.")


def _service_account_field() -> Any:
    return Field(default=None,
                 description="The ServiceAccount every pod of the job runs as, in the job's namespace "
                             "(e.g. one bound to a cloud identity for object storage). Unset: the "
                             "namespace's default.")


def _node_selector_field(borrows: bool = True) -> Any:
    where = "among its virtual cluster's nodes" + (" and those it borrows" if borrows else "")
    return Field(
        default=None, max_length=16,
        description=f"Labels a node must carry for the job's GPU pods to be placed on it, {where} (e.g. "
                    "nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3 on a cluster of mixed GPUs). Pods placed "
                    "before an edit stay where they run. Unset: any node of the virtual cluster.")


NodeSelector = Annotated[dict[NodeLabelKey, LabelValue] | None, _at_most(16, "node selector labels")]


class JobBasics(ApiModel):
    """Fields every job kind has; an InferenceJob has only these of the shared ones.

    An InferenceJob scales by `autoscaling` and waits in no line, so priority, elasticity and
    remediation (JobCommon's) were accepted and then ignored. A kind that has no use for a field
    does not have it: the CRD and `huorn validate` refuse it as an unknown field."""

    virtual_cluster: DnsLabel = _virtual_cluster_field()
    image: str | None = _image_field()
    resources: Resources = Field(default_factory=Resources)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    env: list[EnvVar] = _env_field()
    image_pull_secrets: list[LocalObjectReference] | None = _image_pull_secrets_field()
    service_account_name: DnsSubdomain | None = _service_account_field()
    pod_metadata: PodMetadata | None = _pod_metadata_field()
    node_selector: NodeSelector = _node_selector_field(borrows=False)  # serving replicas borrow nothing


def _priority_field() -> Any:
    return Field(
        default=50, ge=0, le=1000,
        description="Higher wins. Jobs at 100 or above are never preempted (the KAI convention).",
    )


class JobCommon(ApiModel):
    """JobBasics' fields and those of the gangs that wait in line for GPUs (TrainingJob, RLJob):
    priority (queue order, preemption) and remediation (restart budget, podFailurePolicy). An
    RLJob's spec is this; a TrainingJob's adds elasticity (ElasticJobCommon).

    Declared apart from JobBasics, not derived from it: a subclass's fields come after its base's,
    and the CRDs keep the order they have always had (priority after image)."""

    virtual_cluster: DnsLabel = _virtual_cluster_field()
    image: str | None = _image_field()
    priority: int = _priority_field()
    resources: Resources = Field(default_factory=Resources)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    remediation: Remediation = Field(default_factory=Remediation)
    env: list[EnvVar] = _env_field()
    image_pull_secrets: list[LocalObjectReference] | None = _image_pull_secrets_field()
    service_account_name: DnsSubdomain | None = _service_account_field()
    pod_metadata: PodMetadata | None = _pod_metadata_field()
    node_selector: NodeSelector = _node_selector_field(borrows=False)  # an RLJob borrows nothing


class ElasticJobCommon(ApiModel):
    """JobCommon's fields and elasticity, a TrainingJob's: the replica bounds and policy its
    trainers resize within. An RLJob had it too, accepted and ignored (its Ray workers follow
    `gpus` and its roles, and its entry in the line replaced what was read from it); the CRD and
    `huorn validate` now refuse it there as an unknown field.

    Declared apart for the CRD's field order (elasticity between resources and checkpoint)."""

    virtual_cluster: DnsLabel = _virtual_cluster_field()
    image: str | None = _image_field()
    priority: int = _priority_field()
    resources: Resources = Field(default_factory=Resources)
    elasticity: Elasticity = Field(default_factory=Elasticity)
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    remediation: Remediation = Field(default_factory=Remediation)
    env: list[EnvVar] = _env_field()
    image_pull_secrets: list[LocalObjectReference] | None = _image_pull_secrets_field()
    service_account_name: DnsSubdomain | None = _service_account_field()
    pod_metadata: PodMetadata | None = _pod_metadata_field()
    node_selector: NodeSelector = _node_selector_field()


# ---------------------------------------------------------------------------------------------
# Status


# The prediction board's time base (huorn.scheduler.forecast.ForecastConfig: 5-minute bins, the
# peak of the next two forecast from six lags, fitted once it has ten more bins than that), here
# because the API's rules check a history against it.
BOARD_BIN_SECONDS = 300
BOARD_HORIZON_BINS = 2
BOARD_BINS_BEYOND_HORIZON = 16
RECLAIM_TICK_SECONDS = 10  # how often the operator reclaims (OperatorSettings.vc_status_seconds)
MIN_HISTORY = "90m"  # the 18 bins the board fits on at its shortest horizon
MAX_HISTORY = "900h"  # Prometheus answers at most 11,000 points a query_range: 916 hours of 5-minute bins


def board_horizon_bins(grace_seconds: int) -> int:
    """Bins the board looks ahead for an inference cluster, so that GPUs it asks back come back
    before they are needed: a victim may keep them for the lender's reclaim grace after the tick
    that asks. Two (10 minutes) cover the default 30 s grace; a grace of 30 minutes needs seven
    (35 minutes): with two, a victim signalled at the horizon held its GPUs 20 minutes past it."""
    return max(BOARD_HORIZON_BINS, -(-(grace_seconds + RECLAIM_TICK_SECONDS) // BOARD_BIN_SECONDS))


def board_history_seconds(grace_seconds: int) -> int:
    """The shortest history the board can fit on at `board_horizon_bins(grace_seconds)`."""
    return (BOARD_BINS_BEYOND_HORIZON + board_horizon_bins(grace_seconds)) * BOARD_BIN_SECONDS


class RateHistory(ApiModel):
    """Where a request rate's history comes from, for the prediction board (huorn.scheduler.forecast).

    The operator reads the history from Prometheus (the HTTP API's `query_range`, at the board's
    5-minute bins) and fits the board on it. Prometheus holds the history, so a restarted
    operator has it back at its first tick, and the serving stack already feeds it.
    """

    prometheus_url: str = Field(
        # NB: the port a number: a port like :9090x passed, and the board's URL parser raised
        alias="prometheusURL", pattern=r"^https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(:[0-9]{1,5})?(/\S*)?$",
        max_length=2048,
        description="Base URL of the Prometheus HTTP API, e.g. http://prometheus.monitoring:9090.")
    query: str = Field(
        min_length=1, max_length=4096,
        description="PromQL giving the request rate in requests per second, e.g. "
                    "sum(rate(vllm:request_success_total{namespace=\"serving\"}[5m])). Several series "
                    "are summed.")
    quantile: float = Field(
        default=0.9, ge=0.5, le=0.99,
        description="Quantile of the next 10 minutes' peak that is provided for. A miss costs only the "
                    "reaction time: a rate above the forecast is acted on at once.")
    history: Duration = Field(default="24h", description="How much rate history the board is fitted on.")


class RateReading(ApiModel):
    """The board's last reading, in status."""

    requests_per_second: float = Field(description="The rate now.")
    peak_requests_per_second: float = Field(description="The forecast peak of the next 10 minutes.")
    history_bins: int = Field(ge=0, description="5-minute bins of rate history read.")
    model: Literal["fitted", "reactive"] = Field(
        description="reactive: too little history to fit the board, so the rate now is provided for.")
    error: str | None = Field(default=None, description="Why Prometheus cannot be read now, if so.")


class ConditionStatus(StrEnum):
    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


class Condition(ApiModel):
    """A metav1.Condition, so kstatus, `kubectl wait`, Argo CD and Flux read it unaided."""

    type: str = Field(max_length=316)
    status: ConditionStatus
    reason: str = Field(default="", max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: str | None = None
    observed_generation: int | None = None


class Decision(ApiModel):
    """One entry of the bounded decision history: what was done, why, and when."""

    time: str
    action: str = Field(max_length=64)
    reason: str = Field(max_length=1024)
    graph_version: int | None = None


class LastCheckpoint(ApiModel):
    step: int = 0
    time: str | None = None
    path: str | None = None


Phase = Literal[
    "Pending", "Placing", "Running", "Resizing", "Remediating", "Suspended", "Succeeded", "Failed", "Stalled"
]

DECISION_HISTORY_LIMIT = 32
# Ready, Reconciling, Stalled and the kind-specific ones; a bound keeps the server's cost estimate finite.
CONDITION_LIMIT = 16


class JobStatus(ApiModel):
    """Status that every job kind reports. Everything here is derivable from the cluster again."""

    model_config = ApiModel.model_config | {"extra": "allow"}

    phase: Phase = "Pending"
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=CONDITION_LIMIT)
    replicas: int = 0
    selector: str | None = Field(default=None, description="Label selector of the pods (for HPA).")
    graph: dict | None = Field(default=None, description="Bounded summary of the execution graph.")
    throughput: float | None = Field(default=None, description="Samples per second, last window.")
    goodput: float | None = Field(default=None, description="Throughput × statistical efficiency.")
    last_checkpoint: LastCheckpoint | None = None
    decisions: list[Decision] = Field(default_factory=list, max_length=DECISION_HISTORY_LIMIT)
    message: str | None = None
    image: str | None = Field(
        default=None,
        description="The image the pods run: spec.image, else the operator's job image when the job "
                    "was first reconciled, which an operator upgrade leaves alone.")
