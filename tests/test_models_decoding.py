"""Cached incremental decoding must reproduce the full forward pass exactly (fp32, 1e-5), for
every KV-sharing mode, with GQA and with MoE, and for pipeline-style slicing of the blocks; and so
must continuous batching (a ragged cache: sequences of different lengths joining and leaving a
running batch)."""

from __future__ import annotations

import pytest
import torch

from huorn import models

pytestmark = pytest.mark.usefixtures("single_thread")


MODES = ["none", "fusedkv", "fusedkv-lite"]


def build_decoder(mode: str, moe: models.MoEConfig | None = None, kv_heads: int | None = None,
                  seed: int = 0) -> models.Decoder:
    torch.manual_seed(seed)
    cfg = models.ModelConfig(layers=4, width=64, heads=4, kv_heads=kv_heads, vocabulary=97, context=48,
                             kv_sharing=mode, moe=moe)
    decoder = models.build_model(cfg).eval()
    # Move fusion weights off their Lite init so FusedKV is really fused in these tests.
    with torch.no_grad():
        for name, param in decoder.named_parameters():
            if name.endswith(("k_fuse", "v_fuse")):
                param.uniform_(-1.0, 1.5)
    return decoder


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["dense", "gqa", "moe-topk", "moe-prototypes"])
def test_cached_decoding_equals_full_forward(mode: str, variant: str) -> None:
    moe = {
        "moe-topk": models.MoEConfig(experts=4, top_k=2),
        "moe-prototypes": models.MoEConfig(experts=6, prototypes=3),
    }.get(variant)
    decoder = build_decoder(mode, moe=moe, kv_heads=2 if variant == "gqa" else None)
    tokens = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = decoder(tokens)
        cache = decoder.build_cache(batch=3, max_length=40)
        pieces = [decoder.forward_step(tokens[:, :9], cache)]  # prefill
        pieces += [decoder.forward_step(tokens[:, i:i + 1], cache) for i in range(9, 33)]
        pieces.append(decoder.forward_step(tokens[:, 33:], cache))  # a chunk after a prefix
    incremental = torch.cat(pieces, dim=1)
    assert cache.length == 40
    assert (incremental - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_generate_matches_greedy_argmax_of_full_forward(mode: str) -> None:
    decoder = build_decoder(mode)
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    out = decoder.generate(prompt, new_tokens=12)
    assert out.shape == (2, 17)
    with torch.no_grad():
        logits, _ = decoder(out[:, :-1])
    assert torch.equal(out[:, 5:], logits[:, 4:].argmax(dim=-1))


@pytest.mark.parametrize("mode", MODES)
def test_blocks_run_in_pipeline_slices_equal_one_pass(mode: str) -> None:
    """A pipeline stage receives (hidden, SharedKV tensors) and continues where the last left off."""
    decoder = build_decoder(mode)
    tokens = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full, _ = decoder(tokens)
        x = decoder.embed_tokens(tokens)
        shared = models.SharedKV()
        for start, end in [(0, 1), (1, 3), (3, 4)]:
            sent = [t.clone() if t is not None else None for t in shared.tensors()]
            x, shared = decoder.forward_blocks(x.clone(), start, end, models.SharedKV.from_tensors(sent))
        staged, _ = decoder.forward_head(x)
    assert (staged - full).abs().max().item() <= 1e-6


def test_upper_fused_layer_without_shared_kv_names_the_fix() -> None:
    decoder = build_decoder("fusedkv")
    x = decoder.embed_tokens(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="lower half first"):
        decoder.forward_blocks(x, 2, 4)


def test_cache_overflow_is_a_clear_error() -> None:
    decoder = build_decoder("none")
    cache = decoder.build_cache(batch=1, max_length=4)
    with pytest.raises(ValueError, match="max_length=4"):
        decoder.forward_step(torch.zeros(1, 5, dtype=torch.long), cache)


@pytest.mark.parametrize("mode", MODES)
def test_bf16_cached_decoding_stays_close_to_full_forward(mode: str) -> None:
    """The one-query FusedKV path and the cache must also work in the serving dtype."""
    decoder = build_decoder(mode).to(torch.bfloat16)
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full, _ = decoder(tokens)
        cache = decoder.build_cache(batch=2, max_length=24)
        assert cache.keys[0].dtype == torch.bfloat16
        pieces = [decoder.forward_step(tokens[:, :8], cache)]
        pieces += [decoder.forward_step(tokens[:, i:i + 1], cache) for i in range(8, 24)]
    incremental = torch.cat(pieces, dim=1).float()
    scale = full.float().abs().max().item()
    assert (incremental - full.float()).abs().max().item() <= 0.05 * scale


def test_sampled_generation_is_reproducible_with_a_seeded_generator() -> None:
    decoder = build_decoder("fusedkv")
    prompt = torch.zeros(2, 3, dtype=torch.long)
    first = decoder.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(9))
    second = decoder.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(9))
    other = decoder.generate(prompt, 10, temperature=1.0, generator=torch.Generator().manual_seed(10))
    assert torch.equal(first, second)
    assert not torch.equal(first, other)


