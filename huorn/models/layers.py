"""The small building blocks of the decoder: rotary embeddings and the SwiGLU feed-forward.

RoPE uses the "rotate half" layout (as Llama and torchtitan's HF-compatible path do): channel j
of a head is paired with channel j + head_dim/2. FusedKV relies on this layout to give both
channels of a pair one shared weight, see `attention.expand_pair_weight`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, head_dim]


def build_rope(head_dim: int, length: int, theta: float, start: int = 0,
               device: torch.device | None = None) -> Rope:
    """cos/sin tables for positions start..start+length-1, computed in fp32 for exact decoding.

    Built on demand rather than stored as buffers, so a model's state_dict holds only weights
    and a pipeline stage can make the tables for any position without the embedding layer."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    positions = torch.arange(start, start + length, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def build_rope_at(head_dim: int, positions: torch.Tensor, theta: float) -> Rope:
    """cos/sin [B, 1, 1, head_dim] for one token per row at each row's own position (a
    continuously batched decoding step), broadcasting over a [B, H, 1, D] query or key."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                             dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return angles.cos(), angles.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Rotate x [B, H, T, D] by the tables [T, D]; the result keeps x's dtype."""
    cos, sin = rope
    return (x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)).to(x.dtype)


class SwiGLU(nn.Module):
    """Feed-forward w2(silu(w1 x) * w3 x) of Shazeer's GLU variants; also the MoE expert."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, hidden, bias=False)
        self.w3 = nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
