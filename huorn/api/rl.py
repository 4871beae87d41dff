"""RLJob: ROLL-style reinforcement learning with verifiable rewards (GRPO, DAPO, Lite PPO)."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from huorn.api.base import ApiModel, DnsLabel
from huorn.api.common import JobCommon, JobStatus
from huorn.api.training import ModelSpec


class Role(ApiModel):
    replicas: int = Field(default=1, ge=0, le=4096)
    gpus_per_replica: int = Field(default=1, ge=0, le=16)
    colocation_group: DnsLabel | None = Field(
        default=None, description="Roles in one group share the same GPUs, offloading in turn."
    )
    device_mapping: list[int] | None = Field(
        default=None, description="GPU indices this role uses inside its colocation group."
    )


class Roles(ApiModel):
    actor_train: Role = Field(default_factory=Role)
    rollout: Role = Field(default_factory=Role)
    reference: Role | None = None
    reward: Role | None = None
    environment: Role | None = None


class Algorithm(StrEnum):
    GRPO = "grpo"
    DAPO = "dapo"
    LITE_PPO = "lite-ppo"
    PPO = "ppo"


class Normalisation(StrEnum):
    GROUP = "group"
    BATCH = "batch"
    NONE = "none"


class AlgorithmSpec(ApiModel):
    name: Algorithm = Algorithm.GRPO
    group_size: int = Field(default=8, ge=1, le=1024, description="Responses sampled per prompt.")
    clip_low: float = Field(default=0.2, gt=0, lt=1)
    clip_high: float = Field(default=0.2, gt=0, lt=10)
    kl_coefficient: float = Field(default=0.0, ge=0, le=10)
    advantage_mean: Normalisation = Normalisation.GROUP
    advantage_std: Normalisation = Normalisation.GROUP
    loss_aggregation: Literal["token", "sequence"] = "sequence"
    dynamic_sampling: bool = False
    overlong_max_length: int | None = Field(default=None, ge=1, description="L_max of DAPO shaping.")
    overlong_buffer: int | None = Field(default=None, ge=1, description="L_cache of DAPO shaping.")


class RewardSpec(ApiModel):
    type: Literal["math-exact", "code-tests", "format"] = "math-exact"
    dataset: str = Field(default="arithmetic", min_length=1)


class RolloutSpec(ApiModel):
    max_new_tokens: int = Field(default=64, ge=1, le=1 << 20)
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)


class RLJobSpec(JobCommon):
    model: ModelSpec = Field(default_factory=ModelSpec)
    roles: Roles = Field(default_factory=Roles)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    steps: int = Field(default=100, ge=1)
    gpus: int | None = Field(default=None, ge=0, description="GPUs the job holds, shared by colocated roles.")


class RLJobStatus(JobStatus):
    step: int = 0
    mean_reward: float | None = None
