"""A world of one reads its noise scale on a GPU as on a host: two halves, where a copy of the
gradients fits. Needs a CUDA GPU (the device tool); CI has none, and tests/test_runtime_solo_noise.py
and tests/test_runtime_train.py cover the reading and the room check's CPU side."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import runtime_harness as harness
import torch

from huorn.runtime import solo_noise, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MIB = 1 << 20


def test_the_room_check_counts_what_torchs_allocator_holds_unused() -> None:
    """The driver's free memory misses what torch's caching allocator holds but does not use (a
    released copy of the last step's gradients): counted without it, a job would pass its first
    step's check and fail every later one."""
    device = torch.device("cuda")
    model = torch.nn.Linear(4096, 4096, device=device)  # 64 MiB of weights, as much of gradients
    owner = SimpleNamespace(device=device, model=model)
    need = 2 * solo_noise.gradient_bytes(model.parameters())
    torch.cuda.empty_cache()
    assert train.Trainer.room_for_gradients(owner)  # type: ignore[arg-type]

    free, _ = torch.cuda.mem_get_info(device)
    filler = torch.empty(free - need // 2, dtype=torch.uint8, device=device)  # leaves about need/2
    left = (torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
            - torch.cuda.memory_allocated(device))
    assert left < need, (left, need)
    assert not train.Trainer.room_for_gradients(owner)  # type: ignore[arg-type]

    del filler  # released to torch's cache, not to the driver
    assert torch.cuda.mem_get_info(device)[0] < need  # the driver still counts it as taken
    assert train.Trainer.room_for_gradients(owner)  # type: ignore[arg-type]
    torch.cuda.empty_cache()
    assert train.Trainer.room_for_gradients(owner)  # type: ignore[arg-type]


def test_a_trainer_alone_on_a_gpu_reads_its_noise_scale_from_two_halves(tmp_path: Path) -> None:
    # 12 sequences in micro-batches of 2: six micro-batches, two halves of three.
    spec = harness.build_spec(steps=40, interval_steps=None, global_batch=12, micro_batch=2)
    config = harness.write_config(tmp_path, harness.shared_data_dir(), spec, device="cuda")
    process = harness.start_trainer(config, tmp_path / "train.log")
    assert process.wait(timeout=300) == 0, (tmp_path / "train.log").read_text()[-3000:]
    steps = harness.steps_of(harness.read_events(tmp_path / "run"))
    assert [s["step"] for s in steps] == list(range(1, 41))
    assert {s["gradient_noise_reading"] for s in steps} == {"halves"}
    noise = [s["gradient_noise_scale"] for s in steps[10:]]
    assert all(n is not None and math.isfinite(n) and n > 0 for n in noise), noise
    print(f"\nnoise scale over steps 11-40: median {sorted(noise)[len(noise) // 2]:.1f}")
