"""FusedKV and FusedKV-Lite against a reference written directly from the paper's formulas
(arXiv 2512.03870), sharing only the weights with the implementation under test:

    layers 1..n (n = L/2) compute K_i = RoPE(x W_k), V_i = x W_v and cache them;
    FusedKV   above n: K_i = a_i1 ⊙ K_1 + a_in ⊙ K_n,   V_i = b_i1 ⊙ V_1 + b_in ⊙ V_n;
    Lite      above n: K_i = K_n,                       V_i = V_1.

The reference spells out RoPE as an explicit 2x2 rotation of each channel pair (j, j + D/2),
and attention as softmax(q kᵀ / sqrt(D) + causal mask) v, one head at a time in float64."""

from __future__ import annotations

import math

import pytest
import torch

from huorn import models

pytestmark = pytest.mark.usefixtures("single_thread")


LAYERS, WIDTH, HEADS, KV_HEADS, VOCAB, THETA = 4, 48, 4, 2, 61, 10000.0
HEAD = WIDTH // HEADS


def build_decoder(mode: str, seed: int = 0) -> models.Decoder:
    torch.manual_seed(seed)
    cfg = models.ModelConfig(layers=LAYERS, width=WIDTH, heads=HEADS, kv_heads=KV_HEADS, vocabulary=VOCAB,
                             context=32, kv_sharing=mode, rope_theta=THETA)
    decoder = models.build_model(cfg).eval()
    with torch.no_grad():
        for name, param in decoder.named_parameters():
            if name.endswith(("k_fuse", "v_fuse")):
                param.uniform_(-1.0, 1.5)
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return decoder


def rotate(x: torch.Tensor, start: int) -> torch.Tensor:
    """RoPE on x [T, D]: rotate the pair (x_j, x_{j+D/2}) by angle pos · θ^(-2j/D)."""
    out = x.clone()
    half = x.shape[1] // 2
    for t in range(x.shape[0]):
        for j in range(half):
            angle = (start + t) * THETA ** (-2.0 * j / x.shape[1])
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[t, j].item(), x[t, j + half].item()
            out[t, j], out[t, j + half] = a * c - b * s, a * s + b * c
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight


