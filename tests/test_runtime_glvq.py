"""GLVQ: the compander, the baseline as plain round-to-nearest, a learned lattice that beats it
on its calibration error, the bits stored, and a whole decoder quantised in place."""

from __future__ import annotations

import pytest
import torch

from huorn import models
from huorn.api import training
from huorn.runtime import config as run_config
from huorn.runtime import glvq


def test_expand_inverts_compand_and_a_tiny_mu_is_the_identity() -> None:
    x = torch.linspace(-1, 1, 101)
    for mu in (1e-3, 4.0, 255.0):
        m = torch.tensor(mu)
        assert torch.allclose(glvq.expand(glvq.compand(x, m), m), x, atol=1e-5)
    assert torch.allclose(glvq.compand(x, torch.tensor(1e-3)), x, atol=1e-3)


def test_the_baseline_is_round_to_nearest_per_row() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(16, 32), torch.randn(64, 32)
    layer, _ = glvq.quantize_linear(w, x, bits=3, d=8, learn=False)
    scales = w.abs().amax(dim=1, keepdim=True)
    delta = 1 / (2**2 - 0.5)  # 8 levels (z + 1/2)·δ, z in -4..3: ±δ/2 ... ±1
    manual = (torch.clamp(torch.floor(w / scales / delta), -4, 3) + 0.5) * delta * scales
    assert torch.allclose(layer.decode(), manual, atol=2e-3 * float(scales.max()))
    assert int(layer.codes.min()) == -4 and int(layer.codes.max()) == 3, "every level is used"


def test_each_rows_largest_weight_is_kept_and_one_bit_is_its_sign() -> None:
    """The levels are symmetric and reach ±1: integer points with no half step had spent a level
    (a row's largest weight fell to the level below it) and decoded every weight to 0 at 1 bit."""
    torch.manual_seed(0)
    w, x = torch.randn(16, 32), torch.randn(64, 32)
    scales = w.abs().amax(dim=1)
    biggest = w.abs().argmax(dim=1)
    rows = torch.arange(16)
    for bits in (1, 2, 3, 4):
        decoded = glvq.quantize_linear(w, x, bits=bits, d=8, learn=False)[0].decode()
        assert torch.allclose(decoded[rows, biggest], w[rows, biggest], rtol=2e-3), bits
        levels = torch.unique((decoded / scales[:, None]).round(decimals=3))
        assert len(levels) == 2**bits and torch.allclose(levels, -levels.flip(0)), (bits, levels)
    one_bit = glvq.quantize_linear(w, x, bits=1, d=8, learn=False)[0].decode()
    assert torch.allclose(one_bit, torch.sign(w) * scales[:, None], rtol=2e-3)


def test_a_learned_lattice_beats_round_to_nearest_on_correlated_weights() -> None:
    torch.manual_seed(1)
    # Weights whose neighbouring inputs move together: a lattice aligned with them fits better
    # than the cubic one round-to-nearest uses.
    base = torch.randn(64, 12, 1) * torch.tensor([1.0, 0.9, 0.8, 0.7, -0.6, -0.5, 0.4, 0.3])
    w = (base + 0.1 * torch.randn(64, 12, 8)).reshape(64, 96)
    x = torch.randn(512, 96)
    for bits in (2, 3, 4):
        _, rtn = glvq.quantize_linear(w, x, bits, 8, learn=False)
        _, learned = glvq.quantize_linear(w, x, bits, 8, steps=150)
        assert learned["error_before"] == pytest.approx(rtn["error_after"])  # it starts at the baseline
        assert learned["error_after"] < 0.97 * rtn["error_after"], (bits, learned, rtn)


def test_stored_bits_count_codes_scales_and_only_a_learned_lattice_and_mu() -> None:
    w, x = torch.randn(128, 64), torch.randn(32, 64)
    layer, _ = glvq.quantize_linear(w, x, bits=2, d=8, rows_per_lattice=64, steps=2)
    assert layer.stored_bits() == 128 * 64 * 2 + 16 * (2 * 64 + 128 + 1)
    # round-to-nearest's G = δ·I and μ follow from the bits: nothing of them is stored
    rtn, _ = glvq.quantize_linear(w, x, bits=2, d=8, rows_per_lattice=64, learn=False)
    assert rtn.stored_bits() == 128 * 64 * 2 + 16 * 128
    with pytest.raises(ValueError, match=r"^spec\.quantization\.groupSize: 7 does not divide"):
        glvq.quantize_linear(w, x, bits=2, d=7)


def test_a_decoder_is_quantised_in_its_blocks_only() -> None:
    torch.manual_seed(0)
    spec = training.ModelSpec.model_validate({"layers": 2, "width": 32, "heads": 2, "context": 16})
    model = models.build_model(run_config.build_model_config(spec))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = [torch.randint(0, 256, (4, 16)) for _ in range(2)]
    with torch.no_grad():
        reference = model(tokens[0])[0]
    report = glvq.quantize_model(model, tokens, bits=8, d=8, steps=5)
    after = model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.startswith("layers.") and k.endswith(".weight") for k in changed)
    assert "embed.weight" not in changed and not any(k.startswith("head") for k in changed)
    assert len(report["layers"]) == len(changed)
    assert 8 < report["bits_per_weight"] < 9.5
    with torch.no_grad():  # at 8 bits the quantised model answers as the original does
        assert torch.allclose(model(tokens[0])[0], reference, atol=5e-2)


def test_an_moe_router_stays_in_full_precision_and_an_unchosen_expert_is_rounded() -> None:
    """The router was quantised with the projections (2 bits changed a random 8-expert router's
    top-1 choice for 31 % of inputs); an expert no calibration token chose had a NaN error and
    ran its whole fit on NaN gradients."""
    torch.manual_seed(0)
    spec = training.ModelSpec.model_validate({"layers": 1, "width": 32, "heads": 2, "context": 16,
                                              "moe": {"experts": 4, "topK": 1}})
    model = models.build_model(run_config.build_model_config(spec))
    routers = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(".router.weight")}
    assert routers
    report = glvq.quantize_model(model, [torch.randint(0, 256, (1, 1))], bits=2, d=8, steps=3)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in routers.items())
    assert not any(name.endswith(".router") for name in report["layers"])
    unchosen = [e for e in report["layers"].values() if e.get("calibration_rows") == 0]
    assert unchosen and all(e["error_before"] is None and e["error_after"] is None for e in unchosen)
    chosen = [e for e in report["layers"].values() if e.get("calibration_rows") != 0]
    assert all(e["error_after"] == e["error_after"] for e in chosen)  # no NaN
    assert all(torch.isfinite(v).all() for v in after.values())