def test_last_only_prefill_returns_the_last_position_of_the_full_logits() -> None:
    decoder = build_decoder("fusedkv-lite")
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        full = decoder.forward_step(tokens, decoder.build_cache(2, 12))
        last = decoder.forward_step(tokens, decoder.build_cache(2, 12), last_only=True)
    assert last.shape == (2, 1, 97)
    assert torch.allclose(last[:, 0], full[:, -1], atol=1e-6)


def test_shared_kv_round_trips_through_a_tensor_list_and_rejects_a_wrong_length() -> None:
    k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    shared = models.SharedKV.from_tensors(models.SharedKV(k, v, k, None).tensors())
    assert shared.k_first is k and shared.v_last is None and not shared.is_complete()
    with pytest.raises(ValueError, match="expected 4"):
        models.SharedKV.from_tensors([k, v])


def test_flops_per_token_follows_the_palm_count() -> None:
    cfg = models.ModelConfig(layers=2, width=32, heads=4, vocabulary=50)
    decoder = models.build_model(cfg)
    per_layer = 4 * 32 * 32 + 3 * 32 * cfg.ffn_hidden + 2 * 32  # attention, SwiGLU, two RMSNorms
    non_embedding = 2 * per_layer + 32 + 32 * 50  # final norm and head
    assert decoder.count_parameters(include_embedding=False) == non_embedding
    assert decoder.flops_per_token(64) == 6 * non_embedding + 12 * 2 * 32 * 64