def reference_logits(decoder: models.Decoder, tokens: torch.Tensor, mode: str, start: int = 0,
                     pair_shared: bool = True) -> torch.Tensor:
    """One sequence [T] -> logits [T, V]. `pair_shared=False` gives every key channel its own
    weight (breaking the paper's rule) so the relative-position test can show why it matters."""
    w = {k: v.double() for k, v in decoder.state_dict().items()}
    length, n, group = tokens.shape[0], LAYERS // 2, HEADS // KV_HEADS
    x = w["embed.weight"][tokens]
    kept: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms_norm(x, w[p + "attention_norm.weight"])
        q = (h @ w[p + "attention.wq.weight"].T).view(length, HEADS, HEAD)
        if i < n or mode == "none":
            k_raw = (h @ w[p + "attention.wk.weight"].T).view(length, KV_HEADS, HEAD)
            v_raw = (h @ w[p + "attention.wv.weight"].T).view(length, KV_HEADS, HEAD)
            ks = [rotate(k_raw[:, g], start) for g in range(KV_HEADS)]
            vs = [v_raw[:, g] for g in range(KV_HEADS)]
            kept[i] = (ks, vs)
        elif mode == "fusedkv-lite":
            ks, vs = kept[n - 1][0], kept[0][1]
        else:
            a, b = w[p + "attention.k_fuse"], w[p + "attention.v_fuse"]
            ks, vs = [], []
            for g in range(KV_HEADS):
                if pair_shared:
                    a1, an = torch.cat([a[0, g], a[0, g]]), torch.cat([a[1, g], a[1, g]])
                else:
                    a1 = torch.cat([a[0, g], a[0, g].flip(0) * 0.5])
                    an = torch.cat([a[1, g], a[1, g].flip(0) * 0.5])
                ks.append(a1 * kept[0][0][g] + an * kept[n - 1][0][g])
                vs.append(b[0, g] * kept[0][1][g] + b[1, g] * kept[n - 1][1][g])
        heads = []
        mask = torch.full((length, length), float("-inf"), dtype=torch.float64).triu(1)
        for head in range(HEADS):
            qh = rotate(q[:, head], start)
            kh, vh = ks[head // group], vs[head // group]
            heads.append(torch.softmax(qh @ kh.T / math.sqrt(HEAD) + mask, dim=-1) @ vh)
        x = x + torch.cat(heads, dim=-1) @ w[p + "attention.wo.weight"].T
        h = rms_norm(x, w[p + "ffn_norm.weight"])
        gate = torch.nn.functional.silu(h @ w[p + "ffn.w1.weight"].T) * (h @ w[p + "ffn.w3.weight"].T)
        x = x + gate @ w[p + "ffn.w2.weight"].T
    return rms_norm(x, w["norm.weight"]) @ w["head.weight"].T


@pytest.mark.parametrize("mode", ["none", "fusedkv", "fusedkv-lite"])
def test_decoder_equals_reference_from_formulas(mode: str) -> None:
    decoder = build_decoder(mode)
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits, _ = decoder(tokens)
    for row in range(2):
        expected = reference_logits(decoder, tokens[row], mode)
        assert (logits[row].double() - expected).abs().max().item() < 1e-4


def test_fused_and_lite_differ_from_each_other_and_from_standard() -> None:
    """Guards against the modes silently sharing one code path."""
    tokens = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        outs = {m: build_decoder(m)(tokens)[0] for m in ["none", "fusedkv", "fusedkv-lite"]}
    assert (outs["fusedkv"] - outs["fusedkv-lite"]).abs().max() > 1e-3
    assert (outs["none"] - outs["fusedkv-lite"]).abs().max() > 1e-3


def test_rotary_pairs_share_one_fusion_weight() -> None:
    decoder = build_decoder("fusedkv")
    attention = decoder.layers[LAYERS // 2].attention
    assert attention.k_fuse.shape == (2, KV_HEADS, HEAD // 2)  # one weight per rotary pair
    assert attention.v_fuse.shape == (2, KV_HEADS, HEAD)  # values are not rotated: one per channel
    expanded = models.attention.expand_pair_weight(attention.k_fuse[0])
    assert torch.equal(expanded[..., : HEAD // 2], expanded[..., HEAD // 2:])


def test_shared_pair_weight_keeps_scores_relative_position_only() -> None:
    """Shifting every position by 37 leaves the output unchanged only if pairs share a weight."""
    decoder = build_decoder("fusedkv")
    tokens = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        x = decoder.embed_tokens(tokens)
        at_zero, _ = decoder.forward_blocks(x, position=0)
        shifted, _ = decoder.forward_blocks(x, position=37)
    assert (at_zero - shifted).abs().max().item() < 1e-4
    unshared_zero = reference_logits(decoder, tokens[0], "fusedkv", start=0, pair_shared=False)
    unshared_shift = reference_logits(decoder, tokens[0], "fusedkv", start=37, pair_shared=False)
    assert (unshared_zero - unshared_shift).abs().max().item() > 1e-3


@pytest.mark.parametrize("mode", ["fusedkv", "fusedkv-lite"])
@pytest.mark.parametrize("kv_heads", [None, 2])
def test_fused_cache_is_exactly_half_of_standard(mode: str, kv_heads: int | None) -> None:
    def build(sharing: str) -> models.Decoder:
        return models.build_model(models.ModelConfig(layers=6, width=64, heads=4, kv_heads=kv_heads,
                                                     kv_sharing=sharing, context=64))
    standard, fused = build("none"), build(mode)
    standard_cache, fused_cache = standard.build_cache(2, 64), fused.build_cache(2, 64)
    kv_per_layer = 2 * 2 * (kv_heads or 4) * 64 * 16 * 4  # K and V, batch, heads, length, dim, fp32
    assert standard_cache.nbytes() == 6 * kv_per_layer
    assert fused_cache.nbytes() * 2 == standard_cache.nbytes()
    # Fusion weights are reported apart: 3 upper layers × (K: 2 × kv × D/2 + V: 2 × kv × D) fp32.
    expected_fusion = 3 * (2 * (kv_heads or 4) * 8 + 2 * (kv_heads or 4) * 16) * 4 if mode == "fusedkv" else 0
    assert fused.fusion_nbytes() == expected_fusion
    tokens = torch.zeros(2, 10, dtype=torch.long)
    with torch.no_grad():
        standard.forward_step(tokens, standard_cache)
        fused.forward_step(tokens, fused_cache)
    assert fused_cache.used_nbytes() * 2 == standard_cache.used_nbytes()


def test_upper_fused_layers_have_no_key_value_projections() -> None:
    fused = build_decoder("fusedkv")
    names = {n for n, _ in fused.named_parameters()}
    assert "layers.1.attention.wk.weight" in names
    assert "layers.2.attention.wk.weight" not in names and "layers.3.attention.wv.weight" not in names


def test_fusion_weights_learn_from_the_start_at_the_lite_point() -> None:
    """Initialised at Lite (K from layer n, V from layer 1), yet all four weights get gradients."""
    torch.manual_seed(0)
    cfg = models.ModelConfig(layers=4, width=32, heads=2, vocabulary=40, kv_sharing="fusedkv")
    fused, lite = models.build_model(cfg), models.build_model(
        models.ModelConfig(**{**cfg.__dict__, "kv_sharing": "fusedkv-lite"}))
    lite.load_state_dict(fused.state_dict(), strict=False)  # Lite has no fusion weights
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(1))
    _, loss = fused(tokens, tokens)
    assert torch.allclose(loss, lite(tokens, tokens)[1], atol=1e-6)
    loss.backward()
    attention = fused.layers[3].attention
    assert attention.k_fuse.grad.abs().min(dim=-1).values.gt(0).all()
    assert attention.v_fuse.grad.abs().min(dim=-1).values.gt(0).all()
