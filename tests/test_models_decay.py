"""Weight decay pulls only the weight matrices toward zero: RMSNorm gains and FusedKV's fusion
weights are exempt (huorn.models.decay), and a checkpoint written while every parameter sat in
one AdamW group (before the exemption) resumes into the two groups with its moments intact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from huorn import models
from huorn.models import decay
from huorn.runtime import checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")

CFG = models.ModelConfig(layers=4, width=32, heads=2, vocabulary=40, context=16, kv_sharing="fusedkv")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build_model(CFG)


def _exempt(model: torch.nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters() if not decay.decays(n, p)}


def test_gains_and_fusion_weights_are_exempt_and_matrices_are_not() -> None:
    model = _model()
    exempt = _exempt(model)
    names = {n for n, _ in model.named_parameters()}
    assert {n for n in names if n.endswith("norm.weight")} <= exempt
    fusion = {n for n in names if n.endswith(("k_fuse", "v_fuse"))}
    assert fusion and fusion <= exempt  # 3-D, yet mixing weights
    assert exempt == {n for n in names if n.endswith(("norm.weight", "k_fuse", "v_fuse"))}
    assert any(n.endswith("wq.weight") for n in names - exempt)


def test_a_step_without_gradient_decays_only_the_matrices() -> None:
    """With zero gradients Adam's update is zero, so what moves is the decay alone: each decayed
    parameter shrinks by lr × weight_decay; gains stay at 1 and fusion weights at 0/1."""
    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = decay.adamw(model, learning_rate=0.1, weight_decay=0.5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    exempt = _exempt(model)
    for name, p in model.named_parameters():
        expected = before[name] if name in exempt else before[name] * (1 - 0.1 * 0.5)
        torch.testing.assert_close(p.detach(), expected, msg=name)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]


def _trained_one_group(root: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """A checkpoint as Huorn wrote them before the exemption: one AdamW group, after a step."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocabulary, (2, CFG.context + 1), generator=generator)
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    optimizer.step()
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    return moments, checkpoint.save_checkpoint(root, 1, model, optimizer, {}, rank=0, barrier=lambda: None)


@pytest.mark.parametrize("flat", [False, True], ids=["nested", "flat"])
def test_a_one_group_checkpoint_resumes_into_the_two_groups(tmp_path: Path, flat: bool) -> None:
    """`flat` is the pipeline's form (hyper-parameters keyed per parameter). Before, the nested
    load missed the second group's keys, and the flat one gave the gains the old decay back."""
    moments, saved = _trained_one_group(tmp_path)
    if flat:  # the flat form is written by the pipeline: write this one so too
        saved = tmp_path / "flat"
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
        checkpoint.load_checkpoint(tmp_path / checkpoint.checkpoint_name(1), model, optimizer)
        saved = checkpoint.save_checkpoint(saved, 1, model, optimizer, {}, rank=0, barrier=lambda: None,
                                           flat=True)
    model = _model()
    optimizer = decay.adamw(model, learning_rate=0.003, weight_decay=0.2)  # the spec now
    checkpoint.load_checkpoint(saved, model, optimizer, flat=flat)
    for name, p in model.named_parameters():
        torch.testing.assert_close(optimizer.state[p]["exp_avg"], moments[name], msg=name)
    # the running optimizer's hyper-parameters, not the checkpoint's
    assert [(g["lr"], g["weight_decay"]) for g in optimizer.param_groups] == [(0.003, 0.2), (0.003, 0.0)]
    exempt = _exempt(model)
    assert {id(p) for p in optimizer.param_groups[1]["params"]} == {
        id(p) for n, p in model.named_parameters() if n in exempt}
