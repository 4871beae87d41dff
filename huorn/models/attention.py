"""Causal self-attention with the three KV-sharing modes of the FusedKV paper (arXiv 2512.03870).

With L layers and n = L/2, layers 1..n (0-based 0..n-1 here) project their own K and V. Layers
above n project only Q and rebuild K and V from layer 1 and layer n:
  - fusedkv:      K_i = a_i1 ⊙ K_1 + a_in ⊙ K_n,  V_i = b_i1 ⊙ V_1 + b_in ⊙ V_n
  - fusedkv-lite: K_i = K_n,                      V_i = V_1
K is fused after RoPE, so the upper layers never re-rotate. The weight of a key channel is shared
by both channels of its rotary pair: a scalar times a 2-D rotation commutes with the rotation,
so the fused key of position s is still R_s times a fixed vector and the scores keep depending
on relative position only. Values are not rotated and get one weight per channel."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from huorn.models import layers as model_layers
from huorn.models.cache import KVCache, SharedKV
from huorn.models.config import ModelConfig


def expand_pair_weight(weight: torch.Tensor) -> torch.Tensor:
    """[kv_heads, D/2] -> [kv_heads, 1, D]: channel j and j + D/2 (one rotary pair) get weight j."""
    return torch.cat([weight, weight], dim=-1).unsqueeze(1)


def build_causal_mask(queries: int, keys: int, device: torch.device) -> torch.Tensor:
    """Boolean [queries, keys] mask for queries that are the last `queries` of `keys` positions."""
    offset = keys - queries
    q_pos = torch.arange(queries, device=device).unsqueeze(1) + offset
    k_pos = torch.arange(keys, device=device).unsqueeze(0)
    return k_pos <= q_pos


# Attention against a KV cache (decoding, a prefill) meets a new shape at nearly every call: the
# keys grow by one a step, and a running batch's rows come and go. cuDNN's attention, which
# PyTorch prefers on Hopper, builds an execution plan per shape: on an H100 that cost 1.7-2.2 ms of
# CPU a layer a step, 40-50 ms of a 24-layer model's decoding step whose kernels ran in 2.5 ms
# (benchmarks/serving_decode_step.py). Those calls use the other kernels; training's fixed shapes
# keep cuDNN's.
SHAPE_CHANGING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.n_kv_heads, cfg.head_dim
        self.mode = cfg.kv_sharing
        self.owns_kv = cfg.owns_kv(layer)
        self.dropout = cfg.dropout
        sharing = cfg.kv_sharing != "none"
        self.records_first = sharing and layer == 0
        self.records_last = sharing and layer == cfg.shared_layers - 1
        self.wq = nn.Linear(cfg.width, cfg.heads * cfg.head_dim, bias=False)
        if self.owns_kv:
            self.wk = nn.Linear(cfg.width, self.kv_heads * cfg.head_dim, bias=False)
            self.wv = nn.Linear(cfg.width, self.kv_heads * cfg.head_dim, bias=False)
        if self.mode == "fusedkv" and not self.owns_kv:
            # Row 0 weighs layer 1, row 1 weighs layer n. Initialised at the Lite point (K from
            # layer n, V from layer 1): FusedKV then starts as the Lite model and learns from there.
            k_fuse = torch.zeros(2, self.kv_heads, cfg.head_dim // 2)
            k_fuse[1] = 1.0
            v_fuse = torch.zeros(2, self.kv_heads, cfg.head_dim)
            v_fuse[0] = 1.0
            self.k_fuse = nn.Parameter(k_fuse)
            self.v_fuse = nn.Parameter(v_fuse)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.width, bias=False)

    def split_heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, heads, self.head_dim).transpose(1, 2)

    def has_sources(self, shared: SharedKV) -> bool:
        """Lite reads only K of layer n and V of layer 1; FusedKV reads all four."""
        if self.mode == "fusedkv-lite":
            return shared.k_last is not None and shared.v_first is not None
        return shared.is_complete()

    def rebuild_kv(self, shared: SharedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of an upper layer from the lower layers' (already complete) shared K/V."""
        if self.mode == "fusedkv-lite":
            return shared.k_last, shared.v_first
        k_first, k_last, v_first, v_last = shared.k_first, shared.k_last, shared.v_first, shared.v_last
        k_fuse = self.k_fuse.to(k_last.dtype)
        v_fuse = self.v_fuse.to(v_first.dtype)
        k = expand_pair_weight(k_fuse[0]) * k_first + expand_pair_weight(k_fuse[1]) * k_last
        v = v_fuse[0].unsqueeze(1) * v_first + v_fuse[1].unsqueeze(1) * v_last
        return k, v

    def attend_fused_one_query(self, q: torch.Tensor, shared: SharedKV,
                               key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """FusedKV attention of one new query per sequence without materialising K_i and V_i.

        NOTE: decoding is bound by memory traffic. Rebuilding K_i = a1 ⊙ K_1 + an ⊙ K_n over the
        whole prefix writes and re-reads two prefix-sized tensors per upper layer at every step.
        Instead, q·K_i = (q ⊙ a1)·K_1 + (q ⊙ an)·K_n and P·V_i = b1 ⊙ (P·V_1) + bn ⊙ (P·V_n), so
        each cached tensor is read once. Exact algebra; it differs from the full forward only by
        floating-point rounding."""
        batch, _, _, dim = q.shape
        group = self.heads // self.kv_heads
        qg = q.view(batch, self.kv_heads, group, dim)  # query heads that share one kv head
        k_fuse = torch.stack([expand_pair_weight(w) for w in self.k_fuse.to(q.dtype)])  # [2, kv, 1, D]
        v_fuse = self.v_fuse.to(q.dtype).unsqueeze(2)  # [2, kv, 1, D]
        scores = (qg * k_fuse[0]) @ shared.k_first.transpose(-1, -2)
        scores = scores + (qg * k_fuse[1]) @ shared.k_last.transpose(-1, -2)
        if key_mask is not None:  # [B, 1, 1, S]: each row's own keys (a ragged cache)
            scores = scores.masked_fill(~key_mask, float("-inf"))
        probs = torch.softmax(scores.float() / dim**0.5, dim=-1).to(q.dtype)  # [B, kv, group, S]
        out = v_fuse[0] * (probs @ shared.v_first) + v_fuse[1] * (probs @ shared.v_last)
        return out.view(batch, self.heads, 1, dim)

    def forward(self, x: torch.Tensor, rope: model_layers.Rope, shared: SharedKV,
                cache: KVCache | None = None) -> torch.Tensor:
        q = model_layers.apply_rope(self.split_heads(self.wq(x), self.heads), rope)
        if self.owns_kv:
            k = model_layers.apply_rope(self.split_heads(self.wk(x), self.kv_heads), rope)
            v = self.split_heads(self.wv(x), self.kv_heads)
            if cache is not None:
                k, v = cache.append(self.layer, k, v)
            if self.records_first:
                shared.k_first, shared.v_first = k, v
            if self.records_last:
                shared.k_last, shared.v_last = k, v
        elif not self.has_sources(shared):
            raise ValueError(
                f"layer {self.layer} rebuilds its K/V from layers 1 and n, but `shared` lacks them; "
                "run the lower half first (or receive their SharedKV from the previous pipeline stage)"
            )
        elif self.mode == "fusedkv" and q.shape[2] == 1 and not self.training:
            key_mask = cache.key_mask if cache is not None else None
            return self.project_out(self.attend_fused_one_query(q, shared, key_mask))
        else:
            k, v = self.rebuild_kv(shared)
        queries, keys = q.shape[2], k.shape[2]
        mask = None
        if cache is not None and cache.key_mask is not None:  # rows of their own lengths, one query each
            mask = cache.key_mask
        elif queries > 1 and queries != keys:
            mask = build_causal_mask(queries, keys, q.device)
        with sdpa_kernel(SHAPE_CHANGING_BACKENDS) if cache is not None else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=queries > 1 and queries == keys,
                dropout_p=self.dropout if self.training else 0.0, enable_gqa=self.kv_heads != self.heads,
            )
        return self.project_out(out)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        batch, _, length, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim))
