"""The RL objectives of GRPO, DAPO and Lite PPO, as tensors in and tensors out.

Each algorithm is a preset of a few choices (notes/papers.md; "Tricks or Traps?", DAPO, GRPO):
how advantages are normalised (mean over the prompt's group; std over the group, the batch or
not at all), the clip range (DAPO's clip-higher widens only the upper bound), how per-token
losses are aggregated (per sequence, then averaged; or over all tokens of the batch), the KL to
the reference (k3 estimator) and DAPO's dynamic sampling and overlong shaping. The presets are
the API's (huorn.api.rl.ALGORITHM_PRESETS); the spec's algorithm fields override one only where
they are set, and have no defaults, so a spec that went through the wire keeps its preset.
`name: dapo` alone is DAPO without its overlong shaping, which needs a length the spec must give
(`overlongMaxLength` and `overlongBuffer`: DAPO's 20480 and 4096 suit its 20k-token answers, not
these).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from huorn.api import rl

_STD_EPS = 1e-6


@dataclass(frozen=True)
class Settings:
    """The resolved choices one update uses."""

    mean: rl.Normalisation
    std: rl.Normalisation
    clip_low: float
    clip_high: float
    aggregation: str  # "token" or "sequence"
    kl_coefficient: float
    dynamic_sampling: bool
    overlong_max_length: int | None
    overlong_buffer: int | None


def resolve(spec: rl.AlgorithmSpec) -> Settings:
    """The preset of spec.name with the fields the spec sets on top (rl.algorithm_choices)."""
    if spec.name not in rl.ALGORITHM_PRESETS:
        raise ValueError(f"spec.algorithm.name: {spec.name.value} needs a critic, which Huorn's RL runtime "
                         "does not run; use grpo, dapo or lite-ppo")
    values = rl.algorithm_choices(spec)
    return Settings(
        mean=rl.Normalisation(values["advantage_mean"]), std=rl.Normalisation(values["advantage_std"]),
        clip_low=float(values["clip_low"]), clip_high=float(values["clip_high"]),
        aggregation=str(values["loss_aggregation"]), kl_coefficient=float(values["kl_coefficient"]),
        dynamic_sampling=bool(values["dynamic_sampling"]),
        overlong_max_length=spec.overlong_max_length, overlong_buffer=spec.overlong_buffer)


def advantages(rewards: torch.Tensor, settings: Settings) -> torch.Tensor:
    """One advantage per response, rewards [prompts, group]: (r − mean) / std, each over the
    group, the batch or not at all."""
    rewards = rewards.double()
    if settings.mean == rl.Normalisation.GROUP:
        centred = rewards - rewards.mean(dim=1, keepdim=True)
    elif settings.mean == rl.Normalisation.BATCH:
        centred = rewards - rewards.mean()
    else:
        centred = rewards
    if settings.std == rl.Normalisation.GROUP:
        scale = rewards.std(dim=1, keepdim=True, unbiased=False)
    elif settings.std == rl.Normalisation.BATCH:
        scale = rewards.std(unbiased=False).expand_as(rewards)
    else:
        return centred.float()
    return (centred / (scale + _STD_EPS)).float()


def informative_groups(rewards: torch.Tensor) -> torch.Tensor:
    """DAPO's dynamic sampling: a group whose responses all scored the same has zero advantage
    everywhere and teaches nothing; True for the others."""
    return rewards.max(dim=1).values > rewards.min(dim=1).values


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to L_max − L_cache, then a
    linear ramp to −1 at L_max, and −1 beyond."""
    start = max_length - buffer
    ramp = (start - lengths.double()) / buffer
    penalty = torch.where(lengths <= start, torch.zeros_like(ramp), ramp)
    return torch.where(lengths > max_length, torch.full_like(ramp, -1.0), penalty).float()


def k3(new: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) by the k3 estimator, π_ref/π − log(π_ref/π) − 1 (never negative)."""
    log_ratio = reference - new
    return torch.exp(log_ratio) - log_ratio - 1


@dataclass
class LossParts:
    loss: torch.Tensor  # what backward() is called on
    policy: float
    kl: float
    clip_fraction: float  # of response tokens where the clip was active


@dataclass(frozen=True)
class Totals:
    """The denominators of a mini-batch split over data-parallel trainers: its response tokens
    and its sequences, over every trainer's share. Each trainer divides its own share's sums by
    them, so the gradients' sum over trainers is the gradient of the whole mini-batch's loss,
    exactly as one trainer would take it, however the shares fall (an empty one included)."""

    tokens: float
    sequences: int

    @staticmethod
    def of(masks: list[torch.Tensor]) -> Totals:
        return Totals(float(sum(float(m.sum()) for m in masks)), sum(int(m.shape[0]) for m in masks))


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str,
              totals: Totals | None = None) -> torch.Tensor:
    """Σ_i Σ_t ℓ_it / Σ_i |o_i| (token), or the mean over sequences of Σ_t ℓ_it / |o_i| (sequence);
    with `totals`, this share's part of the whole mini-batch's value (its sums over the whole
    mini-batch's tokens or sequences)."""
    if how == "token":
        tokens = mask.sum().clamp(min=1) if totals is None else max(1.0, totals.tokens)
        return (per_token * mask).sum() / tokens
    lengths = mask.sum(dim=1).clamp(min=1)
    if totals is None:
        return ((per_token * mask).sum(dim=1) / lengths).mean()
    return ((per_token * mask).sum(dim=1) / lengths).sum() / max(1, totals.sequences)


def policy_loss(new: torch.Tensor, old: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor,
                settings: Settings, reference: torch.Tensor | None = None, totals: Totals | None = None
                ) -> LossParts:
    """The clipped surrogate, −min(ρ·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A) per token with
    ρ = π/π_old, aggregated as the settings say, plus β·KL to the reference when β > 0.

    new, old, reference: log-probabilities of the response tokens [B, T]; advantage [B]; mask
    [B, T] is 1 on response tokens. `totals`: these rows are one trainer's share of a mini-batch
    (`Totals`); every value returned is then that share's part, and the parts add up."""
    mask = mask.float()
    ratio = torch.exp(new - old)
    a = advantage.unsqueeze(1)
    clipped = torch.clamp(ratio, 1 - settings.clip_low, 1 + settings.clip_high)
    per_token = -torch.minimum(ratio * a, clipped * a)
    surrogate = aggregate(per_token, mask, settings.aggregation, totals)
    # Where the min took the clipped term: those tokens pass no gradient (PPO's clip fraction).
    was_clipped = (clipped * a < ratio * a - 1e-7).float()
    tokens = mask.sum().clamp(min=1) if totals is None else max(1.0, totals.tokens)
    clip_fraction = float((was_clipped * mask).sum() / tokens)
    kl_value = torch.zeros((), dtype=new.dtype, device=new.device)
    if settings.kl_coefficient > 0:
        if reference is None:
            raise ValueError("a KL term needs the reference policy's log-probabilities")
        kl_value = aggregate(k3(new, reference), mask, settings.aggregation, totals)
    total = surrogate + settings.kl_coefficient * kl_value
    return LossParts(total, float(surrogate.detach()), float(kl_value.detach()), clip_fraction)
