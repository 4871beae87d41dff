"""MoE routing invariants: prototyping sends each token to exactly one expert per group,
capacity is respected (first choices first, then earlier tokens), dropped tokens pass through
the residual, and the balancing loss follows Switch's formula."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn import models
from huorn.models import moe as model_moe

pytestmark = pytest.mark.usefixtures("single_thread")


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, 40), groups=st.sampled_from([1, 2, 3, 4]), per_group=st.integers(1, 4),
       factor=st.one_of(st.none(), st.floats(0.1, 3.0)), seed=st.integers(0, 10_000))
def test_prototyping_routes_one_expert_per_group_within_capacity(
        tokens: int, groups: int, per_group: int, factor: float | None, seed: int) -> None:
    experts = groups * per_group
    cfg = models.MoEConfig(experts=experts, prototypes=groups)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    routing = model_moe.route_tokens(logits, cfg, factor)
    assert routing.expert.shape == (tokens, groups)
    # Exactly one expert per group: slot g always holds an expert of group g.
    assert torch.equal(routing.expert // per_group, torch.arange(groups).expand(tokens, groups))
    # The chosen expert is the argmax of the router inside its group.
    assert torch.equal(routing.expert % per_group, logits.view(tokens, groups, per_group).argmax(-1))
    kept_per_expert = torch.bincount(routing.expert[routing.kept], minlength=experts)
    wanted_per_expert = torch.bincount(routing.expert.reshape(-1), minlength=experts)
    if factor is None:
        assert routing.kept.all()
    else:
        capacity = max(1, math.ceil(factor * tokens * groups / experts))
        assert routing.capacity == capacity
        # Each expert keeps min(demand, capacity): nothing dropped below capacity, none above it.
        assert torch.equal(kept_per_expert, wanted_per_expert.clamp(max=capacity))


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 30), experts=st.integers(2, 8), k=st.integers(1, 3), seed=st.integers(0, 999))
def test_topk_routing_picks_distinct_top_experts_and_keeps_earlier_tokens(
        tokens: int, experts: int, k: int, seed: int) -> None:
    k = min(k, experts)
    cfg = models.MoEConfig(experts=experts, top_k=k)
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    routing = model_moe.route_tokens(logits, cfg, capacity_factor=0.5)
    probs = torch.softmax(logits, -1)
    assert torch.allclose(routing.gate, probs.topk(k, -1).values)
    assert all(len(set(row.tolist())) == k for row in routing.expert)
    # Priority: for each expert, a kept first-choice never comes after a dropped first-choice.
    for e in range(experts):
        kept_first = routing.kept[:, 0][routing.expert[:, 0] == e]
        if kept_first.numel():
            assert torch.equal(kept_first, kept_first.sort(descending=True).values)


def test_dropped_tokens_pass_through_the_residual_unchanged() -> None:
    torch.manual_seed(0)
    moe = models.MoEConfig(experts=2, capacity_factor=0.1)
    cfg = models.ModelConfig(layers=1, width=32, heads=2, moe=moe)
    layer = model_moe.MoE(cfg).train()
    x = torch.randn(1, 20, 32)
    out = layer(x).view(20, 32)
    dropped = ~layer.last_routing.kept[:, 0]
    assert dropped.sum() >= 16  # capacity ceil(0.1 × 20 / 2) = 1 per expert
    assert torch.equal(out[dropped], torch.zeros_like(out[dropped]))
    assert (out[~dropped].abs().sum(-1) > 0).all()


def test_prototyping_output_sums_one_gated_expert_per_group() -> None:
    torch.manual_seed(1)
    cfg = models.ModelConfig(layers=1, width=16, heads=2, moe=models.MoEConfig(experts=6, prototypes=3))
    layer = model_moe.MoE(cfg).eval()
    x = torch.randn(7, 16)
    with torch.no_grad():
        out = layer(x)
        probs = torch.softmax(layer.router(x).view(7, 3, 2), -1)
        expected = torch.zeros_like(x)
        for t in range(7):
            for g in range(3):
                local = int(probs[t, g].argmax())
                expected[t] += probs[t, g, local] * layer.experts[g * 2 + local](x[t:t + 1])[0]
    assert (out - expected).abs().max() < 1e-5


def test_balance_loss_follows_switch_formula() -> None:
    logits = torch.randn(50, 4, generator=torch.Generator().manual_seed(3))
    routing = model_moe.route_tokens(logits, models.MoEConfig(experts=4), None)
    top1 = logits.argmax(-1)
    fraction = torch.bincount(top1, minlength=4).float() / 50
    expected = 4 * (fraction * torch.softmax(logits, -1).mean(0)).sum()
    assert torch.allclose(routing.balance_loss, expected)
    uniform = model_moe.route_tokens(torch.zeros(8, 4), models.MoEConfig(experts=4), None)
    assert abs(uniform.balance_loss.item() - 1.0) < 1e-6  # uniform router: P_e = 1/E, Σ f_e = 1


def test_decoder_loss_adds_weighted_balance_loss_in_training_only() -> None:
    torch.manual_seed(2)
    cfg = models.ModelConfig(layers=2, width=32, heads=2, vocabulary=50,
                             moe=models.MoEConfig(experts=4, prototypes=2, balance_loss_weight=0.5))
    decoder = models.build_model(cfg)
    tokens = torch.randint(0, 50, (2, 12))
    _, train_loss = decoder.train()(tokens, tokens)
    aux = decoder.aux_loss()
    assert aux.item() > 0.5  # two layers × 0.5 × (≥ 1 per layer, the balanced minimum is ~1)
    _, ce = decoder.forward_head(decoder.forward_blocks(decoder.embed_tokens(tokens))[0], tokens)
    assert torch.allclose(train_loss, ce + aux, atol=1e-5)
    _, eval_loss = decoder.eval()(tokens, tokens)
    assert torch.allclose(eval_loss, ce, atol=1e-5)


def test_every_expert_gets_a_gradient_even_when_unrouted() -> None:
    """DDP without find_unused_parameters needs a gradient on every parameter."""
    cfg = models.ModelConfig(layers=1, width=16, heads=2, vocabulary=20, moe=models.MoEConfig(experts=8))
    decoder = models.build_model(cfg).train()
    _, loss = decoder(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))
    loss.backward()
    assert all(p.grad is not None for p in decoder.parameters())


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"experts": 6, "prototypes": 4}, "moe.prototypes"),
    ({"experts": 4, "top_k": 5}, "moe.top_k"),
    ({"experts": 4, "prototypes": 2, "top_k": 2}, "moe.top_k"),
    ({"experts": 4, "capacity_factor": 0.0}, "moe.capacity_factor"),
    ({"experts": 0}, "moe.experts"),
])
def test_bad_moe_config_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(models.ConfigError, match=field):
        models.MoEConfig(**kwargs)
