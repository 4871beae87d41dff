"""Plain configuration of Huorn's decoder. It imports only the standard library, so the
runtime, the pipeline executor and the benchmarks can all build models from it, and the API
layer can translate a TrainingJob's `model` section into it without models importing pydantic.

Validation happens in `__post_init__` so that a bad config fails where it is written, with a
message naming the field, rather than deep inside a matmul with a shape error."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, get_args

KvSharing = Literal["none", "fusedkv", "fusedkv-lite"]


class ConfigError(ValueError):
    """A model config field is invalid; the message names the field and the fix."""


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    prototypes: int = 1  # M6-T expert prototyping: k groups, top-1 in each; 1 means plain top-k
    top_k: int = 1  # plain top-k routing when prototypes == 1
    capacity_factor: float = 1.25
    balance_loss_weight: float = 0.01
    # NOTE: capacity is a training-time device. At eval time tokens are only dropped when this is
    # set, because dropping makes a token's output depend on the rest of the batch, and then
    # cached decoding could no longer equal the full forward pass.
    eval_capacity_factor: float | None = None

    def __post_init__(self) -> None:
        if self.experts < 1:
            raise ConfigError(f"moe.experts={self.experts}: must be at least 1")
        if self.prototypes < 1 or self.experts % self.prototypes:
            raise ConfigError(
                f"moe.prototypes={self.prototypes}: must be >= 1 and divide moe.experts={self.experts}"
            )
        if self.prototypes > 1 and self.top_k != 1:
            raise ConfigError(
                f"moe.top_k={self.top_k}: with prototypes > 1 each group routes top-1; set top_k=1"
            )
        if not 1 <= self.top_k <= self.experts:
            raise ConfigError(f"moe.top_k={self.top_k}: must lie in 1..moe.experts={self.experts}")
        if not self.capacity_factor > 0:
            raise ConfigError(f"moe.capacity_factor={self.capacity_factor}: must be > 0, e.g. 1.25")
        if self.eval_capacity_factor is not None and not self.eval_capacity_factor > 0:
            raise ConfigError(
                f"moe.eval_capacity_factor={self.eval_capacity_factor}: must be > 0 or None (no limit)"
            )
        if self.balance_loss_weight < 0:
            raise ConfigError(f"moe.balance_loss_weight={self.balance_loss_weight}: must be >= 0")

    @property
    def experts_per_token(self) -> int:
        """How many experts process each token: k groups with prototyping, else top_k."""
        return self.prototypes if self.prototypes > 1 else self.top_k


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

    def __post_init__(self) -> None:
        for name in ("layers", "width", "heads", "vocabulary", "context"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)}: must be at least 1")
        if self.width % self.heads:
            raise ConfigError(f"width={self.width}: must be a multiple of heads={self.heads}")
        if self.head_dim % 2:
            raise ConfigError(
                f"width/heads={self.head_dim}: RoPE rotates channel pairs, so the head size must be even"
            )
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ConfigError(f"kv_heads={self.kv_heads}: must be >= 1 and divide heads={self.heads}")
        if self.kv_sharing not in get_args(KvSharing):
            raise ConfigError(f"kv_sharing={self.kv_sharing!r}: must be one of {get_args(KvSharing)}")
        if self.kv_sharing != "none" and (self.layers < 2 or self.layers % 2):
            raise ConfigError(
                f"layers={self.layers}: kv_sharing={self.kv_sharing!r} splits the stack in two halves, "
                "so layers must be even and at least 2"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout}: must lie in [0, 1)")
        if not self.ffn_multiplier > 0:
            raise ConfigError(f"ffn_multiplier={self.ffn_multiplier}: must be > 0")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta}: must be > 0")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def ffn_hidden(self) -> int:
        return max(8, math.ceil(self.ffn_multiplier * self.width / 8) * 8)

    @property
    def shared_layers(self) -> int:
        """n = L/2 in the FusedKV paper: layers below it compute and cache their own K and V."""
        return self.layers // 2 if self.kv_sharing != "none" else self.layers

    def owns_kv(self, layer: int) -> bool:
        """Whether 0-based `layer` computes (and caches) its own K and V."""
        return layer < self.shared_layers
