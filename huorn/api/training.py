"""TrainingJob: pretraining, continual pretraining and distillation of Huorn's decoder."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from huorn.api.base import ApiModel, DnsLabel
from huorn.api.common import JobCommon, JobStatus


class TaskKind(StrEnum):
    PRETRAIN = "pretrain"
    CPT = "cpt"
    DISTILL = "distill"


class TeacherRef(ApiModel):
    checkpoint: str = Field(min_length=1, description="Path or URI of the teacher's checkpoint.")
    temperature: float = Field(default=1.0, gt=0, le=100)
    kl_weight: float = Field(default=0.2, ge=0, le=100, description="γ in CE + γ·KL (DDK).")


class Task(ApiModel):
    kind: TaskKind = TaskKind.PRETRAIN
    teacher: TeacherRef | None = Field(default=None, description="Required when kind is distill.")
    init_checkpoint: str | None = Field(default=None, description="Starting weights for cpt.")


class KvSharing(StrEnum):
    NONE = "none"
    FUSEDKV = "fusedkv"
    FUSEDKV_LITE = "fusedkv-lite"


class MoE(ApiModel):
    experts: int = Field(ge=2, le=1024)
    prototypes: int = Field(default=1, ge=1, le=64, description="Expert groups (M6-T prototyping).")
    top_k: int = Field(default=1, ge=1, le=16, description="Experts per token (per prototype: 1).")
    capacity_factor: float = Field(default=1.25, gt=0, le=16)
    balance_loss_weight: float = Field(default=0.01, ge=0, le=10)


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


class DataSpec(ApiModel):
    sources: list[DataSource] = Field(
        default_factory=lambda: [DataSource(name="general")], min_length=1, max_length=64
    )
    mixture: Literal["manual", "auto"] = Field(
        default="manual", description="auto: D-CPT/DDK picks the weights at run time."
    )
    seed: int = Field(default=0, ge=0)


class LrSchedule(StrEnum):
    CONSTANT = "constant"
    COSINE = "cosine"
    LINEAR = "linear"


class BatchRule(StrEnum):
    """What happens to the batch when the replica count changes."""

    FIXED_GLOBAL = "fixed-global"  # keep the global batch, adjust gradient accumulation
    SCALE_WITH_REPLICAS = "scale-with-replicas"  # batch ∝ replicas, lr by the square-root rule
    GOODPUT = "goodput"  # the scheduler picks batch and lr together (AdaScale)


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


class Parallelism(ApiModel):
    pipeline_stages: int = Field(default=1, ge=1, le=128)
    schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    k: int = Field(default=1, ge=1, le=64, description="Micro-batches per group in kFkB.")


class TrainingJobSpec(JobCommon):
    task: Task = Field(default_factory=Task)
    model: ModelSpec = Field(default_factory=ModelSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    optimization: Optimization = Field(default_factory=Optimization)
    parallelism: Parallelism = Field(default_factory=Parallelism)


class TrainingJobStatus(JobStatus):
    step: int = 0
    loss: float | None = None
    tokens_per_second: float | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
