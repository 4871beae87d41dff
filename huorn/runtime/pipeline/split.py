"""Huorn's decoder cut into pipeline stages.

A `DecoderStage` borrows the decoder's own modules (embedding on the first stage, a run of
blocks, final norm and head on the last) and calls them the way `Decoder.forward_blocks`
does, so a pipelined model computes exactly what the single-device one computes. What crosses
a stage boundary is the hidden state plus the FusedKV tensors (`SharedKV`) recorded by lower
layers that upper layers rebuild their K/V from: a stage receives the slots that blocks below
it filled and sends on those filled by then. In `none` mode only the hidden state travels.

The math stays in huorn.models; this module only decides where to cut."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import fields

import torch
import torch.nn.functional as F
from torch import nn

from huorn import models
from huorn.models import layers as model_layers
from huorn.models import moe as model_moe

SLOTS = tuple(f.name for f in fields(models.SharedKV))  # k_first, v_first, k_last, v_last


def present_slots(cfg: models.ModelConfig, layers_done: int) -> tuple[str, ...]:
    """SharedKV slots filled once blocks 0..layers_done-1 have run."""
    if cfg.kv_sharing == "none":
        return ()
    filled = []
    if layers_done > 0:
        filled += ["k_first", "v_first"]
    if layers_done >= cfg.shared_layers:
        filled += ["k_last", "v_last"]
    return tuple(s for s in SLOTS if s in filled)


def balance_layers(layers: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous (start, end) block ranges, as even as possible, earlier stages taking the
    remainder (the last stage also carries the head, the first only a lookup)."""
    if not 1 <= stages <= layers:
        raise ValueError(f"pipeline stages must be between 1 and the model's layers ({layers}), got {stages}")
    base, extra = divmod(layers, stages)
    bounds, start = [], 0
    for stage in range(stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


class DecoderStage(nn.Module):
    def __init__(self, decoder: models.Decoder, start: int, end: int, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg, self.start, self.end, self.first, self.last = decoder.cfg, start, end, first, last
        self.embed = decoder.embed if first else None
        self.blocks = nn.ModuleList(decoder.layers[start:end])
        self.norm = decoder.norm if last else None
        self.head = decoder.head if last else None
        self.incoming = present_slots(self.cfg, start)
        self.outgoing = present_slots(self.cfg, end)

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.first:
            x = self.embed(tensors[0])  # type: ignore[misc]
            shared = models.SharedKV()
        else:
            x = tensors[0]
            slots = dict(zip(self.incoming, tensors[1:], strict=True))
            shared = models.SharedKV(**slots)
        rope = model_layers.build_rope(self.cfg.head_dim, x.shape[1], self.cfg.rope_theta, 0, x.device)
        for block in self.blocks:
            x = block(x, rope, shared)
        if self.last:
            return self.head(self.norm(x))  # type: ignore[misc]
        return (x, *(getattr(shared, s) for s in self.outgoing))

    def pipeline_aux_loss(self) -> torch.Tensor | None:
        """MoE balancing losses of this stage's blocks, added to what the stage back-propagates."""
        losses = [b.ffn.aux_loss for b in self.blocks
                  if isinstance(b.ffn, model_moe.MoE) and b.ffn.aux_loss is not None]
        return torch.stack(losses).sum() if losses and self.training else None

    @contextlib.contextmanager
    def pipeline_memory_bound(self) -> Iterator[None]:
        """Route every MoE layer's tokens evenly while the memory model measures a micro-batch.

        What an MoE layer saves for backward grows with the assignments its experts keep, which
        depends on the data: zero hidden states (what a later stage measures before any real
        activation arrives) send every token to one expert per group, and capacity drops most
        of them; real data keeps more. A memory limit needs the worst case, and the most a layer
        can keep is min(N · slots, E · capacity). Even routing reaches it exactly, whatever the
        data, so the measured bytes bound every micro-batch of the same shape."""
        handles = [block.ffn.router.register_forward_hook(_even_routing(block.ffn.moe))
                   for block in self.blocks if isinstance(block.ffn, model_moe.MoE)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


def _even_routing(moe: model_moe.MoEConfig) -> Callable[[nn.Module, object, torch.Tensor], torch.Tensor]:
    """A router forward hook that replaces the logits' values (not their graph) with ones that
    deal the tokens' assignments round-robin over the experts: with prototypes, token i takes
    local expert i mod E/k of every group; with plain top-k, experts (i·top_k + j) mod E."""

    def hook(module: nn.Module, args: object, logits: torch.Tensor) -> torch.Tensor:
        tokens, experts = logits.shape
        row = torch.arange(tokens, device=logits.device)
        if moe.prototypes > 1:
            per_group = experts // moe.prototypes
            offsets = torch.arange(moe.prototypes, device=logits.device) * per_group
            chosen = (row % per_group).unsqueeze(1) + offsets
        else:
            chosen = (row.unsqueeze(1) * moe.top_k + torch.arange(moe.top_k, device=logits.device)) % experts
        target = torch.zeros_like(logits).scatter_(1, chosen, 10.0)
        return logits + (target - logits).detach()

    return hook


def bounds_from_layers(stage_layers: list[int], layers: int, stages: int) -> list[tuple[int, int]]:
    """(start, end) block ranges of an explicit per-stage layer count (remediation S3's re-split),
    checked against the model so that a plan made for another job cannot cut this one wrongly."""
    counts = list(stage_layers)
    if len(counts) != stages:
        raise ValueError(f"stageLayers has {len(counts)} entries but parallelism.pipelineStages is {stages}; "
                         "give one layer count per stage")
    if any(c < 1 for c in counts):
        raise ValueError(f"stageLayers {counts}: every stage needs at least one layer")
    if sum(counts) != layers:
        raise ValueError(f"stageLayers {counts} sums to {sum(counts)} but spec.model.layers is {layers}; "
                         "the counts must add up to the model's layers")
    bounds, start = [], 0
    for count in counts:
        bounds.append((start, start + count))
        start += count
    return bounds


def split_decoder(decoder: models.Decoder, stages: int,
                  stage_layers: list[int] | None = None) -> list[DecoderStage]:
    """All stages of `decoder` (they share its parameters; a rank keeps only its own). Without
    `stage_layers` the layers are balanced by count."""
    if stage_layers is None:
        bounds = balance_layers(decoder.cfg.layers, stages)
    else:
        bounds = bounds_from_layers(stage_layers, decoder.cfg.layers, stages)
    return [DecoderStage(decoder, start, end, first=i == 0, last=i == stages - 1)
            for i, (start, end) in enumerate(bounds)]


def compute_decoder_loss(outputs: tuple[torch.Tensor, ...], targets: torch.Tensor) -> torch.Tensor:
    """The decoder's training cross-entropy on the last stage's logits (as `Decoder.forward_head`)."""
    logits = outputs[0]
    return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
