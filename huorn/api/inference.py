"""InferenceJob: replicas of a Huorn model behind a router, scaled to an SLO."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from huorn.api import rules
from huorn.api.base import ApiModel
from huorn.api.common import JobBasics, JobStatus, RateHistory, RateReading
from huorn.api.training import ModelSpec


@rules.attach(rules.filesystem_path("served-checkpoint-is-a-path", "checkpoint", "checkpoint"))
class ServedModel(ApiModel):
    checkpoint: str = Field(min_length=1, description="Path of the checkpoint to serve (a directory, or "
                            "a checkpoint root with a `latest`); in a pod, on the checkpoint volume.")
    architecture: ModelSpec = Field(default_factory=ModelSpec)


class ServingLimits(ApiModel):
    max_batch: int = Field(default=32, ge=1, le=4096, description="Requests decoded together at most.")
    max_tokens: int = Field(default=2048, ge=1, le=1 << 22)
    max_queued: int = Field(
        default=1024, ge=0, le=1 << 20,
        description="Rows (a request's prompts × n) waiting for a place in the batch at most, per "
                    "replica. A request that would queue past it is answered 429 with Retry-After (as "
                    "TGI's max_concurrent_requests does), and OpenAI's SDKs retry it after that: under "
                    "overload, clients back off instead of timing out in a queue that only grows, "
                    "and a retry through the Service may reach a replica that is not full. A request "
                    "finding the queue empty is always taken. 0: no bound.")
    prefix_cache_tokens: int = Field(
        default=8192, ge=0, le=1 << 24,
        description="Prompt-prefix tokens whose K/V each replica keeps for reuse (blocks of 16, least "
                    "recently used evicted): a prompt that starts like an earlier one is prefilled "
                    "only from where it differs. 0 keeps none.")
    prefill_chunk_tokens: int = Field(
        default=8192, ge=0, le=1 << 20,
        description="Prompt tokens prefilled before each decoding step at most (chunked prefill): a "
                    "long prompt that joins holds the answers being decoded for a chunk a step, not "
                    "for its whole prefill. Smaller values smooth the answers' token rate and delay "
                    "long prompts' first tokens. The default suits a GPU, where a prefill's forward "
                    "pass costs its kernel launches more than its tokens, so every extra chunk costs "
                    "a pass (vLLM's API server batches as many tokens); on a CPU, 64-256. 0 prefills "
                    "each joining prompt whole at once.")
    cuda_graphs: bool = Field(
        default=True,
        description="On a GPU, capture the decoding step as CUDA graphs when the replica starts (one "
                    "per bucket of rows, as vLLM does) and replay them: a step is hundreds of small "
                    "kernels whose launches from Python cost several times what they compute. "
                    "Dense models only (MoE routing is data-dependent); false decodes eagerly.")
    prefill_delay_factor: float = Field(
        default=0, ge=0, le=100,
        description="With `continuous` batching: while answers are being decoded, requests that "
                    "arrive join only once the oldest of them has waited this many times the last "
                    "prefill's iteration (vLLM's scheduler delay factor), or once enough wait to fill "
                    "every free row. Arrivals then share one prefill instead of each pausing the "
                    "answers for its own: where prefills cost a fixed overhead (eager prefills beside "
                    "CUDA-graphed steps) this raises throughput at the cost of first-token time. 0 "
                    "admits at the next step.")
    batching: Literal["continuous", "static"] = Field(
        default="continuous",
        description="`continuous`: a request joins the requests being decoded at the next step, and "
                    "each leaves as its answer ends (iteration-level scheduling). `static`: a batch "
                    "is decoded to its longest answer before the next one starts (request-level "
                    "batching, for comparison).")


class Routing(ApiModel):
    """How the job's Service spreads requests over the replicas."""

    policy: Literal["service", "prefix"] = Field(
        default="service",
        description="`service`: the Service's own spreading (kube-proxy). `prefix`: a router pod sends "
                    "each prompt to the replica that holds the most of its prefix in its cache, as "
                    "long as that replica is not loaded past loadFactor × the mean.")
    load_factor: float = Field(
        default=1.25, ge=1, le=4,
        description="With `prefix`: a replica takes a prompt for its cache only while its requests in "
                    "flight stay within loadFactor × the replicas' mean (consistent hashing with "
                    "bounded loads); 1 balances strictly, larger values favour the cache.")
    front_replicas: int = Field(
        default=1, ge=1, le=8,
        description="Pods of the job's front, which every request passes while it runs: the router "
                    "(policy prefix) and the activator (autoscaling.minReplicas 0). With 2 or more, "
                    "requests keep flowing through one pod's loss, the pods prefer different nodes, "
                    "and a new image or setting replaces them one at a time.")


