"""What travels between layers and between decoding steps: the K/V that upper FusedKV layers
rebuild theirs from (`SharedKV`), and the incremental-decoding cache (`KVCache`).

`SharedKV` is deliberately a flat record of four optional tensors, so a pipeline stage can send
it beside the hidden state with plain point-to-point calls (`tensors()` / `from_tensors()`),
without pickling modules or knowing which layer filled which slot.

`KVCache` stores K and V only for the layers that own them (all layers in `none` mode, the lower
half in the fused modes). The upper fused layers need nothing of their own: they rebuild K and V
from the cached first and last lower layers at every step. That is where the 50% saving comes
from, and `nbytes()` counts exactly these K/V tensors so the saving can be checked.

`RaggedKVCache` gives each row a length of its own, for continuous batching: a server decodes
whichever requests are in flight together, each at its own position, and a request joins or
leaves between two steps instead of waiting for a whole batch to finish."""

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
        # [B, 1, 1, S] keys each row may attend to, for caches whose rows differ in length
        # (RaggedKVCache); None: every row attends to the whole prefix
        self.key_mask: torch.Tensor | None = None

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


class RaggedKVCache(KVCache):
    """A KV cache whose rows each have their own length (continuous batching).

    The first `rows` rows are in use; a decoding step feeds one token to each of them, written at
    that row's own position (`lengths`), rotated for it, and attending only to that row's keys
    (`key_mask`). Rows are filled from a plain cache's prefill (`place`), moved down when one
    leaves so that those in use stay the first ones (`move`: a step computes no free row), and
    the batch grows by reallocation (`grow`). Positions past a row's length hold stale K/V of an
    earlier occupant, which the mask hides."""

    def __init__(self, owned_layers: int, batch: int, kv_heads: int, max_length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None) -> None:
        super().__init__(owned_layers, batch, kv_heads, max_length, head_dim, dtype, device)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)
        self.host_lengths = [0] * batch  # the same on the host: no device sync to read them
        self.rows = 0
        self._end = 0
        self._positions: torch.Tensor | None = None  # where this step's K/V go, one per row
        # a fixed-shape step's rows (`begin_fixed_step`): free rows included, what a CUDA graph
        # captures; None for a step over the rows in use
        self.fixed_rows: int | None = None

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0] if self.keys else len(self.host_lengths)

    def grow(self, batch: int) -> None:
        """Room for `batch` rows; the rows held are kept."""
        if batch <= self.capacity:
            return
        def wider(t: torch.Tensor) -> torch.Tensor:
            out = t.new_zeros((batch, *t.shape[1:]))
            out[: t.shape[0]] = t
            return out
        self.keys = [wider(t) for t in self.keys]
        self.values = [wider(t) for t in self.values]
        self.lengths = wider(self.lengths)
        self.host_lengths += [0] * (batch - len(self.host_lengths))

    def place(self, row: int, source: KVCache, source_row: int, length: int) -> None:
        """Row `row` takes the first `length` positions of `source`'s row `source_row` (a prefill)."""
        if length > self.max_length:
            raise ValueError(f"RaggedKVCache: a row of {length} tokens exceeds max_length={self.max_length}")
        for mine, theirs in zip([*self.keys, *self.values], [*source.keys, *source.values], strict=True):
            mine[row, :, :length] = theirs[source_row, :, :length]
        self.lengths[row] = length
        self.host_lengths[row] = length

    def move(self, source: int, target: int) -> None:
        """Row `target` becomes a copy of row `source` (its K/V up to its length, and its length)."""
        length = self.host_lengths[source]
        for t in [*self.keys, *self.values]:
            t[target, :, :length] = t[source, :, :length]
        self.lengths[target] = length
        self.host_lengths[target] = length

    def begin_step(self) -> torch.Tensor:
        """The positions of the tokens a decoding step feeds to the rows in use; sets the mask."""
        n = self.rows
        if n == 0:
            raise ValueError("RaggedKVCache: no row in use; place a prefill first")
        self._end = max(self.host_lengths[:n]) + 1
        if self._end > self.max_length:
            raise ValueError(f"KVCache: {self._end} tokens exceed max_length={self.max_length}; "
                             "build a longer cache")
        return self._aim(self.lengths[:n])

    def begin_fixed_step(self, rows: int) -> torch.Tensor:
        """A decoding step over the first `rows` rows, free ones included, whose every shape is
        fixed by `rows` and the cache's capacity (keys over the whole `max_length`, the mask hiding
        the rest) and which reads no length on the host: what a CUDA graph captures and replays.
        A free row computes a token nobody reads and writes its K/V where its length says (0 once
        freed: `free`); the positions are clamped so that no write can fall outside the cache.
        `end_fixed_step` after it; `advance` moves the rows in use only."""
        if not 0 < rows <= self.capacity:
            raise ValueError(f"RaggedKVCache: a fixed step of {rows} rows in a cache of {self.capacity}")
        self.fixed_rows = rows
        self._end = self.max_length
        return self._aim(self.lengths[:rows].clamp(max=self.max_length - 1))

    def _aim(self, positions: torch.Tensor) -> torch.Tensor:
        """This step writes each row's K/V at its position and reads the keys up to it."""
        self._positions = positions
        keys = torch.arange(self._end, device=positions.device)
        self.key_mask = (keys[None, :] <= positions[:, None])[:, None, None, :]
        return positions

    def end_fixed_step(self) -> None:
        self.fixed_rows = None
        self.key_mask = None
        self._positions = None

    def free(self, row: int) -> None:
        """Row `row` holds nobody now: its length goes to 0, so a fixed step's write there stays
        inside the cache."""
        self.lengths[row] = 0
        self.host_lengths[row] = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.rows if self.fixed_rows is None else self.fixed_rows
        if k.shape[0] != n or k.shape[2] != 1:
            raise ValueError(f"RaggedKVCache: a step feeds one token to each of the {n} rows in use, "
                             f"got K of shape {tuple(k.shape)}")
        if layer >= len(self.keys):
            raise IndexError(f"KVCache: layer {layer} has no slot; this cache holds {len(self.keys)} layers")
        if self._positions is None:
            raise RuntimeError("RaggedKVCache: begin_step or begin_fixed_step comes before a step's append")
        index = torch.arange(n, device=k.device)
        self.keys[layer][index, :, self._positions] = k[:, :, 0]
        self.values[layer][index, :, self._positions] = v[:, :, 0]
        return self.keys[layer][:n, :, : self._end], self.values[layer][:n, :, : self._end]

    def advance(self, steps: int) -> None:
        if steps != 1:
            raise ValueError("RaggedKVCache: rows advance one token a step")
        n = self.rows
        self.lengths[:n] += 1
        for row in range(n):
            self.host_lengths[row] += 1
        self.key_mask = None
        self._positions = None
