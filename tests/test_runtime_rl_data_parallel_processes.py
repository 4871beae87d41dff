"""Data-parallel RL trainers as plain processes: two, each a PolicyTrainer, formed into one group
as huorn.runtime.rl.pools forms it (without Ray, which the GPU machines do not carry), take an
update as one trainer does, after the second joined with the first's state (its optimiser
moments on the first's device). On two CUDA GPUs that is NCCL (the device tool's
nvidia-h200-x2; not yet run: only one-GPU machines were lent on 2026-12-05, where the CUDA
hand-over case below passed); on CPU, gloo.
tests/test_runtime_rl_data_parallel.py runs the group over a real Ray cluster."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def _pack(value: object) -> bytes:
    """Tensors as bytes through a queue: torch's own sharing of CPU tensors between processes
    passes file descriptors that vanish with a member that has exited before they are read."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unpack(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _member(rank: int, device: str, root: str, queue: mp.Queue, out: mp.Queue) -> None:
    from rl_batches import SPEC, make_batch

    from huorn.runtime.rl import workers

    trainer = workers.PolicyTrainer(SPEC, None, root, device)
    if rank == 0:
        trainer.update(make_batch(0))  # alone first: its optimiser moments now live on its GPU
        host, port = trainer.host_group("127.0.0.1")
        queue.put((host, port))
        queue.put(_pack(trainer.state()))  # what Ray's object store carries to a joiner
    else:
        host, port = queue.get(timeout=120)
        trainer.load_state(_unpack(queue.get(timeout=120)))
    trainer.join_group(rank, 2, host, port)
    metrics = trainer.update(make_batch(1))
    out.put((rank, metrics, _pack(trainer.weights())))
    trainer.leave_group()


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=[pytest.mark.gpu, TWO_GPUS]), "cpu"])
def test_two_trainers_update_as_one_after_a_join(tmp_path: Path, device: str) -> None:
    """cuda: NCCL on two GPUs; cpu: the same processes and hand-over over gloo (what CI runs)."""
    from rl_batches import SPEC, make_batch

    from huorn.runtime.rl import workers

    context = mp.get_context("spawn")
    queue, out = context.Queue(), context.Queue()
    members = [context.Process(target=_member, args=(r, device, str(tmp_path), queue, out)) for r in (0, 1)]
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        for rank, p in enumerate(members):
            os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)  # one GPU each, as Ray gives an actor
            p.start()
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    answers = [out.get(timeout=300) for _ in members]
    got = {rank: (metrics, _unpack(weights)) for rank, metrics, weights in answers}
    for p in members:
        p.join(timeout=60)
        assert p.exitcode == 0
    alone = workers.PolicyTrainer(SPEC, None, str(tmp_path / "alone"), device)
    alone.update(make_batch(0))
    want = alone.update(make_batch(1))
    (m0, w0), (m1, w1) = got[0], got[1]
    assert m0["trainers"] == m1["trainers"] == 2
    for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm"):
        assert m0[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), key
    mine = {k: v.cpu() for k, v in alone.weights().items()}
    for name, value in mine.items():
        torch.testing.assert_close(w0[name], value, rtol=1e-3, atol=1e-4)
        assert torch.equal(w0[name], w1[name]), name  # the members hold the same bits


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_joiner_takes_a_cpu_copy_and_goes_on_alike(tmp_path: Path) -> None:
    """The hand-over of a CUDA trainer: state() holds CPU copies (what Ray's object store
    carries), load_state puts them back on the GPU, and both trainers take the next update alike."""
    from rl_batches import SPEC, make_batch

    from huorn.runtime.rl import workers

    giver = workers.PolicyTrainer(SPEC, None, str(tmp_path / "a"), "cuda")
    giver.update(make_batch(0))
    state = giver.state()
    moments = [v for s in state["optimizer"]["state"].values() for v in s.values()
               if isinstance(v, torch.Tensor)]
    assert moments and all(v.device.type == "cpu" for v in moments)
    joiner = workers.PolicyTrainer(SPEC, None, str(tmp_path / "b"), "cuda")
    joiner.load_state(state)
    assert all(v.device.type == "cuda" for s in joiner.optimizer.state.values()
               for k, v in s.items() if k != "step")
    want, got = giver.update(make_batch(1)), joiner.update(make_batch(1))
    for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
