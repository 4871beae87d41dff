"""The fixed-shape decoding step that a GPU replica captures as CUDA graphs
(huorn.runtime.decode_graphs): run eagerly here (no GPU), it must answer what the step over the
rows in use answers, as rows join and leave, in every KV-sharing mode, up to the cache's last
position; free rows must stay harmless. The capture itself needs a GPU
(benchmarks/serving_decode_step.py runs it)."""

from __future__ import annotations

import asyncio

import pytest
import runtime_harness as harness
import torch

from huorn import models
from huorn.runtime import continuous_batching, decode_graphs, prefix_cache

pytestmark = pytest.mark.usefixtures("single_thread")

CONTEXT = 40


def build(mode: str) -> models.Decoder:
    return harness.serving_decoder(mode, CONTEXT)  # type: ignore[return-value]


def test_buckets_are_powers_of_two_up_to_the_batch() -> None:
    assert decode_graphs.buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert decode_graphs.buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert decode_graphs.buckets(1) == [1]


def _serve(model: models.Decoder, fixed: bool, max_rows: int = 4) -> tuple[list, list, torch.Tensor]:
    """Seven requests of different prompt lengths and answer lengths through a batch of
    `max_rows` rows, admitted as rows free up (rows join and leave mid-run); the last one fills
    the cache to its last position. Their answers, log-probabilities and the cache's lengths."""
    async def run() -> tuple[list, list, torch.Tensor]:
        batch = continuous_batching.RunningBatch(model, prefix_cache.PrefixCache(0), CONTEXT, max_rows,
                                                 fixed_steps=fixed)
        assert (batch.graphs is not None) == fixed
        generator = torch.Generator().manual_seed(3)
        shapes = [(5, 9), (12, 3), (3, 14), (20, 6), (8, 1), (9, 11), (30, CONTEXT - 30)]
        requests = [continuous_batching.Request(torch.randint(0, 256, (p,), generator=generator).tolist(), n,
                                                0.0, i, logprobs=0) for i, (p, n) in enumerate(shapes)]
        waiting, results = list(requests), {}
        while waiting or batch.rows or batch.prefilling:
            free = max_rows - len(batch.rows) - batch.waiting()
            batch.admit(waiting[:free])
            del waiting[:free]
            batch.prefill()
            if batch.rows:
                for request, result in batch.step():
                    results[id(request)] = result
                assert batch.cache is not None
                # a free row holds length 0, so a fixed step's write there stays in the cache
                assert batch.cache.lengths[len(batch.rows):].eq(0).all()
                batch.feed()
        assert batch.cache is not None
        return ([results[id(r)][0] for r in requests],
                [[e.logprob for e in r.answer_logprobs or []] for r in requests], batch.cache.lengths.clone())

    return asyncio.run(run())


@pytest.mark.parametrize("mode", ["none", "fusedkv", "fusedkv-lite"])
def test_the_fixed_step_answers_what_the_step_over_the_rows_in_use_answers(mode: str) -> None:
    model = build(mode)
    texts, logprobs, _ = _serve(model, fixed=False)
    fixed_texts, fixed_logprobs, lengths = _serve(model, fixed=True)
    assert fixed_texts == texts
    for mine, theirs in zip(fixed_logprobs, logprobs, strict=True):
        assert mine == pytest.approx(theirs, abs=1e-5)
    assert len(logprobs[-1]) == CONTEXT - 30  # the last request filled the cache
    assert lengths.eq(0).all()  # every row freed at the end


def test_a_cpu_model_is_not_captured_and_steps_eagerly() -> None:
    model = build("none")
    assert not decode_graphs.capturable(model)
    moe = models.build_model(models.ModelConfig(layers=2, width=32, heads=2, vocabulary=256, context=16,
                                                moe=models.MoEConfig(experts=4, top_k=2)))
    assert not decode_graphs.capturable(moe)
    cache = model.build_ragged_cache(4, CONTEXT)
    graphs = decode_graphs.DecodeGraphs(model, cache, 4)
    assert not graphs.captured
    with pytest.raises(ValueError, match="fixed step of 5 rows in a cache of 4"):
        cache.begin_fixed_step(5)


def test_a_fixed_step_never_writes_outside_the_cache() -> None:
    """A row at the cache's last position: its write is clamped there, not past the end (a
    device-side index error on a GPU, which ends the process)."""
    model = build("none")
    cache = model.build_ragged_cache(2, 8)
    cache.lengths[1] = 8  # stale: what a row that filled the cache would leave if not freed
    with torch.no_grad():
        logits = model.forward_fixed_step(torch.zeros(2, 1, dtype=torch.long), cache)
    assert logits.shape == (2, 256) and cache.fixed_rows is None and cache.key_mask is None


def test_a_batch_grown_past_its_buckets_steps_eagerly() -> None:
    """run_to_end with more requests than maxBatch grows the cache past the largest bucket: those
    steps run over the rows in use (the bucket lookup raised StopIteration)."""
    model = build("none")

    async def run() -> tuple[list, list]:
        requests = [continuous_batching.Request([65 + i, 66, 67], 4, 0.0, i) for i in range(3)]
        def batch(fixed_steps: bool) -> continuous_batching.RunningBatch:
            return continuous_batching.RunningBatch(model, prefix_cache.PrefixCache(0), CONTEXT, 2,
                                                    fixed_steps=fixed_steps)

        fixed, plain = batch(True), batch(False)
        again = [continuous_batching.Request(list(r.tokens), 4, 0.0, r.seed) for r in requests]
        return fixed.run_to_end(requests), plain.run_to_end(again)

    fixed, plain = asyncio.run(run())
    assert [text for text, *_ in fixed] == [text for text, *_ in plain]