def test_lite_upper_layers_need_only_k_of_layer_n_and_v_of_layer_1() -> None:
    """A pipeline stage of a Lite model may send two tensors instead of four."""
    decoder = build_decoder("fusedkv-lite")
    tokens = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(11))
    with torch.no_grad():
        full, _ = decoder(tokens)
        x, shared = decoder.forward_blocks(decoder.embed_tokens(tokens), 0, 2)
        x, _ = decoder.forward_blocks(x, 2, 4, models.SharedKV(k_last=shared.k_last, v_first=shared.v_first))
        staged, _ = decoder.forward_head(x)
    assert torch.allclose(staged, full, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", ["dense", "gqa", "moe-prototypes"])
def test_ragged_decoding_equals_each_sequences_full_forward(mode: str, variant: str) -> None:
    """Four sequences of different prompt lengths: two start together, a third joins after 3
    steps, the first leaves after 6 (the last row moves into its place) and a fourth joins in the
    freed row, over stale K/V longer than its own. Every logit of every step equals the one the
    full forward pass of that sequence alone gives."""
    moe = models.MoEConfig(experts=6, prototypes=3) if variant == "moe-prototypes" else None
    decoder = build_decoder(mode, moe=moe, kv_heads=2 if variant == "gqa" else None)
    generator = torch.Generator().manual_seed(3)
    sequences = [torch.randint(0, 97, (1, n), generator=generator) for n in (40, 30, 36, 28)]
    prompts = [13, 5, 9, 2]  # the rest of each sequence is fed a token a step
    with torch.no_grad():
        fulls = [decoder(seq)[0][0] for seq in sequences]
        cache = models.RaggedKVCache(decoder.cfg.shared_layers, 1, decoder.cfg.n_kv_heads, 48,
                                     decoder.cfg.head_dim)
        rows: list[int] = []  # the sequence in each row in use
        fed: dict[int, int] = {}  # tokens of each sequence in the cache

        def join(seq: int) -> None:
            plain = decoder.build_cache(1, prompts[seq])
            logits = decoder.forward_step(sequences[seq][:, :prompts[seq]], plain)
            assert (logits[0] - fulls[seq][:prompts[seq]]).abs().max() <= 1e-5
            cache.grow(len(rows) + 1)
            cache.place(len(rows), plain, 0, prompts[seq])
            rows.append(seq)
            cache.rows = len(rows)
            fed[seq] = prompts[seq]

        def leave(seq: int) -> None:
            row, last = rows.index(seq), len(rows) - 1
            if row != last:
                cache.move(last, row)
                rows[row] = rows[last]
            rows.pop()
            cache.rows = len(rows)

        join(0)
        join(1)
        for step in range(16):
            if step == 3:
                join(2)
            if step == 6:
                leave(0)
                join(3)
            tokens = torch.cat([sequences[seq][:, fed[seq]:fed[seq] + 1] for seq in rows])
            logits = decoder.forward_step(tokens, cache, last_only=True)[:, -1]
            for row, seq in enumerate(rows):
                assert (logits[row] - fulls[seq][fed[seq]]).abs().max() <= 1e-5, (step, seq)
                fed[seq] += 1
    assert cache.capacity == 3 and fed == {0: 19, 1: 21, 2: 22, 3: 12}


def test_a_ragged_cache_refuses_what_it_cannot_hold() -> None:
    decoder = build_decoder("none")
    cfg = decoder.cfg
    cache = models.RaggedKVCache(cfg.shared_layers, 2, cfg.n_kv_heads, 8, cfg.head_dim)
    with torch.no_grad():
        with pytest.raises(ValueError, match="no row in use"):
            decoder.forward_step(torch.zeros(1, 1, dtype=torch.long), cache)
        plain = decoder.build_cache(1, 8)
        decoder.forward_step(torch.zeros(1, 8, dtype=torch.long), plain)
        cache.place(0, plain, 0, 8)
        cache.rows = 1
        with pytest.raises(ValueError, match="one token per row"):
            decoder.forward_step(torch.zeros(1, 2, dtype=torch.long), cache)
        with pytest.raises(ValueError, match="9 tokens exceed max_length=8"):
            decoder.forward_step(torch.zeros(1, 1, dtype=torch.long), cache)


def test_attention_against_a_cache_never_asks_cudnn_whose_plans_are_built_per_shape(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Decoding meets a new shape at nearly every step (the keys grow, rows come and go), and
    cuDNN's attention builds a plan per shape: on an H100 that was 40-50 ms of CPU in each step of
    a 24-layer model whose kernels ran in 2.5 ms. Attention against a cache runs with cuDNN's
    backend off; a forward pass without one (training: fixed shapes) keeps the default."""
    from huorn.models import attention

    seen: list[tuple[bool, bool]] = []  # (a cache given, cuDNN allowed) at each attention call
    inner = attention.F.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        seen.append((q.shape[2] == 1, torch.backends.cuda.cudnn_sdp_enabled()))
        return inner(q, *args, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    decoder = build_decoder("none")
    prompt = torch.randint(0, 97, (2, 6))
    with torch.no_grad():
        decoder(prompt)  # no cache
        trained = list(seen)
        seen.clear()
        decoder.generate(prompt, 3)  # a prefill, then steps of one token, against a cache
    assert trained and all(allowed for _, allowed in trained)
    assert seen and not any(allowed for _, allowed in seen)
    assert any(one for one, _ in seen)  # the decoding steps were among them
    assert torch.backends.cuda.cudnn_sdp_enabled()  # put back after each call
