"""The decoder-only transformer (pre-norm, RoPE, RMSNorm, SwiGLU or MoE, SDPA attention).

Single-device math only, in torchtitan's spirit: how it is split across GPUs lives elsewhere
(huorn.runtime). For that, the forward pass is exposed in three pieces that a pipeline stage can
run separately: `embed_tokens`, `forward_blocks(x, start, end, shared)` and `forward_head`.
A stage that holds blocks start..end-1 receives the hidden state and the `SharedKV` of the stages
below, and sends both on. Only fused modes put anything in `SharedKV`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from huorn.models import layers as model_layers
from huorn.models import moe as model_moe
from huorn.models.attention import Attention
from huorn.models.cache import KVCache, RaggedKVCache, SharedKV
from huorn.models.config import ModelConfig


class Block(nn.Module):
    """One pre-norm layer; call as `block(x, rope, shared, cache=None)`.

    `shared` is read by upper fused layers and written by layers 1 and n, in place."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.attention_norm = nn.RMSNorm(cfg.width, eps=1e-6)
        self.attention = Attention(cfg, layer)
        self.ffn_norm = nn.RMSNorm(cfg.width, eps=1e-6)
        self.ffn: nn.Module = (
            model_moe.MoE(cfg) if cfg.moe is not None else model_layers.SwiGLU(cfg.width, cfg.ffn_hidden)
        )
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: model_layers.Rope, shared: SharedKV,
                cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.attention_norm(x), rope, shared, cache))
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocabulary, cfg.width)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.width, eps=1e-6)
        self.head = nn.Linear(cfg.width, cfg.vocabulary, bias=False)
        self.reset_weights()

    def reset_weights(self) -> None:
        """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2L) so the
        residual stream's variance does not grow with depth. Fusion weights keep their Lite init."""
        for name, param in self.named_parameters():
            if param.dim() < 2 or name.endswith(("k_fuse", "v_fuse")):
                continue
            std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            nn.init.normal_(param, mean=0.0, std=std)

    # --- pieces of the forward pass, for pipeline stages -------------------------------------
    def build_rope(self, start: int | torch.Tensor, length: int, device: torch.device) -> model_layers.Rope:
        """Tables for `length` positions from `start`, or, with one start per row (a ragged
        cache's step), for one token per row at its own position."""
        if isinstance(start, torch.Tensor):
            return model_layers.build_rope_at(self.cfg.head_dim, start, self.cfg.rope_theta)
        return model_layers.build_rope(self.cfg.head_dim, length, self.cfg.rope_theta, start, device)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2:
            raise ValueError(f"tokens: expected [batch, time], got shape {tuple(tokens.shape)}")
        return self.embed(tokens)

    def forward_blocks(self, x: torch.Tensor, start: int = 0, end: int | None = None,
                       shared: SharedKV | None = None, position: int | torch.Tensor = 0,
                       cache: KVCache | None = None) -> tuple[torch.Tensor, SharedKV]:
        """Run blocks start..end-1 on hidden states x [B, T, W] at absolute `position` (one per
        row, as a tensor, for a ragged cache's step of one token)."""
        end = self.cfg.layers if end is None else end
        if not 0 <= start <= end <= self.cfg.layers:
            raise ValueError(
                f"forward_blocks: need 0 <= start <= end <= {self.cfg.layers}, got {start}..{end}"
            )
        shared = SharedKV() if shared is None else shared
        rope = self.build_rope(position, x.shape[1], x.device)
        for block in self.layers[start:end]:
            x = block(x, rope, shared, cache)
        return x, shared

    def forward_head(self, x: torch.Tensor, targets: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and the mean cross-entropy (targets of -100 are ignored)."""
        logits = self.head(self.norm(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1),
                               ignore_index=-100)
        return logits, loss

    def aux_loss(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Weighted MoE balancing losses of blocks start..end-1 from their last forward (0 without MoE).

        A pipeline stage adds the aux loss of its own blocks to whatever it back-propagates."""
        total = torch.zeros((), device=self.head.weight.device)
        for block in self.layers[start:end]:
            if isinstance(block.ffn, model_moe.MoE) and block.ffn.aux_loss is not None:
                total = total + block.ffn.aux_loss
        return total

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits, loss). In training mode loss = CE + MoE balancing losses; in eval mode it is the
        plain CE, so validation numbers compare across dense and MoE models."""
        x, _ = self.forward_blocks(self.embed_tokens(tokens))
        logits, loss = self.forward_head(x, targets)
        if loss is not None and self.training and self.cfg.moe is not None:
            loss = loss + self.aux_loss()
        return logits, loss

    # --- incremental decoding ------------------------------------------------------------------
    def build_cache(self, batch: int, max_length: int | None = None, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> KVCache:
        """A cache for the layers that own K/V: all in `none` mode, the lower half in fused modes."""
        return KVCache(self.cfg.shared_layers, batch, self.cfg.n_kv_heads, max_length or self.cfg.context,
                       self.cfg.head_dim, dtype=dtype or self.head.weight.dtype,
                       device=device or self.head.weight.device)

    def build_ragged_cache(self, batch: int, max_length: int | None = None) -> RaggedKVCache:
        """A cache whose rows each have a length of their own (continuous batching)."""
        cfg = self.cfg
        return RaggedKVCache(cfg.shared_layers, batch, cfg.n_kv_heads, max_length or cfg.context,
                             cfg.head_dim, dtype=self.head.weight.dtype, device=self.head.weight.device)

    def forward_step(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        """Logits [B, t, V] for t new tokens after the cache's prefix; appends their K/V.

        One call with the whole prompt is the prefill; calls with t = 1 decode. `last_only`
        projects only the last position ([B, 1, V]): a 32k-token prompt's full logits would be
        larger than its KV cache."""
        position: int | torch.Tensor = cache.length
        if isinstance(cache, RaggedKVCache):  # one token per row, each at its row's own position
            if tokens.shape[1] != 1:
                raise ValueError(f"forward_step: a ragged cache takes one token per row, "
                                 f"got {tokens.shape[1]}")
            position = cache.begin_step()
        x, _ = self.forward_blocks(self.embed_tokens(tokens), position=position, cache=cache)
        cache.advance(tokens.shape[1])
        logits, _ = self.forward_head(x[:, -1:] if last_only else x)
        return logits

    def forward_fixed_step(self, tokens: torch.Tensor, cache: RaggedKVCache) -> torch.Tensor:
        """Logits [rows, V] of one decoding step over the ragged cache's first `rows` rows
        (tokens [rows, 1]), free rows included, with every shape fixed and no read of a length on
        the host (RaggedKVCache.begin_fixed_step): what a CUDA graph captures. The cache is not
        advanced: the caller advances the rows in use."""
        positions = cache.begin_fixed_step(tokens.shape[0])
        try:
            x, _ = self.forward_blocks(self.embed_tokens(tokens), position=positions, cache=cache)
        finally:
            cache.end_fixed_step()
        logits, _ = self.forward_head(x)
        return logits[:, -1]

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, temperature: float = 0.0,
                 generator: torch.Generator | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Prompt [B, T] followed by `new_tokens` tokens: greedy at temperature 0, else sampled."""
        cache = cache or self.build_cache(prompt.shape[0], prompt.shape[1] + new_tokens)
        logits = self.forward_step(prompt, cache, last_only=True)[:, -1]
        out = [prompt]
        for step in range(new_tokens):
            if temperature > 0:
                # the best logit first, as serving's sampler: a tiny temperature divides the rest
                # towards -inf, never inf - inf (NaN)
                shifted = logits.float() - logits.float().amax(dim=-1, keepdim=True)
                probs = F.softmax(shifted / max(temperature, torch.finfo(torch.float32).tiny), dim=-1)
                token = torch.multinomial(probs, 1, generator=generator)
            else:
                token = logits.argmax(dim=-1, keepdim=True)
            out.append(token)
            if step + 1 < new_tokens:
                logits = self.forward_step(token, cache, last_only=True)[:, -1]
        return torch.cat(out, dim=1)

    # --- accounting ----------------------------------------------------------------------------
    def fusion_nbytes(self) -> int:
        """Bytes of the FusedKV fusion weights, reported apart from the cache they replace."""
        return sum(p.numel() * p.element_size() for n, p in self.named_parameters()
                   if n.endswith(("k_fuse", "v_fuse")))

    def count_parameters(self, include_embedding: bool = True) -> int:
        total = sum(p.numel() for p in self.parameters())
        return total if include_embedding else total - self.embed.weight.numel()

    def flops_per_token(self, sequence: int) -> float:
        """Training FLOPs per token, PaLM's 6N + 12·L·W·T (attention counted as non-causal),
        with N the non-embedding parameters (the head is a matmul, the lookup is not). With MoE,
        N counts only the experts a token is routed to."""
        params = self.count_parameters(include_embedding=False)
        if self.cfg.moe is not None:
            expert = sum(p.numel() for p in self.layers[0].ffn.experts[0].parameters())
            idle = self.cfg.moe.experts - self.cfg.moe.experts_per_token
            params -= idle * expert * self.cfg.layers
        return 6.0 * params + 12.0 * self.cfg.layers * self.cfg.width * sequence


def build_model(cfg: ModelConfig) -> Decoder:
    return Decoder(cfg)
