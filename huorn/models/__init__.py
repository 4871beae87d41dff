"""Huorn's models: a decoder-only transformer with FusedKV cross-layer KV sharing and MoE
feed-forward layers with expert prototyping. Imports only torch and the standard library.

Public surface: `build_model(cfg) -> Decoder`, `ModelConfig`, `MoEConfig`, `KVCache`, `RaggedKVCache`,
`SharedKV`.
See docs/models.md for the calling conventions used by the trainer and the pipeline executor."""

from huorn.models.cache import KVCache, RaggedKVCache, SharedKV
from huorn.models.config import ConfigError, ModelConfig, MoEConfig
from huorn.models.decoder import Block, Decoder, build_model

__all__ = [
    "Block", "ConfigError", "Decoder", "KVCache", "MoEConfig", "ModelConfig", "RaggedKVCache", "SharedKV",
    "build_model",
]
