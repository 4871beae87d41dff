"""A serving replica's decoding step as CUDA graphs, one per bucket of rows, as vLLM captures its own.

On a GPU a decoding step of a 24-layer model is about 700 kernel launches whose kernels run in
2.5-3.4 ms, and launching them from Python costs 26-32 ms of CPU (an H100;
benchmarks/serving_decode_step.py): the replica is bound by its one CPU thread, not by its GPU.
A CUDA graph replays the whole step's kernels with one launch. A graph fixes every shape and
every address it was captured with, so the step it captures is `Decoder.forward_fixed_step`:
the first `bucket` rows of the batch's ragged KV cache (free rows compute a token nobody reads),
keys over the cache's whole length with a mask, no length read on the host. Steps of n rows
replay the smallest bucket of at least n (powers of two up to the batch's maxBatch).

The graphs are captured when the replica starts (the batch empty), each after two warm-up runs on
a side stream, all in one memory pool; they read the cache's tensors in place, so the cache must
never be reallocated (a replica allocates its whole batch at start; a cache that grew anyway
falls back to eager steps). On a CPU, or for a model whose step cannot be captured (MoE routing
sizes its work by the data), the same fixed-shape step runs eagerly: the CPU tests run the very
code the graphs capture.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from huorn.models.cache import RaggedKVCache


def buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to `max_rows`, and `max_rows` itself."""
    out, size = [], 1
    while size < max_rows:
        out.append(size)
        size *= 2
    return [*out, max_rows]


def capturable(model: torch.nn.Module) -> bool:
    """A dense decoder on a GPU: an MoE layer sizes its experts' work by the routing (a host
    sync and data-dependent shapes), which a graph cannot hold."""
    cfg = getattr(model, "cfg", None)
    device = next(model.parameters()).device
    return device.type == "cuda" and cfg is not None and getattr(cfg, "moe", None) is None


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, cache: RaggedKVCache, max_rows: int,
                 capture: bool | None = None) -> None:
        """`capture`: record CUDA graphs (default: where `capturable`); else every step runs the
        fixed-shape step eagerly."""
        self.model = model
        self.cache = cache
        self.buckets = buckets(max_rows)
        self.device = next(model.parameters()).device
        self.tokens = torch.zeros(self.buckets[-1], 1, dtype=torch.long, device=self.device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._storage = cache.keys[0].data_ptr() if cache.keys else 0
        if capture if capture is not None else capturable(model):
            self._capture()

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def _step(self, rows: int) -> torch.Tensor:
        return self.model.forward_fixed_step(self.tokens[:rows], self.cache)  # type: ignore[operator]

    @torch.no_grad()
    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for rows in reversed(self.buckets):  # the largest first: the smaller ones reuse its pool
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # kernels chosen, workspaces allocated, outside the capture
                    self._step(rows)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._step(rows)
            self.graphs[rows] = (graph, out)
        torch.cuda.synchronize()

    @torch.no_grad()
    def run(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits [n, V] (fp32, a copy) of one step feeding `tokens` to the cache's n rows in use
        (n at most the largest bucket); the rows are advanced."""
        n = len(tokens)
        if n > self.buckets[-1]:
            raise ValueError(f"DecodeGraphs: a step of {n} rows; the largest bucket is {self.buckets[-1]}")
        fed = torch.tensor(tokens, dtype=torch.long).view(n, 1)
        rows = next(b for b in self.buckets if b >= n)
        self.tokens[:n].copy_(fed, non_blocking=True)
        self.tokens[n:rows].zero_()
        if self.graphs and self.cache.keys and self.cache.keys[0].data_ptr() != self._storage:
            self.graphs.clear()  # the cache was reallocated: the graphs read the old one
        if rows in self.graphs:
            graph, out = self.graphs[rows]
            graph.replay()
        else:
            out = self._step(rows)
        logits = out[:n].to(torch.float32, copy=True)  # the graph's output is overwritten next step
        self.cache.advance(1)
        return logits
