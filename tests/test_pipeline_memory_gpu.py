"""The activation budget on a GPU: the memory limit `schedule: auto` holds each stage's predicted
peak against (memory.activation_budget) must be memory a step can really use. Its CUDA branch
reads the driver's free memory and torch's cache and peak; a CPU run exercises none of it."""

from __future__ import annotations

import pytest
import torch

from huorn.runtime.pipeline import memory

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

WIDTH, ROWS, LAYERS = 4096, 512, 8


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rows: torch.Tensor) -> None:
    model(rows).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_the_budget_is_room_a_step_can_fill_with_activations_and_no_more_than_the_device() -> None:
    device = torch.device("cuda")
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))).to(device)
    optimizer = torch.optim.AdamW(model.parameters())
    rows = torch.randn(ROWS, WIDTH, device=device)
    torch.cuda.reset_peak_memory_stats(device)
    _step(model, optimizer, rows)
    saved = LAYERS * ROWS * WIDTH * 4  # each Linear saves its fp32 input for the backward
    budget = memory.activation_budget(saved, device)
    _, total = torch.cuda.mem_get_info(device)
    assert saved < budget < (1 - memory.HEADROOM_FRACTION) * total
    # What the budget promises: saved activations up to it on top of everything else the step
    # holds. Held as one block beside the step's own, the step still runs.
    room = torch.empty(budget - saved, dtype=torch.uint8, device=device)
    _step(model, optimizer, rows)
    torch.cuda.synchronize(device)
    del room
    # Each call reads the peak of its own window, since the call before: what a larger table's
    # activations once held (here, the room just freed) does not shrink a later budget.
    memory.activation_budget(saved, device)  # the window that held the room ends here
    _step(model, optimizer, rows)
    assert memory.activation_budget(saved, device) >= 0.95 * budget
