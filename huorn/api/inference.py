"""InferenceJob: replicas of a Huorn model behind a router, scaled to an SLO."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from huorn.api.base import ApiModel
from huorn.api.common import JobCommon, JobStatus
from huorn.api.training import ModelSpec


class ServedModel(ApiModel):
    checkpoint: str = Field(min_length=1, description="Path or URI of the checkpoint to serve.")
    architecture: ModelSpec = Field(default_factory=ModelSpec)


class ServingLimits(ApiModel):
    max_batch: int = Field(default=32, ge=1, le=4096)
    max_tokens: int = Field(default=2048, ge=1, le=1 << 22)


class Quantization(ApiModel):
    method: Literal["none", "glvq"] = "none"
    bits: int | None = Field(default=None, ge=1, le=8, description="Bits per weight for glvq.")
    group_size: int = Field(default=8, ge=2, le=256)


class Slo(ApiModel):
    p99_latency_ms: float | None = Field(default=None, gt=0, alias="p99LatencyMs")
    tokens_per_second: float | None = Field(default=None, gt=0)


class Autoscaling(ApiModel):
    min_replicas: int = Field(default=1, ge=0, le=4096)
    max_replicas: int = Field(default=1, ge=1, le=4096)


class InferenceJobSpec(JobCommon):
    model: ServedModel
    serving: ServingLimits = Field(default_factory=ServingLimits)
    quantization: Quantization = Field(default_factory=Quantization)
    slo: Slo = Field(default_factory=Slo)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)


class InferenceJobStatus(JobStatus):
    p99_latency_ms: float | None = Field(default=None, alias="p99LatencyMs")
    requests_per_second: float | None = None
