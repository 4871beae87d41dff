"""GLVQ: each linear layer's weights quantised to a learned lattice, for serving at a few bits
per weight (arXiv 2510.20984; notes/papers.md).

A row of W [out, in] is scaled by its largest magnitude, passed through a μ-law compander, and
cut into vectors of d = groupSize weights. Every block of `rows_per_lattice` rows shares one
generation matrix G (d × d): a vector v is stored as integer codes z = clamp(⌊G⁻¹·c(v)⌋)
of `bits` bits each, and decoded as v̂ = e(G·(z + ½)), e the compander's inverse (a small
matrix-vector product per vector). The half step makes the 2^b levels of a code symmetric: at
G = δ·I they are (z + ½)·δ, ±δ/2 … ±1 with δ = 1/(2^(b−1) − ½), so a row's largest weight (±1 once
scaled) is kept exactly and 1 bit is a sign. Integer points with no offset had spent a level:
their range was asymmetric, a row's largest weight fell to the level below, and at 1 bit every
weight decoded to 0. G and μ start where plain round-to-nearest would be (G = δ·I, μ ≈ 0, the
baseline) and are learned by Adam on ‖XWᵀ − XŴᵀ‖² over calibration inputs X of that layer,
rounding with a straight-through gradient; the best iterate is kept, so a layer is never worse
than round-to-nearest on its calibration data.

Embeddings and the output head stay in full precision, as quantisers commonly leave them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

FP16_BITS = 16


@dataclass
class QuantizedLinear:
    """What a quantised layer stores; `decode()` is the weight a served model multiplies by."""

    codes: torch.Tensor  # int8 [out, in // d, d], each in [−2^(b−1), 2^(b−1) − 1]
    lattices: torch.Tensor  # [blocks, d, d], one G per block of rows
    scales: torch.Tensor  # [out], each row's largest magnitude
    mu: float  # the compander's μ
    bits: int
    rows_per_lattice: int
    learned: bool = True  # G and μ fitted; round-to-nearest's follow from `bits` and are not stored

    def decode(self) -> torch.Tensor:
        return _decode(self.codes.float(), self.lattices, self.scales, torch.tensor(self.mu),
                       self.rows_per_lattice)

    def stored_bits(self) -> int:
        """What a packed format stores: codes at `bits` each, the row scales in fp16, and, where
        learned, G and μ in fp16. (This object keeps int8 codes and fp32 tensors, and a served
        model decodes them to dense weights at load: no memory is saved yet.) Round-to-nearest's
        G = δ·I and μ follow from `bits`; counted, they charged it GLVQ's 0.17 bits per weight of
        lattices that it never needs to store."""
        fitted = self.lattices.numel() + 1 if self.learned else 0
        return self.codes.numel() * self.bits + FP16_BITS * (self.scales.numel() + fitted)


def compand(x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """μ-law on [−1, 1]; the identity as μ → 0."""
    return torch.sign(x) * torch.log1p(mu * x.abs()) / torch.log1p(mu)


def expand(y: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """The inverse of compand."""
    return torch.sign(y) * torch.expm1(y.abs() * torch.log1p(mu)) / mu


def _per_row_lattices(lattices: torch.Tensor, rows: int, rows_per_lattice: int) -> torch.Tensor:
    return lattices.repeat_interleave(rows_per_lattice, dim=0)[:rows]  # [out, d, d]


def _decode(codes: torch.Tensor, lattices: torch.Tensor, scales: torch.Tensor, mu: torch.Tensor,
            rows_per_lattice: int) -> torch.Tensor:
    g = _per_row_lattices(lattices, codes.shape[0], rows_per_lattice)
    points = torch.einsum("rij,rvj->rvi", g, codes + 0.5)  # G·(z + ½) for every vector of every row
    return (expand(points, mu) * scales[:, None, None]).reshape(codes.shape[0], -1)


def _encode(vectors: torch.Tensor, lattices: torch.Tensor, mu: torch.Tensor, rows_per_lattice: int,
            bits: int, straight_through: bool) -> torch.Tensor:
    """Codes (as floats) of the normalised vectors [out, n, d]; with `straight_through`, rounding
    passes gradients as if it were the identity."""
    g = _per_row_lattices(lattices, vectors.shape[0], rows_per_lattice)
    real = torch.einsum("rij,rvj->rvi", torch.linalg.inv(g), compand(vectors, mu))
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    rounded = torch.clamp(torch.floor(real), low, high)  # the nearest level (z + ½)
    if straight_through:
        rounded = real + (rounded - real).detach()
    return rounded


def quantize_linear(weight: torch.Tensor, inputs: torch.Tensor, bits: int, d: int, rows_per_lattice: int = 64,
                    steps: int = 200, lr: float = 2e-3, learn: bool = True) -> tuple[QuantizedLinear, dict]:
    """One layer: W [out, in], calibration inputs X [n, in]. `learn` False is the round-to-nearest
    baseline (G = δ·I, μ ≈ 0), through the very same encoder and decoder."""
    out_features, in_features = weight.shape
    if in_features % d:
        raise ValueError(f"spec.quantization.groupSize: {d} does not divide a layer's input width "
                         f"({in_features}); use a divisor of the model's widths")
    w = weight.detach().float()
    x = inputs.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12)
    vectors = (w / scales[:, None]).reshape(out_features, in_features // d, d)
    blocks = math.ceil(out_features / rows_per_lattice)
    delta = 1.0 / (2 ** (bits - 1) - 0.5)  # the levels (z + ½)·δ span [−1, 1] at G = δ·I
    lattices = (delta * torch.eye(d)).repeat(blocks, 1, 1).contiguous()
    log_mu = torch.tensor(math.log(1e-3))
    target = x @ w.T

    def error(g: torch.Tensor, lm: torch.Tensor, straight_through: bool) -> torch.Tensor:
        mu = lm.exp()
        codes = _encode(vectors, g, mu, rows_per_lattice, bits, straight_through)
        decoded = _decode(codes, g, scales, mu, rows_per_lattice)
        return ((x @ decoded.T - target) ** 2).mean()

    if x.shape[0] == 0:
        # an MoE expert no calibration token chose: nothing to fit its lattice to (its error is a
        # mean of nothing, NaN, and the loop ran on NaN gradients), so round-to-nearest, said so
        with torch.no_grad():
            codes = _encode(vectors, lattices, log_mu.exp(), rows_per_lattice, bits, False)
        layer = QuantizedLinear(codes.to(torch.int8), lattices, scales, float(log_mu.exp()), bits,
                                rows_per_lattice, False)
        return layer, {"error_before": None, "error_after": None, "calibration_rows": 0}
    with torch.no_grad():
        best = (float(error(lattices, log_mu, False)), lattices.clone(), log_mu.clone())
    first = best[0]
    if learn:
        g = lattices.clone().requires_grad_(True)
        lm = log_mu.clone().requires_grad_(True)
        optimizer = torch.optim.Adam([g, lm], lr=lr)
        for _ in range(steps):
            loss = error(g, lm, True)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                lm.clamp_(math.log(1e-3), math.log(255.0))
                exact = float(error(g, lm, False))  # the error of what would be stored
                if exact < best[0]:
                    best = (exact, g.detach().clone(), lm.detach().clone())
    _, lattices, log_mu = best
    mu = log_mu.exp()
    with torch.no_grad():
        codes = _encode(vectors, lattices, mu, rows_per_lattice, bits, False)
    layer = QuantizedLinear(codes.to(torch.int8), lattices, scales, float(mu), bits, rows_per_lattice, learn)
    return layer, {"error_before": first, "error_after": best[0]}


def calibration_inputs(model: nn.Module, batches: list[torch.Tensor], limit: int = 4096
                       ) -> dict[str, torch.Tensor]:
    """The inputs every nn.Linear of the decoder's blocks sees on `batches` (tokens [B, T]), at
    most `limit` rows each: the attention and feed-forward projections. An MoE router stays in
    full precision, as the embedding and the head do: it is experts × width, and an error in its
    logits sends tokens to other experts (2-bit GLVQ changed a random 8-expert router's top-1
    choice for 31 % of inputs)."""
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.startswith("layers.") and not name.endswith(".router"):
            def keep(mod: nn.Module, args: tuple, name: str = name) -> None:
                seen.setdefault(name, []).append(args[0].detach().reshape(-1, args[0].shape[-1]))
            hooks.append(module.register_forward_pre_hook(keep))
    try:
        with torch.no_grad():
            for tokens in batches:
                model(tokens)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(rows)[:limit] for name, rows in seen.items()}


def quantize_model(model: nn.Module, batches: list[torch.Tensor], bits: int, d: int, learn: bool = True,
                   steps: int = 200) -> dict:
    """Replace every block linear's weight by its decoded quantisation, in place; returns the
    per-layer errors and the bits stored per quantised weight."""
    model.eval()
    inputs = calibration_inputs(model, batches)
    modules = dict(model.named_modules())
    layers, stored, weights = {}, 0, 0
    for name, x in inputs.items():
        linear = modules[name]
        assert isinstance(linear, nn.Linear)
        quantized, errors = quantize_linear(linear.weight, x, bits, d, steps=steps, learn=learn)
        with torch.no_grad():
            linear.weight.copy_(quantized.decode().to(linear.weight.dtype))
        layers[name] = errors
        stored += quantized.stored_bits()
        weights += linear.weight.numel()
    return {"layers": layers, "bits_per_weight": stored / max(1, weights), "weights": weights}
