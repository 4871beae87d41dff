"""Plain configuration of Huorn's decoder. It imports only the standard library, so the
runtime, the pipeline executor and the benchmarks can all build models from it, and the API
layer can translate a TrainingJob's `model` section into it without models importing pydantic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

KvSharing = Literal["none", "fusedkv", "fusedkv-lite"]


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    prototypes: int = 1  # M6-T expert prototyping: k groups, top-1 in each; 1 means plain top-k
    top_k: int = 1  # plain top-k routing when prototypes == 1
    capacity_factor: float = 1.25
    balance_loss_weight: float = 0.01


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 4
    width: int = 128
    heads: int = 4
    kv_heads: int | None = None  # GQA when below heads; None means heads
    vocabulary: int = 256
    context: int = 128
    kv_sharing: KvSharing = "none"
    moe: MoEConfig | None = None
    ffn_multiplier: float = 8 / 3  # SwiGLU hidden = multiplier × width, rounded to a multiple of 8
    rope_theta: float = 10000.0
    dropout: float = 0.0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads
