"""CUDA-graphed stages on one GPU: each slot holds its own micro-batch, and the memory guard.

Why a test of its own: the two-GPU parity test (tests/test_pipeline_gpu.py) runs graphs only
inside a whole pipeline, where slots are taken and given back in the schedule's order. Here a
stage's slots are driven directly, with backwards in an order no schedule would use, and the
guard that keeps a new slot from being captured on a nearly full device is exercised by really
filling the device.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from huorn import models
from huorn.runtime.pipeline import graphs, split

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = models.ModelConfig(layers=2, width=64, heads=2, vocabulary=128, context=16)
MICRO, BATCH = 3, 2


def _cross_entropy(outputs: tuple[torch.Tensor, ...], target: torch.Tensor) -> torch.Tensor:
    logits = outputs[0]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _stages() -> list[split.DecoderStage]:
    torch.manual_seed(0)
    return [s.cuda() for s in split.split_decoder(models.build_model(CFG), 2)]


def _batches() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    draws = [torch.randint(0, CFG.vocabulary, (BATCH, CFG.context), generator=g).cuda()
             for _ in range(2 * MICRO)]
    return draws[:MICRO], draws[MICRO:]


def _as_tuple(out: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (out,) if isinstance(out, torch.Tensor) else tuple(out)


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def test_each_slot_keeps_its_micro_batch_when_backwards_run_out_of_order() -> None:
    """Three micro-batches in flight on the last stage, backwards in the order 2, 0, 1: the
    losses, the gradients sent back and the parameter gradients equal eager execution. A slot
    that shared a static buffer with another would hand back the wrong micro-batch's values."""
    first, last = _stages()
    tokens, targets = _batches()
    with torch.no_grad():
        hidden = [_as_tuple(first(t)) for t in tokens]

    # the reference runs on a copy: an eager autograd graph kept alive over the module that is
    # captured makes the capture fail (graphs.GraphedStage._capture)
    reference = copy.deepcopy(last)
    eager_losses, eager_input_grads = [], []
    for m in range(MICRO):
        inputs = [h.detach().clone().requires_grad_(h.is_floating_point()) for h in hidden[m]]
        loss = _cross_entropy(_as_tuple(reference(*inputs)), targets[m])
        eager_losses.append(loss.detach())
        (loss / MICRO).backward()
        eager_input_grads.append([x.grad.clone() for x in inputs if x.requires_grad])
    eager_params = _grads(reference)

    samples = [h.detach().clone().requires_grad_(h.is_floating_point()) for h in hidden[0]] + [targets[0]]
    stage = graphs.GraphedStage(last, _cross_entropy, samples, max_slots=MICRO)
    assert stage.prepare(MICRO) and stage.slots == MICRO
    stage.ensure_grads()
    held = {}
    for m in range(MICRO):
        inputs = [h.detach().clone().requires_grad_(h.is_floating_point()) for h in hidden[m]]
        outputs, slot = stage.forward([*inputs, targets[m]])
        held[m] = (inputs, outputs, slot, outputs[0].detach().clone())
    assert sorted(slot for _, _, slot, _ in held.values()) == list(range(MICRO))
    with pytest.raises(RuntimeError, match="all 3 graph slots"):
        stage.forward([*hidden[0], targets[0]])
    for m in (2, 0, 1):
        inputs, outputs, slot, loss = held.pop(m)
        torch.autograd.backward(outputs, [torch.full_like(outputs[0], 1.0 / MICRO)])
        stage.release(slot)
        sent = [x.grad.clone() for x in inputs if x.requires_grad]
        torch.testing.assert_close(loss, eager_losses[m], rtol=1e-5, atol=1e-6)
        for got, want in zip(sent, eager_input_grads[m], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    graphed_params = _grads(last)
    assert graphed_params.keys() == eager_params.keys()
    for name, want in eager_params.items():
        torch.testing.assert_close(graphed_params[name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_a_first_stage_replays_the_same_outputs_as_eager() -> None:
    """The first stage takes integer tokens (no input gradient) and has no loss."""
    first, _ = _stages()
    tokens, _ = _batches()
    with torch.no_grad():
        want = [_as_tuple(first(t)) for t in tokens]
    stage = graphs.GraphedStage(first, None, [tokens[0]], max_slots=2)
    assert stage.prepare(2)
    for m in range(MICRO):
        outputs, slot = stage.forward([tokens[m]])
        for got, expected in zip(outputs, want[m], strict=True):
            torch.testing.assert_close(got.detach(), expected, rtol=1e-5, atol=1e-6)
        stage.release(slot)


def test_no_slot_is_captured_while_the_device_lacks_twice_a_slots_footprint() -> None:
    """Fill the device until less than 2 × the first slot's footprint is free: the next slot is
    refused (the table runs eagerly) and nothing is half-captured; freed memory lets it in."""
    first, _ = _stages()
    tokens, _ = _batches()
    stage = graphs.GraphedStage(first, None, [tokens[0]], max_slots=4)
    assert stage.prepare(1) and 0 < stage.slot_bytes < 1 << 30, stage.slot_bytes
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    chunk = 256 << 20
    fillers = []
    while torch.cuda.mem_get_info()[0] >= 2 * stage.slot_bytes:
        size = min(chunk, max(torch.cuda.mem_get_info()[0] - stage.slot_bytes, 1 << 20))
        try:
            fillers.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            break
    assert torch.cuda.mem_get_info()[0] < 2 * stage.slot_bytes, f"could not fill {free} free bytes"
    assert not stage.prepare(2)
    assert stage.slots == 1
    fillers.clear()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    assert stage.prepare(2) and stage.slots == 2, (free, stage.slot_bytes)
