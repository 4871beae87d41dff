"""The saved-activation meter (huorn.runtime.pipeline.memory) must leave nothing behind: it
runs on a table's first step and in negotiate_shapes, so a leak there keeps a micro-batch's
whole autograd graph (activations, and the parameters' gradient accumulators) alive for the
rest of the run."""

from __future__ import annotations

import gc
import warnings

import torch

from huorn import models
from huorn.runtime.pipeline import memory, split


def live_graph_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on every live object touches deprecated aliases
        warnings.simplefilter("ignore")
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None)


def test_metered_forward_and_backward_release_their_graph_and_bytes() -> None:
    torch.manual_seed(0)
    cfg = models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8, kv_sharing="fusedkv")
    stage = split.split_decoder(models.build_model(cfg), 2)[1]
    before = live_graph_tensors()
    meter = memory.SavedTensorMeter(stage.parameters())
    hidden = torch.randn(2, 8, 32, requires_grad=True)
    slots = [torch.randn(2, 2, 8, 16, requires_grad=True) for _ in stage.incoming]
    with meter.hooks():
        loss = split.compute_decoder_loss((stage(hidden, *slots),), torch.randint(0, 64, (2, 8)))
    assert meter.live_bytes > 0
    reference = torch.autograd.grad(loss, [hidden], retain_graph=True)[0]
    loss.backward()
    torch.testing.assert_close(hidden.grad, reference)  # unpacked saved tensors still backpropagate
    del loss
    assert live_graph_tensors() == before, "a metered graph stayed alive (saved-tensor hook cycle)"
    assert meter.live_bytes == 0
    assert meter.peak_bytes > 0


def test_measure_microbatch_bytes_leaves_no_graph_behind() -> None:
    torch.manual_seed(0)
    cfg = models.ModelConfig(layers=2, width=32, heads=2, vocabulary=64, context=8)
    stage = split.split_decoder(models.build_model(cfg), 2)[0]
    before = live_graph_tensors()
    measured = memory.measure_microbatch_bytes(stage, [torch.randint(0, 64, (2, 8))])
    assert measured > 0
    assert live_graph_tensors() == before