@rules.attach(
    rules.Rule(
        name="quantization-glvq-bits",
        field="bits",
        cel="(self.method == 'glvq') == has(self.bits)",
        holds=lambda q: (q.method == "glvq") == (q.bits is not None),
        message="is required for method glvq, and only then",
        detail=lambda q: f"method {q.method}, bits {'set' if q.bits is not None else 'missing'}",
        fix="set bits (1-8) with method glvq, or remove bits with method none",
    ),
)
class Quantization(ApiModel):
    method: Literal["none", "glvq"] = "none"
    bits: int | None = Field(default=None, ge=1, le=8, description="Bits per weight for glvq.")
    group_size: int = Field(default=8, ge=2, le=256)


@rules.attach(
    rules.Rule(
        name="slo-needs-target",
        field="",
        cel="has(self.p99TimeToFirstTokenMs) || has(self.p99LatencyMs) || has(self.tokensPerSecond)",
        holds=lambda s: (s.p99_time_to_first_token_ms is not None or s.p99_latency_ms is not None
                         or s.tokens_per_second is not None),
        message="needs at least one target",
        fix="set p99TimeToFirstTokenMs, p99LatencyMs or tokensPerSecond",
    ),
)
class Slo(ApiModel):
    p99_time_to_first_token_ms: float | None = Field(
        default=None, gt=0, alias="p99TimeToFirstTokenMs",
        description="p99 from a request's arrival to its first token (queueing and prefill): what a "
        "streaming client waits, and what more replicas shorten. The default target (1000).")
    p99_latency_ms: float | None = Field(
        default=None, gt=0, alias="p99LatencyMs",
        description="p99 from arrival to the whole answer. Its length is set by max_tokens, which "
        "no replica count shortens: a target below one answer's duration keeps the job at "
        "maxReplicas.")
    tokens_per_second: float | None = Field(default=None, gt=0)


class ReplicaForecast(RateHistory):
    """Predictive scaling: the job's request rate forecast over the next 10 minutes (the FaPES
    prediction board, fitted on the rate's history in Prometheus) is a floor of the replica count,
    so replicas load before a rise rather than after it. A replica takes minutes to load a model;
    a reactive rule sees the rise only once it queues."""

    requests_per_replica: float = Field(
        gt=0, alias="requestsPerReplica",
        description="Requests per second one replica serves within the SLO (measure it with "
                    "benchmarks/serving_autoscale.py's probe, or from a replica's metrics at its limit).")


