"""Prompt prefixes whose K/V a serving replica keeps, so a prompt that starts like an earlier one
(a shared system prompt, a few-shot preamble, the turns of a conversation so far) is prefilled
only from where it differs.

Prompts are cut into whole blocks of `BLOCK` tokens, and each block is named by a digest chained
through every block before it (`block_hashes`): two prompts share the i-th name exactly when they
share their first i + 1 blocks, so a lookup is a walk down the names until the first miss, and
prompts that share a preamble share its blocks in memory (vLLM's automatic prefix caching names
blocks the same way). The router (`huorn.runtime.router`) computes the same names to send a
prompt where its blocks probably are.

What is kept per block is the K and V of the layers that own them (`KVCache.keys/values`): all
layers without FusedKV, the lower half with it, since the upper fused layers rebuild theirs from
layers 1 and n at every step. Reuse is exact: causal attention makes a position's K/V depend only
on the tokens up to it, so the cached blocks hold what a full prefill would compute (up to the
float rounding of a different matrix shape).

Capacity is counted in tokens (`spec.serving.prefixCacheTokens`). Eviction is least recently
used, and a hit touches a chain from its last block back to its first, so a preamble stays longer
than the branches that hang off it (evicting a parent would strand its children unreachable).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch

from huorn.models.cache import KVCache

BLOCK = 16  # tokens per cached block: small enough for short system prompts to count


def block_hashes(tokens: Sequence[int], block: int = BLOCK) -> list[bytes]:
    """The chained names of the prompt's whole blocks (a partial last block has none)."""
    names: list[bytes] = []
    parent = b""
    for start in range(0, len(tokens) - block + 1, block):
        chunk = array("I", tokens[start:start + block]).tobytes()
        parent = hashlib.blake2b(parent + chunk, digest_size=16).digest()
        names.append(parent)
    return names


def leading(names: Sequence[bytes], held: Container[bytes]) -> int:
    """How many of a prompt's block names, from its first, `held` has: a chain breaks at its
    first miss (a later block's name says nothing once an earlier one differs)."""
    count = 0
    for name in names:
        if name not in held:
            break
        count += 1
    return count


def reusable_blocks(prompt_length: int, matched: int, block: int = BLOCK) -> int:
    """How many matched blocks a prefill may skip: the prompt's last token is always computed, its
    logits are what the first generated token is sampled from."""
    return min(matched, (prompt_length - 1) // block)


@dataclass
class CachedBlock:
    keys: list[torch.Tensor]  # per owned layer, [kv_heads, BLOCK, head_dim]
    values: list[torch.Tensor]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys, *self.values])


@dataclass
class PrefixStats:
    lookups: int = 0
    hit_tokens: int = 0  # prompt tokens whose K/V came from the cache
    evicted_blocks: int = 0


class PrefixCache:
    def __init__(self, capacity_tokens: int, block: int = BLOCK) -> None:
        self._bytes = 0
        if capacity_tokens < 0:
            raise ValueError(f"spec.serving.prefixCacheTokens: {capacity_tokens} is negative; give 0 "
                             "(no cache) or more")
        self.block = block
        self.capacity_blocks = capacity_tokens // block
        self.blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self.stats = PrefixStats()

    def __len__(self) -> int:
        return len(self.blocks)

    def match(self, names: Sequence[bytes]) -> int:
        """Leading blocks of a prompt held here."""
        return leading(names, self.blocks)

    def load(self, cache: KVCache, row: int, names: Sequence[bytes]) -> None:
        """Write the named blocks' K/V into the first positions of one row of `cache`; the caller
        sets the cache's length once every row is filled."""
        self.stats.lookups += 1
        for i, name in enumerate(names):
            held = self.blocks[name]
            span = slice(i * self.block, (i + 1) * self.block)
            for layer, (k, v) in enumerate(zip(held.keys, held.values, strict=True)):
                cache.keys[layer][row, :, span] = k
                cache.values[layer][row, :, span] = v
        self.stats.hit_tokens += len(names) * self.block
        self.touch(names)

    def store(self, cache: KVCache, row: int, names: Sequence[bytes]) -> None:
        """Keep the whole blocks of one row's prompt (already in `cache`) that are not held yet."""
        if self.capacity_blocks == 0:
            return
        for i, name in enumerate(names[: self.capacity_blocks]):
            if name in self.blocks:
                continue
            span = slice(i * self.block, (i + 1) * self.block)
            held = CachedBlock([k[row, :, span].clone() for k in cache.keys],
                               [v[row, :, span].clone() for v in cache.values])
            self.blocks[name] = held
            self._bytes += held.nbytes()
        self.touch(names[: self.capacity_blocks])
        while len(self.blocks) > self.capacity_blocks:
            self._bytes -= self.blocks.popitem(last=False)[1].nbytes()
            self.stats.evicted_blocks += 1

    def touch(self, names: Sequence[bytes]) -> None:
        for name in reversed(names):
            if name in self.blocks:
                self.blocks.move_to_end(name)

    def nbytes(self) -> int:
        """K/V bytes held: 2 × owned layers × kv heads × head size × the dtype's bytes per token."""
        return self._bytes
