"""The serving replica's prefix cache: a prompt that starts like an earlier one is prefilled only
from where it differs, and answers exactly as a full prefill would, with every K/V layout (plain,
FusedKV, FusedKV-lite, GQA, MoE); blocks are evicted least recently used, children before the
preamble they hang off; the HTTP answer and the metrics say how many prompt tokens came from it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import runtime_harness as harness
import torch

from huorn import models
from huorn.api import inference, training
from huorn.runtime import checkpoint, prefix_cache, serve
from huorn.runtime import config as run_config

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
SYSTEM = "You are a careful assistant. Answer in one line.\n"  # 49 bytes: three whole blocks
ARCHITECTURES = {
    "plain": {"layers": 2, "width": 32, "heads": 2, "context": 128},
    "fusedkv": {"layers": 4, "width": 32, "heads": 4, "kvHeads": 2, "context": 128, "kvSharing": "fusedkv"},
    "fusedkv-lite": {"layers": 4, "width": 32, "heads": 2, "context": 128, "kvSharing": "fusedkv-lite"},
    "moe": {"layers": 2, "width": 32, "heads": 2, "context": 128, "moe": {"experts": 4, "topK": 2}},
}


def _server(tmp_path: Path, architecture: dict, **serving: object) -> tuple[serve.Server, torch.nn.Module]:
    spec = training.ModelSpec.model_validate(architecture)
    torch.manual_seed(0)
    model = models.build_model(run_config.build_model_config(spec))
    checkpoint.save_checkpoint(tmp_path / "ckpt", 1, model, torch.optim.AdamW(model.parameters()),
                               {"model": spec.to_wire()}, rank=0, barrier=lambda: None)
    cfg = serve.ServeConfig.model_validate({
        "jobName": "chat", "host": "127.0.0.1", "port": 0, "runDir": str(tmp_path / "run"),
        "spec": {"virtualCluster": "x", "model": {"checkpoint": str(tmp_path / "ckpt"),
                                                   "architecture": architecture},
                 "serving": {"maxBatch": 8, "maxTokens": 128, **serving}}})
    loaded, _ = serve.load_model(cfg)
    return serve.Server(cfg, loaded), loaded


def _ask(server: serve.Server, prompts: list[str], max_tokens: int = 5) -> list[tuple[str, int, int]]:
    async def run() -> list[tuple[str, int, int]]:
        batch = [serve.Request(list(p.encode()), max_tokens, 0.0, 0) for p in prompts]
        return server.generate(batch)

    return asyncio.run(run())


def _greedy(model: torch.nn.Module, prompt: str, tokens: int = 5) -> str:
    ids = torch.tensor([list(prompt.encode())])
    return bytes(model.generate(ids, tokens)[0, ids.shape[1]:].tolist()).decode("utf-8", errors="replace")


def test_block_names_are_shared_exactly_by_shared_whole_blocks() -> None:
    a = prefix_cache.block_hashes(list(range(40)))
    b = prefix_cache.block_hashes([*range(32), 99, *range(33, 40)])
    c = prefix_cache.block_hashes([1000, *range(1, 40)])
    assert len(a) == 2 and len(prefix_cache.block_hashes(list(range(15)))) == 0
    assert a == b  # they differ only in the partial third block, which has no name
    assert a[0] != c[0] and a[1] != c[1]  # a change in block 0 renames every block after it
    assert prefix_cache.block_hashes(list(range(32)))[1] == a[1]
    # the last token is always computed: a 32-token prompt may reuse one block, not two
    assert prefix_cache.reusable_blocks(32, 2) == 1 and prefix_cache.reusable_blocks(33, 2) == 2


@pytest.mark.parametrize("layout", sorted(ARCHITECTURES))
def test_a_prompt_sharing_a_preamble_reuses_its_blocks_and_answers_as_a_full_prefill(
        tmp_path: Path, layout: str) -> None:
    server, model = _server(tmp_path, ARCHITECTURES[layout])
    first, second = SYSTEM + "Q: What is 2 + 3?\nA:", SYSTEM + "Q: Who wrote it?\nA:"
    [(text_1, _, cached_1)] = _ask(server, [first])
    [(text_2, _, cached_2)] = _ask(server, [second])
    assert cached_1 == 0 and cached_2 == 48  # SYSTEM's three whole blocks
    assert text_1 == _greedy(model, first) and text_2 == _greedy(model, second)
    # the same prompt again: all of its whole blocks but the one holding its last token
    [(text_3, _, cached_3)] = _ask(server, [second])
    assert text_3 == text_2 and cached_3 == 64


def test_reused_prefill_logits_match_a_full_prefill(tmp_path: Path) -> None:
    server, model = _server(tmp_path, ARCHITECTURES["fusedkv"])
    prompt = SYSTEM + "Q: And the capital of France?\nA:"
    _ask(server, [SYSTEM + "Q: something else entirely.....\nA:"])
    ids = torch.tensor([list(prompt.encode())])

    async def prefill() -> tuple[torch.Tensor, int]:
        server.running.admit([serve.Request(ids[0].tolist(), 1, 0.0, 0)])
        while server.running.prefilling:  # in chunks of 7 tokens after the cached blocks
            server.running.prefill(7)
        [row] = server.running.rows
        return row.logits, row.cached

    with torch.no_grad():
        reused, skipped = asyncio.run(prefill())
        full = model.forward_step(ids, model.build_cache(1, ids.shape[1] + 1), last_only=True)[0, -1].float()
    assert skipped == 48
    torch.testing.assert_close(reused, full, rtol=1e-4, atol=1e-5)


def test_each_row_of_a_batch_reuses_its_own_blocks(tmp_path: Path) -> None:
    server, model = _server(tmp_path, ARCHITECTURES["fusedkv"])
    _ask(server, [SYSTEM + "0123456789abcdef"])  # 65 bytes: SYSTEM's three blocks and one more
    rows = [SYSTEM + "0123456789abcdXY", "Z" + SYSTEM[1:] + "0123456789abcdef"]
    answers = _ask(server, rows)
    assert [cached for _, _, cached in answers] == [48, 0]  # the second row shares no whole block
    assert [text for text, _, _ in answers] == [_greedy(model, p) for p in rows]
    rows = [SYSTEM + "0123456789abcdQQ", SYSTEM + "0123456789abcdef", "Z" + SYSTEM[1:] + "0123456789abcdQQ"]
    again = _ask(server, rows)
    assert [cached for _, _, cached in again] == [48, 64, 48]
    assert [text for text, _, _ in again] == [_greedy(model, p) for p in rows]


def test_eviction_is_least_recently_used_and_keeps_the_preamble_over_its_branches() -> None:
    cache = prefix_cache.PrefixCache(capacity_tokens=48, block=16)  # three blocks
    kv = models.cache.KVCache(1, 1, 1, 64, 4)
    a, b, c = (prefix_cache.block_hashes(t, 16) for t in
               ([*range(16), *range(100, 116)], [*range(16), *range(200, 216)], list(range(300, 316))))
    cache.store(kv, 0, a)
    cache.store(kv, 0, b)  # shares a's first block
    assert len(cache) == 3
    cache.store(kv, 0, c)
    # the least recently used block was a's second: b's branch is newer and the shared first block
    # was touched after each branch
    assert cache.match(a) == 1 and cache.match(b) == 2 and cache.match(c) == 1
    assert cache.stats.evicted_blocks == 1
    assert cache.nbytes() == 3 * 2 * 16 * 4 * 4  # three blocks of K and V, 16 tokens × 4 floats


def test_a_cache_of_zero_tokens_keeps_nothing_and_a_negative_one_is_refused(tmp_path: Path) -> None:
    server, _ = _server(tmp_path, ARCHITECTURES["plain"], prefixCacheTokens=0)
    _ask(server, [SYSTEM + "Q: 1?\nA:"])
    assert _ask(server, [SYSTEM + "Q: 2?\nA:"])[0][2] == 0 and len(server.prefixes) == 0
    with pytest.raises(ValueError, match="prefixCacheTokens"):
        inference.ServingLimits.model_validate({"prefixCacheTokens": -1})


def test_the_answer_and_the_metrics_count_the_cached_tokens(tmp_path: Path) -> None:
    server, _ = _server(tmp_path, ARCHITECTURES["plain"])

    async def work() -> tuple[list[dict], str]:
        async with harness.serving_app(server.app()) as session:
            answers = []
            for question in ("Q: 1 + 1?\nA:", "Q: 2 + 2?\nA:"):
                async with session.post("/v1/completions",
                                        json={"prompt": SYSTEM + question, "max_tokens": 3}) as r:
                    answers.append(await r.json())
            async with session.get("/metrics") as r:
                return answers, await r.text()

    answers, metrics = asyncio.run(work())
    assert [a["cached_tokens"] for a in answers] == [0, 48]
    prompt_tokens = 2 * len(SYSTEM + "Q: 1 + 1?\nA:")
    assert 'huorn_serve_prompt_tokens_total{source="cache"} 48.0' in metrics
    assert f"huorn_serve_prefix_cache_bytes {float(server.prefixes.nbytes())}" in metrics
    assert server.prefixes.nbytes() > 0
    assert f'huorn_serve_prompt_tokens_total{{source="prefill"}} {prompt_tokens - 48}.0' in metrics


def test_one_request_cannot_fail_the_batch_it_shares(tmp_path: Path) -> None:
    """A tiny temperature made the row's probabilities NaN, and the whole batch (other clients'
    requests of the same prompt length) failed with it; NaN or Infinity are refused with 400."""
    server, model = _server(tmp_path, ARCHITECTURES["plain"])
    prompts = [SYSTEM + "Q: 1 + 1?\nA:", SYSTEM + "Q: 2 + 2?\nA:"]

    async def work() -> tuple[list[tuple[str, int, int]], list[tuple[int, dict]]]:
        batch = [serve.Request(list(prompts[0].encode()), 4, 0.0, 0),
                 serve.Request(list(prompts[1].encode()), 4, 1e-45, 0)]
        answers = server.generate(batch)
        refused = []
        async with harness.serving_app(server.app()) as session:
            for body in ('{"prompt": "Q?", "temperature": NaN}', '{"prompt": "Q?", "max_tokens": Infinity}'):
                async with session.post("/v1/completions", data=body) as r:
                    refused.append((r.status, await r.json()))
        return answers, refused

    answers, refused = asyncio.run(work())
    assert [text for text, _, _ in answers] == [_greedy(model, p, 4) for p in prompts]  # tiny: greedy
    assert [status for status, _ in refused] == [400, 400]
    assert [body["error"]["param"] for _, body in refused] == ["temperature", "max_tokens"]


def test_a_conversations_next_turn_finds_the_last_answer_cached(tmp_path: Path) -> None:
    server, model = _server(tmp_path, ARCHITECTURES["fusedkv"])
    first = list((SYSTEM + "Q: Name a river.\nA:").encode())  # 67 tokens

    async def turn(tokens: list[int], max_tokens: int) -> tuple[list[int], int]:
        [(_, _, cached)] = server.generate([serve.Request(tokens, max_tokens, 0.0, 0)])
        return cached, model.generate(torch.tensor([tokens]), max_tokens)[0, len(tokens):].tolist()

    # the first answer, 30 tokens: 29 of them fed back, so the prompt and answer hold 96 tokens of
    # K/V, six whole blocks
    cached, answer = asyncio.run(turn(first, 30))
    assert cached == 0
    second = first + answer + list(b"\nQ: And a lake?\nA:")
    cached, _ = asyncio.run(turn(second, 3))
    assert cached == 96  # the prompt's four whole blocks and the two the answer completed
    # and what the turn answers is what a full prefill answers
    [(text, _, _)] = _ask_tokens(server, second, 3)
    assert text == bytes(model.generate(torch.tensor([second]), 3)[0, len(second):].tolist()).decode(
        "utf-8", errors="replace")


def _ask_tokens(server: serve.Server, tokens: list[int], max_tokens: int) -> list[tuple[str, int, int]]:
    async def run() -> list[tuple[str, int, int]]:
        return server.generate([serve.Request(tokens, max_tokens, 0.0, 0)])

    return asyncio.run(run())


def test_a_prompt_admitted_beside_others_keeps_the_blocks_it_matched_when_their_stores_evict(
        tmp_path: Path) -> None:
    """Prompts admitted together are prefilled in groups (one prompt length and cached span
    each): an earlier group's new blocks, stored into a full cache, evicted blocks that a later
    group had matched but not loaded yet (its prefill then failed with a KeyError, and with it
    every request of the step)."""
    server, model = _server(tmp_path, ARCHITECTURES["plain"], prefixCacheTokens=48)  # three blocks
    _ask(server, [SYSTEM + "Q: 1?\nA:"])  # SYSTEM's three blocks fill the cache
    rows = ["X" * 40, SYSTEM + "Q: 2?\nA:"]  # the first brings two new blocks, the second reuses 48
    answers = _ask(server, rows)
    assert [cached for _, _, cached in answers] == [0, 48]
    assert [text for text, _, _ in answers] == [_greedy(model, p) for p in rows]