@rules.attach(
    rules.Rule(
        name="autoscaling-min-le-max",
        field="minReplicas",
        cel="self.minReplicas <= self.maxReplicas",
        holds=lambda a: a.min_replicas <= a.max_replicas,
        message="must be ≤ maxReplicas",
        detail=lambda a: f"{a.min_replicas} > {a.max_replicas}",
        fix="set minReplicas to at most maxReplicas, or raise maxReplicas",
    ),
)
class Autoscaling(ApiModel):
    """The operator scales replicas between the bounds on their requests in flight against their
    batch slots, with the SLO as floors (huorn.scheduler.autoscale, the HorizontalPodAutoscaler's
    rule)."""

    min_replicas: int = Field(default=1, ge=0, le=4096, description="Replicas kept even when idle. 0 "
                              "scales to zero after a whole scaleDownDelaySeconds without a request: an "
                              "activator pod then holds requests and wakes a replica for them.")
    max_replicas: int = Field(default=1, ge=1, le=4096)
    target_utilization: float = Field(default=0.7, gt=0, le=1, description="Share of each replica's "
                                      "batch slots (serving.maxBatch) kept in use: requests in flight per "
                                      "replica / maxBatch.")
    scale_down_delay_seconds: float = Field(
        default=300, ge=0, le=86400,
        description="A scale-down waits until the load of this whole window allows it; a rise is "
                    "applied at once.")
    activation_timeout_seconds: float = Field(
        default=600, ge=1, le=3600,
        description="Scaled to zero: how long the activator holds a request while the first replica "
                    "loads its model (then 503 with Retry-After). Allow the model's cold start.")
    forecast: ReplicaForecast | None = Field(
        default=None,
        description="Keep at least the replicas that the forecast peak request rate of the next 10 "
                    "minutes needs, as well as what the replicas measure now.")


# A replica told to stop keeps listening this long (the pod's preStop), while the endpoints drop it
# and kube-proxy stops sending it connections, then drains its requests in flight for at most
# SERVE_DRAIN_SECONDS; the pod's grace period covers both.
SERVE_PRESTOP_SECONDS = 5
SERVE_DRAIN_SECONDS = 30
# A replica loading its model is given at least this long, or the cold start the activator waits
# for (autoscaling.activationTimeoutSeconds) where that is longer, before its startup probe fails.
SERVE_STARTUP_SECONDS = 600


class InferenceJobSpec(JobBasics):
    model: ServedModel
    serving: ServingLimits = Field(default_factory=ServingLimits)
    quantization: Quantization = Field(default_factory=Quantization)
    # NB: the default carries a target, because an SLO without one is invalid.
    slo: Slo = Field(default_factory=lambda: Slo(p99_time_to_first_token_ms=1000.0))
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    routing: Routing = Field(default_factory=Routing)


class ReplicaForecastReading(RateReading):
    replicas: int = Field(ge=0, description="Replicas that peak needs: a floor of desiredReplicas.")


class InferenceJobStatus(JobStatus):
    p99_latency_ms: float | None = Field(default=None, alias="p99LatencyMs")
    p99_time_to_first_token_ms: float | None = Field(default=None, alias="p99TimeToFirstTokenMs")
    requests_per_second: float | None = None
    tokens_per_second: float | None = None
    utilization: float | None = Field(default=None, description="Share of the replicas' batch slots in use.")
    cached_prompt_share: float | None = Field(
        default=None, ge=0, le=1,
        description="Share of the last interval's prompt tokens whose K/V the replicas' prefix caches "
                    "gave (serving.prefixCacheTokens; routing.policy prefix raises it).")
    forecast: ReplicaForecastReading | None = Field(
        default=None, description="The prediction board's last reading, with spec.autoscaling.forecast.")
    desired_replicas: int | None = Field(default=None, description="Replicas the autoscaler asks for; "
                                         "their GPUs, with surgingReplicas', are what the virtual cluster "
                                         "keeps unlent.")
    surging_replicas: int | None = Field(
        default=None, ge=0,
        description="Replicas of an older spec a rolling update keeps serving until their successors "
                    "are ready (make before break); counted in readyReplicas and in the GPUs the "
                    "virtual cluster keeps unlent.")
    ready_replicas: int | None = None
    front_services: list[Literal["endpoints", "replicas"]] | None = Field(
        default=None, max_length=2,
        description="The Services that front pods read which may exist now: `<job>-endpoints` (routers) "
                    "and `<job>-replicas` (activators). One the spec no longer needs is deleted once no "
                    "front pod of the earlier settings is left.")
    routing: Literal["replicas", "activator", "router"] | None = Field(
        default=None, description="Where the job's Service sends requests now: the ready replicas, the "
                                  "activator that holds them while none is ready (scale to zero), or "
                                  "the prefix router (spec.routing.policy prefix, once it is ready).")
