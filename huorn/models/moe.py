"""Mixture-of-experts feed-forward: plain top-k routing, and M6-T expert prototyping
(arXiv 2105.15082), with a capacity factor and a Switch-style balancing loss.

Prototyping splits the E experts into k groups of E/k, routes top-1 inside each group and sums
the k gated outputs: the compute of top-k routing, but the k experts of a token always come from
different groups, which the paper finds matters more for quality than perfect balance.

Capacity: each expert takes at most ceil(factor · N · slots / E) assignments per forward. Over
capacity, an assignment is dropped and contributes nothing, so the token passes through the
block's residual connection unchanged for that slot. Earlier slots win (every token's first
choice is placed before any second choice, as in GShard), then earlier tokens.

Every expert runs on every forward, even on an empty batch of tokens, so each expert parameter
always gets a (possibly zero) gradient and DDP needs no `find_unused_parameters`."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from huorn.models import layers as model_layers
from huorn.models.config import ModelConfig, MoEConfig


@dataclass
class Routing:
    """Where the N tokens of one forward went: `slots` assignments per token, [N, slots] each."""

    expert: torch.Tensor  # global expert index
    gate: torch.Tensor  # router probability used to scale the expert's output
    kept: torch.Tensor  # False where the assignment was dropped for capacity
    capacity: int | None  # per-expert limit, None when nothing is dropped
    balance_loss: torch.Tensor  # unweighted Switch loss, 1.0 when perfectly balanced


def route_tokens(logits: torch.Tensor, moe: MoEConfig, capacity_factor: float | None) -> Routing:
    """Pick experts for each of the N rows of router logits [N, E]."""
    tokens, experts = logits.shape
    groups = moe.prototypes
    per_group = experts // groups
    probs = F.softmax(logits.float().view(tokens, groups, per_group), dim=-1)
    if groups > 1:
        gate, local = probs.max(dim=-1)  # top-1 inside each group: [N, k]
        expert = local + torch.arange(groups, device=logits.device) * per_group
        counts = F.one_hot(local, per_group).float().sum(dim=0)  # [k, per_group]
    else:
        gate, expert = probs[:, 0].topk(moe.top_k, dim=-1)
        counts = F.one_hot(expert, experts).float().sum(dim=(0, 1)).unsqueeze(0)  # [1, E]
    slots = expert.shape[1]

    # Switch balancing loss per group: per_group · Σ_e f_e · P_e, averaged over groups.
    fraction = counts / counts.sum(dim=-1, keepdim=True)
    mean_prob = probs.mean(dim=0)  # [groups, per_group]
    balance = (per_group * (fraction * mean_prob).sum(dim=-1)).mean()

    if capacity_factor is None:
        kept = torch.ones_like(expert, dtype=torch.bool)
        capacity = None
    else:
        capacity = max(1, math.ceil(capacity_factor * tokens * slots / experts))
        slot_major = F.one_hot(expert.t().reshape(-1), experts)  # [slots·N, E], slot 0 of all first
        position = (slot_major.cumsum(dim=0) * slot_major).sum(dim=-1) - 1
        kept = (position < capacity).view(slots, tokens).t()
    return Routing(expert=expert, gate=gate.to(logits.dtype), kept=kept, capacity=capacity,
                   balance_loss=balance)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.moe is None:
            raise ValueError("MoE layer built from a ModelConfig without `moe`; set moe=MoEConfig(...)")
        self.moe = cfg.moe
        self.router = nn.Linear(cfg.width, cfg.moe.experts, bias=False)
        self.experts = nn.ModuleList(
            model_layers.SwiGLU(cfg.width, cfg.ffn_hidden) for _ in range(cfg.moe.experts)
        )
        self.aux_loss: torch.Tensor | None = None  # weighted balancing loss of the last forward
        self.last_routing: Routing | None = None  # for telemetry and tests

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        factor = self.moe.capacity_factor if self.training else self.moe.eval_capacity_factor
        routing = route_tokens(self.router(flat), self.moe, factor)
        self.last_routing = routing
        self.aux_loss = self.moe.balance_loss_weight * routing.balance_loss
        out = torch.zeros_like(flat)
        for index, expert in enumerate(self.experts):
            token, slot = torch.nonzero((routing.expert == index) & routing.kept, as_tuple=True)
            gated = expert(flat[token]) * routing.gate[token, slot].unsqueeze(-1).to(flat.dtype)
            out.index_add_(0, token, gated.to(out.dtype))
        return out.view_as(x)
