"""What travels between layers and between decoding steps: the K/V that upper FusedKV layers
rebuild theirs from (`SharedKV`), and the incremental-decoding cache (`KVCache`).

`SharedKV` is deliberately a flat record of four optional tensors, so a pipeline stage can send
it beside the hidden state with plain point-to-point calls (`tensors()` / `from_tensors()`),
without pickling modules or knowing which layer filled which slot.

`KVCache` stores K and V only for the layers that own them (all layers in `none` mode, the lower
half in the fused modes). The upper fused layers need nothing of their own: they rebuild K and V
from the cached first and last lower layers at every step. That is where the 50% saving comes
from, and `nbytes()` counts exactly these K/V tensors so the saving can be checked."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class SharedKV:
    """Post-RoPE K and the V of layer 1 (`first`) and layer n (`last`), each [B, kv_heads, S, D]."""

    k_first: torch.Tensor | None = None
    v_first: torch.Tensor | None = None
    k_last: torch.Tensor | None = None
    v_last: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor | None]:
        """The four slots in a fixed order, for sending to the next pipeline stage."""
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_tensors(cls, tensors: list[torch.Tensor | None]) -> SharedKV:
        if len(tensors) != 4:
            raise ValueError(f"SharedKV.from_tensors: expected 4 tensors (or None), got {len(tensors)}")
        return cls(*tensors)

    def is_complete(self) -> bool:
        return all(t is not None for t in self.tensors())


class KVCache:
    """Preallocated K/V buffers [B, kv_heads, max_length, D] for each layer that owns its K/V.

    The length advances once per decoding call (`advance`), after every layer has appended, so
    all layers of one step agree on where the new tokens go."""

    def __init__(self, owned_layers: int, batch: int, kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        shape = (batch, kv_heads, max_length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(owned_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(owned_layers)]
        self.max_length = max_length
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this step's k, v [B, kv_heads, t, D] of `layer`; return the views of the whole prefix."""
        if layer >= len(self.keys):
            raise IndexError(f"KVCache: layer {layer} has no slot; this cache holds {len(self.keys)} layers")
        end = self.length + k.shape[2]
        if end > self.max_length:
            raise ValueError(
                f"KVCache: {end} tokens exceed max_length={self.max_length}; build a longer cache"
            )
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, steps: int) -> None:
        self.length += steps

    def nbytes(self) -> int:
        """Bytes of the stored K and V buffers (allocated capacity), nothing else."""
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])

    def used_nbytes(self) -> int:
        """Bytes of K and V for the tokens stored so far."""
        return self.nbytes() * self.length // max(self.max_length, 1)
