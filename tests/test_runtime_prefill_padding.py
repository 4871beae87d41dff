"""Joining prompts of different lengths prefilled together, padded to the longest
(`RunningBatch(pad_prefills=True)`, a GPU replica's default): each must answer what it answers
prefilled alone, whole or in chunks, after cached blocks or none, and the prefix cache must keep
only real positions. One forward pass per chunk then serves them all, where each length took its
own: on a GPU a forward pass costs its kernel launches more than its tokens."""

from __future__ import annotations

import asyncio

import pytest
import runtime_harness as harness
import torch

from huorn import models
from huorn.runtime import continuous_batching, prefix_cache

pytestmark = pytest.mark.usefixtures("single_thread")


def build(mode: str) -> models.Decoder:
    return harness.serving_decoder(mode, 64)  # type: ignore[return-value]


def _run(model: models.Decoder, pad: bool, budget: int) -> tuple[list, list, int, int]:
    """A preamble's blocks into the prefix cache, then seven requests admitted at once: lengths
    5 to 40, two identical, two starting with the cached preamble (16 tokens skipped). Their
    answers and log-probabilities, the prefill's forward passes, and a later request's cached
    tokens (the blocks the padded prefill stored)."""
    generator = torch.Generator().manual_seed(5)

    def tokens(n: int) -> list[int]:
        return torch.randint(32, 127, (n,), generator=generator).tolist()

    preamble = tokens(32)
    prompts = [tokens(5), tokens(12), tokens(3), preamble[:16] + tokens(24), tokens(20),
               preamble[:16] + tokens(4)]
    prompts.insert(2, list(prompts[1]))  # one prompt twice: prefilled once
    lengths = [6, 3, 9, 4, 5, 8, 7]

    async def run() -> tuple[list, list, int, int]:
        batch = continuous_batching.RunningBatch(model, prefix_cache.PrefixCache(512), 64, max_rows=8,
                                                 pad_prefills=pad)
        batch.run_to_end([continuous_batching.Request(preamble, 1, 0.0, 0)])
        forward, passes = model.forward_step, []

        def counted(tokens: torch.Tensor, cache: object, last_only: bool = False) -> torch.Tensor:
            if not isinstance(cache, models.RaggedKVCache):
                passes.append(tokens.shape)
            return forward(tokens, cache, last_only=last_only)

        model.forward_step = counted  # type: ignore[method-assign]
        try:
            requests = [continuous_batching.Request(p, n, 0.0, i, logprobs=0)
                        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
            batch.admit(requests)
            while batch.prefilling:
                batch.prefill(budget)
                if batch.rows:
                    for request, result in batch.step():
                        request.done.set_result(result)
                    batch.feed()
            while batch.rows:
                for request, result in batch.step():
                    request.done.set_result(result)
                batch.feed()
        finally:
            del model.forward_step
        # the padded prefill stored the 40-token prompt's two whole blocks, and nothing past it
        later = batch.run_to_end([continuous_batching.Request([*prompts[4][:32], 65], 1, 0.0, 9)])
        results = [r.done.result() for r in requests]
        logprobs = [[e.logprob for e in r.answer_logprobs or []] for r in requests]
        return [text for text, *_ in results], logprobs, len(passes), later[0][2]

    return asyncio.run(run())


@pytest.mark.parametrize("mode", ["none", "fusedkv"])
@pytest.mark.parametrize("budget", [0, 7])
def test_padded_prompts_answer_as_each_alone_whole_or_in_chunks(mode: str, budget: int) -> None:
    model = build(mode)
    texts, logprobs, passes, cached = _run(model, pad=False, budget=budget)
    padded_texts, padded_logprobs, padded_passes, padded_cached = _run(model, pad=True, budget=budget)
    assert padded_texts == texts
    for mine, theirs in zip(padded_logprobs, logprobs, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
    assert cached == padded_cached == 32
    if budget == 0:
        # one pass per length and skip (6 lengths, one of them skipping 16 tokens), against one
        # per skip: the cold prompts together, the two that skip the preamble together (a
        # chunk budget counts the padding: chunks of 7 tokens over 6 padded prompts are 1 token)
        assert (passes, padded_passes) == (6, 2)
