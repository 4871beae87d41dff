"""Cached incremental decoding must reproduce the full forward pass exactly (fp32, 1e-5), for
every KV-sharing mode, with GQA and with MoE, and for pipeline-style slicing of the blocks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from huorn import models


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    """One intra-op thread: on the loaded 2-core CI VM, two spin-waiting OpenMP threads make
    these small models several times slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
