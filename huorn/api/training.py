"""TrainingJob: pretraining, continual pretraining and distillation of Huorn's decoder."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from huorn.api import rules
from huorn.api.base import ApiModel, DnsLabel
from huorn.api.common import MAX_GPUS_PER_REPLICA, ElasticJobCommon, JobStatus, ResizeMode


class TaskKind(StrEnum):
    PRETRAIN = "pretrain"
    CPT = "cpt"
    DISTILL = "distill"


@rules.attach(
    rules.filesystem_path("teacher-checkpoint-is-a-path", "checkpoint", "checkpoint"),
)
class TeacherRef(ApiModel):
    checkpoint: str = Field(min_length=1, description="Path of the teacher's checkpoint directory (or "
                            "of a checkpoint root with a `latest`). In a pod it must lie on the job's "
                            "checkpoint volume, under spec.checkpoint.path.")
    temperature: float = Field(default=1.0, gt=0, le=100)
    kl_weight: float = Field(default=0.2, ge=0, le=100, description="γ in CE + γ·T²·KL (DDK).")
    reweight_steps: int = Field(default=1000, ge=1, le=10_000_000, description="K: with data.mixture auto, "
                                "the source weights are recomputed from the student's and teacher's "
                                "per-source validation losses every K steps (DDK).")
    reweight_smoothing: float = Field(default=0.5, gt=0, le=1, description="α in r ← α·ψ/Σψ + (1 − α)/N: "
                                      "below 1, every source keeps at least (1 − α)/N of the mix.")


@rules.attach(
    rules.Rule(
        name="task-teacher-iff-distill",
        field="teacher",
        cel="(self.kind == 'distill') == has(self.teacher)",
        holds=lambda t: (t.kind == TaskKind.DISTILL) == (t.teacher is not None),
        message="is required when kind is distill, and only then",
        detail=lambda t: f"kind is {t.kind.value}, teacher is {'set' if t.teacher else 'missing'}",
        fix="give teacher.checkpoint for distill, or remove teacher for pretrain and cpt",
    ),
    rules.Rule(
        name="task-cpt-init-checkpoint",
        field="initCheckpoint",
        cel="self.kind != 'cpt' || has(self.initCheckpoint)",
        holds=lambda t: t.kind != TaskKind.CPT or t.init_checkpoint is not None,
        message="is required when kind is cpt, since continual pre-training starts from existing "
        "weights",
        fix="set initCheckpoint to a checkpoint directory (or a checkpoint root with a `latest`), or "
        "use kind pretrain",
    ),
    rules.filesystem_path("task-init-checkpoint-is-a-path", "initCheckpoint", "init_checkpoint"),
)
class Task(ApiModel):
    kind: TaskKind = TaskKind.PRETRAIN
    teacher: TeacherRef | None = Field(default=None, description="Required when kind is distill.")
    init_checkpoint: str | None = Field(default=None, min_length=1, description="Starting weights for "
                                        "cpt: a checkpoint directory or root; in a pod, under "
                                        "spec.checkpoint.path on the checkpoint volume.")


class KvSharing(StrEnum):
    NONE = "none"
    FUSEDKV = "fusedkv"
    FUSEDKV_LITE = "fusedkv-lite"


@rules.attach(
    rules.Rule(
        name="moe-prototypes-divide-experts",
        field="prototypes",
        cel="self.experts % self.prototypes == 0",
        holds=lambda m: m.experts % m.prototypes == 0,
        message="must divide experts, so that every prototype holds the same number of experts",
        detail=lambda m: f"{m.experts} experts, {m.prototypes} prototypes",
        fix="choose prototypes among the divisors of experts",
    ),
    rules.Rule(
        name="moe-top-k",
        field="topK",
        cel="self.prototypes == 1 ? self.topK <= self.experts : self.topK == 1",
        holds=lambda m: m.top_k <= m.experts if m.prototypes == 1 else m.top_k == 1,
        message="must be 1 with prototypes (top-1 inside each prototype), otherwise ≤ experts",
        detail=lambda m: f"topK {m.top_k}, prototypes {m.prototypes}, experts {m.experts}",
        fix="set topK to 1 when prototypes > 1, or to at most experts with prototypes 1",
    ),
)
class MoE(ApiModel):
    experts: int = Field(ge=2, le=1024)
    prototypes: int = Field(default=1, ge=1, le=64, description="Expert groups (M6-T prototyping).")
    top_k: int = Field(default=1, ge=1, le=16, description="Experts per token (per prototype: 1).")
    capacity_factor: float = Field(default=1.25, gt=0, le=16)
    balance_loss_weight: float = Field(default=0.01, ge=0, le=10)


@rules.attach(
    rules.Rule(
        name="model-width-divisible-by-heads",
        field="width",
        cel="self.width % self.heads == 0",
        holds=lambda m: m.width % m.heads == 0,
        message="must be divisible by heads",
        detail=lambda m: f"{m.width} % {m.heads} = {m.width % m.heads}",
        fix="make width a multiple of heads",
    ),
    rules.Rule(
        name="model-head-dim-even",
        field="width",
        cel="self.width % self.heads != 0 || (self.width / self.heads) % 2 == 0",
        holds=lambda m: m.width % m.heads != 0 or (m.width // m.heads) % 2 == 0,
        message="divided by heads must be even, because rotary embeddings rotate channel pairs",
        detail=lambda m: f"head dimension {m.width // m.heads}",
        fix="make width a multiple of 2 × heads",
    ),
    rules.Rule(
        name="model-kv-heads-divide-heads",
        field="kvHeads",
        cel="!has(self.kvHeads) || self.heads % self.kvHeads == 0",
        holds=lambda m: m.kv_heads is None or m.heads % m.kv_heads == 0,
        message="must divide heads, so that query heads share key/value heads evenly",
        detail=lambda m: f"{m.heads} heads, {m.kv_heads} kvHeads",
        fix="choose kvHeads among the divisors of heads, or leave it out for plain attention",
    ),
    rules.Rule(
        name="model-kv-sharing-layers",
        field="kvSharing",
        cel="self.kvSharing == 'none' || self.layers >= 2",
        holds=lambda m: m.kv_sharing == KvSharing.NONE or m.layers >= 2,
        message="needs at least 2 layers, since the upper half of the layers reuses the lower half's KV",
        detail=lambda m: f"{m.layers} layer",
        fix="use kvSharing none, or 2 or more layers",
    ),
)
class ModelSpec(ApiModel):
    layers: int = Field(default=4, ge=1, le=256)
    width: int = Field(default=128, ge=8, le=65536, description="Hidden size (d_model).")
    heads: int = Field(default=4, ge=1, le=512)
    kv_heads: int | None = Field(default=None, ge=1, le=512, description="GQA key/value heads.")
    vocabulary: int = Field(default=256, ge=2, le=1048576)
    context: int = Field(default=128, ge=2, le=1048576, description="Sequence length.")
    kv_sharing: KvSharing = KvSharing.NONE
    moe: MoE | None = None


class DataSource(ApiModel):
    name: DnsLabel = Field(description="A corpus: code, general or math, or a path.")
    weight: float = Field(default=1.0, ge=0, le=1e6)
    path: str | None = None


ProbeRatio = Annotated[float, Field(gt=0, lt=1)]


@rules.attach(
    rules.Rule(
        name="plan-probe-ratios-distinct",
        field="probeRatios",
        cel="self.probeRatios.all(r, self.probeRatios.exists_one(q, q == r))",
        holds=lambda p: len(set(p.probe_ratios)) == len(p.probe_ratios),
        message="must be distinct: each probe trains at its own domain share",
        detail=lambda p: ", ".join(f"{r:g}" for r in p.probe_ratios),
        fix="remove the repeated ratios",
    ),
)
class MixturePlan(ApiModel):
    """D-CPT: short probe runs at several domain shares fit the D-CPT law, which then picks the
    share for the whole run (docs/runtime.md, "Mixture planning")."""

    domain: DnsLabel = Field(description="The source whose share is planned; the other sources form the "
                             "general corpus, in the proportions of their weights.")
    general_tolerance: float = Field(
        default=0.02, ge=0, le=1, description="T: the planned share keeps the predicted general loss "
        "within (1 + T) of a run on the general corpus alone; the lowest predicted domain loss within "
        "that bound wins.")
    probe_ratios: list[ProbeRatio] = Field(
        default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9], min_length=3, max_length=16,
        description="Domain shares of the probe runs, each in (0, 1).")
    probe_steps: int = Field(default=200, ge=4, le=1_000_000, description="Optimizer steps of each probe.")
    probe_evaluations: int = Field(default=4, ge=2, le=64, description="Validation points along each "
                                   "probe: the law's token axis.")


@rules.attach(
    rules.Rule(
        name="data-source-names-unique",
        field="sources",
        cel="self.sources.all(s, self.sources.exists_one(t, t.name == s.name))",
        holds=lambda d: len({s.name for s in d.sources}) == len(d.sources),
        message="must have distinct names",
        detail=lambda d: ", ".join(s.name for s in d.sources),
        fix="merge sources of the same name or rename one",
    ),
    rules.Rule(
        name="data-manual-weights",
        field="sources",
        cel="self.mixture == 'auto' || self.sources.exists(s, s.weight > 0.0)",
        holds=lambda d: d.mixture == "auto" or any(s.weight > 0 for s in d.sources),
        message="need at least one positive weight when mixture is manual",
        detail=lambda d: "all weights are 0",
        fix="give a source a weight above 0, or set mixture: auto",
    ),
    rules.Rule(
        name="data-plan-domain-and-general",
        field="plan.domain",
        cel=("!has(self.plan) || (self.sources.exists(s, s.name == self.plan.domain) && "
             "self.sources.exists(s, s.name != self.plan.domain && s.weight > 0.0))"),
        holds=lambda d: d.plan is None or (
            any(s.name == d.plan.domain for s in d.sources)
            and any(s.name != d.plan.domain and s.weight > 0 for s in d.sources)),
        message="must name one of data.sources, and another source of weight > 0 must remain as the "
        "general corpus",
        detail=lambda d: f"domain {d.plan.domain if d.plan else None}, sources "
        f"{', '.join(f'{s.name}={s.weight:g}' for s in d.sources)}",
        fix="set plan.domain to a listed source and give at least one other source a positive weight",
    ),
)
class DataSpec(ApiModel):
    sources: list[DataSource] = Field(
        default_factory=lambda: [DataSource(name="general")], min_length=1, max_length=64
    )
    mixture: Literal["manual", "auto"] = Field(
        default="manual", description="auto: with task.kind distill, DDK reweights the sources at run "
        "time from the student's gap to the teacher (the listed weights are then ignored); otherwise "
        "data.plan's D-CPT probes choose the domain's share before training.",
    )
    plan: MixturePlan | None = Field(default=None, description="D-CPT mixture planning, with mixture "
                                     "auto for pretrain and cpt.")
    seed: int = Field(default=0, ge=0)


class LrSchedule(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class BatchRule(StrEnum):
    """What happens to the batch when the replica count changes."""

    FIXED_GLOBAL = "fixed-global"  # keep the global batch, adjust gradient accumulation
    SCALE_WITH_REPLICAS = "scale-with-replicas"  # batch ∝ replicas, lr by the square-root rule
    GOODPUT = "goodput"  # the allocator picks the batch with the replicas (AdaScale progress)


@rules.attach(
    rules.Rule(
        name="optimization-steps-or-tokens",
        field="steps",
        cel="has(self.steps) || has(self.tokens)",
        holds=lambda o: o.steps is not None or o.tokens is not None,
        message="is missing and so is tokens, so training would never end",
        fix="set steps (optimizer steps) or tokens (training tokens)",
    ),
    rules.Rule(
        name="optimization-micro-le-global",
        field="microBatch",
        cel="self.microBatch <= self.globalBatch",
        holds=lambda o: o.micro_batch <= o.global_batch,
        message="must be ≤ globalBatch",
        detail=lambda o: f"{o.micro_batch} > {o.global_batch}",
        fix="lower microBatch or raise globalBatch",
    ),
    rules.Rule(
        # A step's global batch is split into whole micro-batches, dealt round-robin to the ranks
        # (runtime.batching), so a trainer refuses anything else at start; the API refuses it
        # first, before a gang is placed.
        # A microBatch above globalBatch is the rule above's to report, not this one's.
        name="optimization-global-multiple-of-micro",
        field="globalBatch",
        cel="self.microBatch > self.globalBatch || self.globalBatch % self.microBatch == 0",
        holds=lambda o: o.micro_batch > o.global_batch or o.global_batch % o.micro_batch == 0,
        message="must be a multiple of microBatch",
        detail=lambda o: f"{o.global_batch} % {o.micro_batch} = {o.global_batch % o.micro_batch}",
        fix="make globalBatch a multiple of microBatch, or change microBatch",
    ),
)
class Optimization(ApiModel):
    global_batch: int = Field(default=16, ge=1, le=1 << 24, description="Sequences per optimizer step.")
    micro_batch: int = Field(default=4, ge=1, le=1 << 20, description="Sequences per forward pass.")
    learning_rate: float = Field(default=3e-3, gt=0, le=10)
    schedule: LrSchedule = LrSchedule.COSINE
    warmup_steps: int = Field(default=10, ge=0)
    weight_decay: float = Field(default=0.1, ge=0, le=10)
    steps: int | None = Field(default=None, ge=1, description="Optimizer steps; or set tokens.")
    tokens: int | None = Field(default=None, ge=1, description="Training tokens; or set steps.")
    batch_rule: BatchRule = BatchRule.FIXED_GLOBAL


class PipelineSchedule(StrEnum):
    ONE_F_ONE_B = "1f1b"
    KFKB = "kfkb"
    GPIPE = "gpipe"
    AUTO = "auto"


@rules.attach(
    rules.Rule(
        name="parallelism-k-needs-kfkb",
        field="k",
        cel="self.schedule == 'kfkb' || self.k == 1",
        holds=lambda p: p.schedule == PipelineSchedule.KFKB or p.k == 1,
        message="must be 1 unless schedule is kfkb",
        detail=lambda p: f"k {p.k} with schedule {p.schedule.value}",
        fix="set schedule: kfkb, or k: 1",
    ),
)
class Parallelism(ApiModel):
    pipeline_stages: int = Field(default=1, ge=1, le=128)
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    k: int = Field(default=1, ge=1, le=64, description="Micro-batches per group in kFkB.")


@rules.attach(
    rules.Rule(
        name="training-stages-le-layers",
        field="parallelism.pipelineStages",
        cel="self.parallelism.pipelineStages <= self.model.layers",
        holds=lambda s: s.parallelism.pipeline_stages <= s.model.layers,
        message="must be ≤ model.layers, since every stage holds at least one layer",
        detail=lambda s: f"{s.parallelism.pipeline_stages} > {s.model.layers}",
        fix="lower pipelineStages or add layers",
    ),
    rules.Rule(
        name="training-fixed-batch-divisible",
        field="optimization.globalBatch",
        cel=(
            "self.elasticity.policy != 'fixed' || self.optimization.globalBatch % "
            "(self.optimization.microBatch * self.elasticity.minReplicas) == 0"
        ),
        holds=lambda s: s.elasticity.policy != "fixed"
        or s.optimization.global_batch % (s.optimization.micro_batch * s.elasticity.min_replicas) == 0,
        message="must be divisible by microBatch × minReplicas when elasticity.policy is fixed",
        detail=lambda s: (
            f"{s.optimization.global_batch} % ({s.optimization.micro_batch} × {s.elasticity.min_replicas})"
            f" = {s.optimization.global_batch % (s.optimization.micro_batch * s.elasticity.min_replicas)}"
        ),
        fix="make globalBatch a multiple of microBatch × minReplicas, or use policy goodput",
    ),
    rules.Rule(
        name="training-in-place-one-process",
        field="elasticity.resize",
        cel=(
            "self.elasticity.resize != 'inPlace' || "
            "(self.parallelism.pipelineStages == 1 && self.resources.gpus <= 1)"
        ),
        holds=lambda s: s.elasticity.resize != ResizeMode.IN_PLACE
        or is_one_process_per_replica(s.parallelism.pipeline_stages, s.resources.gpus),
        message=(
            "can be inPlace only when a replica is one trainer process (parallelism.pipelineStages 1 "
            "and resources.gpus ≤ 1), since in-place resizing carries one process's state"
        ),
        detail=lambda s: f"pipelineStages {s.parallelism.pipeline_stages}, gpus {s.resources.gpus}",
        fix="use resize: restart (or auto, which picks restart here), or set pipelineStages to 1 and "
        "gpus to at most 1",
    ),
    rules.Rule(
        name="training-distill-data-parallel",
        field="parallelism.pipelineStages",
        cel="self.task.kind != 'distill' || self.parallelism.pipelineStages == 1",
        holds=lambda s: s.task.kind != TaskKind.DISTILL or s.parallelism.pipeline_stages == 1,
        message="must be 1 when task.kind is distill: distillation runs data-parallel, since the "
        "teacher's logits are needed where the student's last layer is",
        detail=lambda s: f"pipelineStages {s.parallelism.pipeline_stages}",
        fix="set pipelineStages to 1 (scale with more replicas instead)",
    ),
    rules.Rule(
        name="training-auto-mixture-has-a-method",
        field="data.mixture",
        cel="self.data.mixture != 'auto' || self.task.kind == 'distill' || has(self.data.plan)",
        holds=lambda s: s.data.mixture != "auto" or s.task.kind == TaskKind.DISTILL
        or s.data.plan is not None,
        message="can be auto only with a method: DDK's reweighting (task.kind distill) or D-CPT "
        "planning (data.plan)",
        detail=lambda s: f"task.kind {s.task.kind.value}, no data.plan",
        fix="add data.plan with the domain source, or set mixture: manual and give the weights",
    ),
    rules.Rule(
        name="training-plan-needs-auto-without-distill",
        field="data.plan",
        cel="!has(self.data.plan) || (self.data.mixture == 'auto' && self.task.kind != 'distill')",
        holds=lambda s: s.data.plan is None or (s.data.mixture == "auto" and s.task.kind != TaskKind.DISTILL),
        message="applies only with mixture auto and task.kind pretrain or cpt (distillation's mix "
        "follows DDK)",
        detail=lambda s: f"mixture {s.data.mixture}, task.kind {s.task.kind.value}",
        fix="set mixture: auto, or remove data.plan",
    ),
)
class TrainingJobSpec(ElasticJobCommon):
    task: Task = Field(default_factory=Task)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    # NB: the default carries steps, because an Optimization without steps or tokens is invalid.
    optimization: Optimization = Field(default_factory=lambda: Optimization(steps=100))
    parallelism: Parallelism = Field(default_factory=Parallelism)
    suspend: bool = Field(
        default=False,
        description="True stops every pod of the job and frees its GPUs: trainers get SIGTERM and "
        "checkpoint first. False again resumes it from that checkpoint, at the replicas it had. "
        "A job created with suspend true waits without pods (what Kubernetes Jobs, JobSet, Kubeflow "
        "and Kueue call suspend).",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1, le=31_536_000,
        description="The job fails (reason DeadlineExceeded) once it has run this long since "
        "status.startTime; its pods get SIGTERM and checkpoint first. A resume starts the clock "
        "again, as for a Kubernetes Job.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0, le=31_536_000,
        description="Delete the TrainingJob (and so its pods, Service and ConfigMap) this long "
        "after status.completionTime; unset keeps it. Under GitOps that re-applies deleted "
        "objects, leave it unset: a re-applied job would run again.",
    )


def approximate_parameters(model: ModelSpec) -> int:
    """The decoder's parameters, to the few per cent that set a performance prior's scale
    (huorn.models counts them exactly, but importing torch is not the control plane's to do):
    per layer the attention's four projections (K and V at the GQA width) and the SwiGLU's
    three (width × 8/3, in multiples of 8), an MoE layer's once per expert plus its router; the
    embedding and the output head once each."""
    head = model.width // model.heads
    kv = head * (model.kv_heads or model.heads)
    attention = 2 * model.width * model.width + 2 * model.width * kv
    ffn = 3 * model.width * max(8, math.ceil(8 / 3 * model.width / 8) * 8)
    if model.moe is not None:
        ffn = ffn * model.moe.experts + model.width * model.moe.experts
    return model.layers * (attention + ffn) + 2 * model.vocabulary * model.width


def declared_steps(spec: TrainingJobSpec) -> int:
    """Optimizer steps of the whole run as the spec declares them: `steps`, or `tokens` over the
    tokens of one step at the spec's globalBatch (globalBatch × context), rounded up: the job's
    length where steps must stand for it (the allocator's JCT terms). Under a token budget they
    are exact only while the global batch is the spec's: the trainer stops on the tokens it
    trained (token_budget), so a batch grown by `scale-with-replicas` ends it in fewer steps,
    and the operator's progress and the work left read the tokens instead."""
    opt = spec.optimization
    if opt.steps is not None:
        return int(opt.steps)
    assert opt.tokens is not None  # the optimization-steps-or-tokens rule
    return max(1, math.ceil(opt.tokens / (opt.global_batch * spec.model.context)))


def token_budget(spec: TrainingJobSpec) -> int | None:
    """The tokens that end the run when they, not steps, are its budget (`steps` wins when both
    are set, as in declared_steps); None for a budget in steps, except under batchRule goodput,
    where `steps` are counted as tokens of globalBatch. A step's tokens are its global batch ×
    context, and the global batch may change during the run (batchRule scale-with-replicas or
    goodput, an edited globalBatch), so only the tokens trained so far tell how far such a run is."""
    opt = spec.optimization
    if opt.steps is None and opt.tokens is not None:
        return int(opt.tokens)
    if opt.batch_rule == BatchRule.GOODPUT and opt.steps is not None:
        # the allocator changes the batch and AdaScale counts each step's progress in steps of
        # globalBatch: `steps` of it are as many tokens of it (huorn.runtime.batching)
        return int(opt.steps) * opt.global_batch * spec.model.context
    return None


def processes_per_replica(pipeline_stages: int, gpus: int) -> int:
    """Trainer processes (ranks) in one replica: one per GPU of a pod, or, in a replica without
    GPUs, one per pipeline stage, as a local replica runs them. Each pipeline lies inside one
    replica, so a pod's GPUs hold whole pipelines (`gpu_pipeline_problem`); a CPU pod of a 2-stage
    job ran one process, which left half a pipeline in each pod and a gang of an odd number of pods
    that could not start."""
    return gpus if gpus > 0 else pipeline_stages


def gpu_pipeline_problem(spec: TrainingJobSpec) -> str | None:
    """Why a pod's GPUs cannot hold whole pipelines (None when they can). Not a CRD rule: a local
    run starts one process per stage whatever `gpus` says (the field's default is 1), so
    `huorn run` accepts what a cluster cannot place; the operator and `huorn validate` refuse it."""
    gpus, stages = spec.resources.gpus, spec.parallelism.pipeline_stages
    if gpus == 0 or gpus % stages == 0:
        return None
    fits = list(range(stages, MAX_GPUS_PER_REPLICA + 1, stages))
    gpus_fix = f"set gpus to one of {fits}" if fits else f"use at most {MAX_GPUS_PER_REPLICA} stages"
    return (f"spec.resources.gpus: a pod runs one pipeline stage on each of its GPUs, so its {gpus} "
            f"GPU(s) must be a multiple of spec.parallelism.pipelineStages ({stages}); {gpus_fix}, "
            f"or set pipelineStages to a divisor of {gpus}")


def is_one_process_per_replica(pipeline_stages: int, gpus: int) -> bool:
    """Whether a trainer replica runs as a single process, locally (a process per stage) and in a
    pod (a process per GPU) alike. In-place resizing (huorn.runtime.membership) carries exactly
    one process's state across a membership change."""
    return pipeline_stages == 1 and gpus <= 1


def resolve_resize(spec: TrainingJobSpec) -> ResizeMode:
    """`spec.elasticity.resize` with `auto` decided: inPlace when a replica is one process, since
    that keeps the survivors' processes and state through joins, leaves and lost gloo peers;
    restart otherwise, the only mode that can rebuild a multi-process replica."""
    chosen = spec.elasticity.resize
    if chosen != ResizeMode.AUTO:
        return chosen
    one = is_one_process_per_replica(spec.parallelism.pipeline_stages, spec.resources.gpus)
    return ResizeMode.IN_PLACE if one else ResizeMode.RESTART


class EvaluationSummary(ApiModel):
    """One line of status.evaluations: the short history next to the full newest result."""

    step: int
    phase: Literal["Succeeded", "Failed"]
    loss: float | None = None


class EvaluationResult(EvaluationSummary):
    """The newest eval pod's result (huorn.operator.evaluation.build_result), bounded in size."""

    pod: str = Field(max_length=253)
    checkpoint: str = Field(default="", max_length=1024)
    time: str | None = None
    perplexity: float | None = None
    sources: dict[str, float] = Field(default_factory=dict, max_length=16,
                                      description="Loss per data source (at most 16; see sourcesOmitted).")
    sources_omitted: int | None = None
    message: str | None = Field(default=None, max_length=1024)


class TrainingJobStatus(JobStatus):
    step: int = 0
    spec_change_refused: str | None = Field(
        default=None, description="Why an edit of the spec is not applied to the running gang (spec.model: "
                                  "its checkpoints hold the architecture it started with), and what to do.")
    start_time: str | None = Field(default=None, description="When the gang was first placed, or placed "
                                   "again by a resume (RFC 3339); spec.activeDeadlineSeconds counts from "
                                   "here.")
    completion_time: str | None = Field(default=None, description="When the job Succeeded or Failed "
                                        "(RFC 3339); spec.ttlSecondsAfterFinished counts from here.")
    last_evaluation: EvaluationResult | None = Field(
        default=None, description="The newest eval pod's result (job annotated huorn.io/eval).")
    evaluations: list[EvaluationSummary] = Field(default_factory=list, max_length=8)
    resplit_version: int | None = Field(default=None, description="Graph version of the last S3 stage "
                                        "re-split whose gang roll was started.")
    resplit_replacements: int | None = Field(default=None, description="Trainer pods replaced by S3 "
                                             "rolls; they do not count against the restart budget.")
    preempt_replacements: int | None = Field(default=None, description="Trainer pods replaced because a "
                                             "lender reclaimed its GPUs; they do not count against the "
                                             "restart budget.")
    restarts_used: int | None = Field(default=None, ge=0, description="Pod replacements spent from "
                                      "spec.remediation.maxRestarts.")
    ignored_failures: int | None = Field(default=None, ge=0, description="Failed pods replaced under an "
                                         "Ignore rule of spec.remediation.podFailurePolicy; they do not "
                                         "count against the restart budget.")
    control_version: int | None = Field(default=None, description="Graph version of the run-time control "
                                        "(remediation S2's micro-batch counts) last written to the job's "
                                        "ConfigMap.")
    loss: float | None = None
    tokens_per_second: float | None = None
    progress_percent: int | None = Field(
        default=None, ge=0, le=100, description="Percent of the budget the spec declares that "
        "is trained: steps done of optimization.steps, or tokens trained of optimization.tokens "
        "(each step's global batch × context, which batchRule scale-with-replicas grows with the "
        "gang).")
    estimated_remaining_seconds: int | None = Field(
        default=None, ge=0, description="The steps or tokens of the budget left, at the rate seen "
        "since the previous progress write (resize and restart pauses included); absent while no "
        "rate is known.")
    estimated_remaining: str | None = Field(
        default=None, max_length=16, description="estimatedRemainingSeconds for people ('1h05m'): the "
        "ETA column of `kubectl get tj`.")
    batch_size: int | None = Field(
        default=None, ge=1, description="The global batch the newest step trained with: the "
        "optimization.batchRule's for the gang's size (the goodput allocator chooses both).")
    learning_rate: float | None = Field(
        default=None, ge=0, description="The learning rate of that step: scaled with the batch by "
        "the rule, then warmed up and scheduled.")
