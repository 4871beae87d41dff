"""Which parameters weight decay may pull toward zero.

AdamW's decay is a regulariser for weight matrices (projections, embeddings, experts, routers).
Applied to everything, as a bare `AdamW(model.parameters())` does, it also pulls toward zero the
parameters whose scale the model relies on staying put: RMSNorm gains (initialised at 1) and
FusedKV's fusion weights (`k_fuse`, `v_fuse`, a mix of two layers' keys and values initialised at
the FusedKV-Lite point, 0/1), which a decay would slowly drain toward "no key, no value".
Megatron-LM, nanoGPT and Hugging Face's Trainer exempt gains and biases the same way."""

from __future__ import annotations

import torch

# Learned mixing weights, not matrices, whatever their shape (huorn.models.attention).
GATES = frozenset({"k_fuse", "v_fuse"})


def decays(name: str, parameter: torch.Tensor) -> bool:
    """Whether weight decay applies to the parameter of this (fully qualified) name."""
    return parameter.ndim >= 2 and name.rsplit(".", 1)[-1] not in GATES


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's parameter groups for `model`: the decayed first, then the exempt (weight decay 0);
    an empty group is left out (a pipeline stage may hold no gain)."""
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if decays(n, p)], "weight_decay": weight_decay},
              {"params": [p for n, p in named if not decays(n, p)], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def adamw(model: torch.nn.Module, learning_rate: float, weight_decay: float, **options: object
          ) -> torch.optim.AdamW:
    """The AdamW every Huorn trainer steps (betas 0.9/0.95 unless given), with the decay on the
    matrices only."""
    options.setdefault("betas", (0.9, 0.95))
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=learning_rate, **options)
