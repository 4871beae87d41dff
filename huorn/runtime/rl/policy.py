"""Sampling responses from the decoder, and the log-probabilities of given responses.

Both paths must agree: the trainer recomputes the sampled tokens' log-probabilities with a full
forward pass (teacher forcing) to form PPO's ratio, and tests check that they equal the ones
seen while sampling with the KV cache, at temperature 1 and below it.

Both score softmax(logits / T), the distribution sampling draws from (as verl does; plain logits
at T = 0, which samples greedily). Before, the trainer and the reference scored the plain
logits while the rollout sampled at T: at T = 0.7 the trainer's π_old was 0.39-2.06 times the
probability each token was sampled with, so PPO's ratio and clip were taken against another
policy than the one that sampled. Top-p is left out of the scoring, as verl leaves it: the
truncated distribution gives the tokens outside the nucleus probability 0 (log-probability
-inf, no gradient to learn from), and the nucleus moves with the weights. Below topP 1 the
samples are therefore drawn from a slightly narrower distribution than the one trained, a bias
that grows as topP falls; topP 1 (the default) has none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from huorn.runtime.data import tokenizer

NEWLINE = ord("\n")


@dataclass
class Samples:
    """Responses to one prompt: tokens [G, T] after the prompt, and a mask [G, T] that is 1 up to
    and including the first newline (the answer line) or the whole length if none came."""

    prompt: list[int]
    tokens: torch.Tensor
    mask: torch.Tensor
    # [G, T], 0 past the mask: log-probabilities of the chosen tokens under softmax(logits / T),
    # the distribution the trainer scores (top-p left out, as it leaves it out: module doc)
    sampled_logprobs: torch.Tensor

    def texts(self) -> list[str]:
        out = []
        for row, mask in zip(self.tokens.tolist(), self.mask.tolist(), strict=True):
            out.append(tokenizer.decode([t for t, m in zip(row, mask, strict=True) if m]))
        return out


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits with everything outside the smallest set of probability ≥ top_p masked out."""
    if top_p >= 1.0:
        return logits
    ordered, order = torch.sort(logits, descending=True, dim=-1)
    cumulative = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
    drop = cumulative - torch.softmax(ordered, dim=-1) >= top_p  # keep the token that crosses top_p
    ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)


@torch.no_grad()
def sample(model: torch.nn.Module, prompt: list[int], group: int, max_new_tokens: int, temperature: float,
           top_p: float, generator: torch.Generator) -> Samples:
    """`group` responses to one prompt, decoded together with one KV cache; greedy at
    temperature 0. Decoding stops once every response has finished its answer line."""
    model.eval()
    device = next(model.parameters()).device
    context = torch.tensor([prompt] * group, dtype=torch.long, device=device)
    cache = model.build_cache(group, len(prompt) + max_new_tokens)  # type: ignore[operator]
    logits = model.forward_step(context, cache, last_only=True)[:, -1].float()  # type: ignore[operator]
    tokens, logprobs = [], []
    finished = torch.zeros(group, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        scored = F.log_softmax(scale(logits, temperature), dim=-1)
        if temperature > 0:
            nucleus = scored if top_p >= 1.0 else F.log_softmax(_top_p(scored, top_p), dim=-1)
            token = torch.multinomial(nucleus.exp(), 1, generator=generator)
        else:
            token = scored.argmax(dim=-1, keepdim=True)
        tokens.append(token[:, 0])
        logprobs.append(scored.gather(-1, token)[:, 0])
        finished |= token[:, 0] == NEWLINE
        if finished.all() or step + 1 == max_new_tokens:
            break
        logits = model.forward_step(token, cache, last_only=True)[:, -1].float()  # type: ignore[operator]
    out = torch.stack(tokens, dim=1).cpu()
    mask = response_mask(out)
    return Samples(prompt, out, mask, torch.stack(logprobs, dim=1).cpu() * mask)


def response_mask(tokens: torch.Tensor) -> torch.Tensor:
    """1 up to and including each row's first newline, 0 after it: a group is decoded together
    until every row has ended its answer line, so a row that ended early goes on sampling tokens
    that no reward reads and no loss may count."""
    newline = (tokens == NEWLINE).int()
    before = newline.cumsum(dim=1) - newline
    return (before == 0).float()


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The logits of the distribution sampled at `temperature` and scored for training: divided
    by it, unchanged at 0 (greedy)."""
    return logits / temperature if temperature > 0 else logits


def response_logprobs(model: torch.nn.Module, prompt: list[int], responses: torch.Tensor,
                      temperature: float = 1.0) -> torch.Tensor:
    """log π(o_t | prompt, o_<t) of each response token [G, T] under softmax(logits / T), by one
    teacher-forced forward pass; differentiable when the model is in training mode with grad
    enabled."""
    device = next(model.parameters()).device
    prefix = torch.tensor([prompt] * responses.shape[0], dtype=torch.long, device=device)
    full = torch.cat([prefix, responses.to(device)], dim=1)
    logits, _ = model(full[:, :-1])
    start = len(prompt) - 1  # the logit at position i predicts token i + 1
    picked = F.log_softmax(scale(logits[:, start:].float(), temperature), dim=-1)
    return picked.gather(-1, full[:, len(prompt):].unsqueeze(-1))[..., 0]
