"""The executor over NCCL on two GPUs: one step of every schedule equals single-process
training on the CPU in float64 (FusedKV decoder, so K/V cross the stage boundary too), with
overlapped links and lockstep exchanges; and stages replayed as CUDA graphs."""

from __future__ import annotations

import pipeline_workers as workers
import pytest
import torch

from huorn import models
from huorn.runtime.pipeline import launch

pytestmark = pytest.mark.gpu

CASES = [("gpipe", 1), ("1f1b", 1), ("kfkb", 2), ("kfkb", 3), ("kfkb", 4)]
CFG = models.ModelConfig(layers=4, width=32, heads=4, vocabulary=64, context=16, kv_sharing="fusedkv")
MICROBATCHES = 8


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpu_nccl_step_equals_single_process() -> None:
    jobs = [("nccl-pp2", CFG, 2, CASES, MICROBATCHES), ("nccl-pp2-lockstep", CFG, 2, CASES, MICROBATCHES)]
    ranks = launch.run_workers(workers.decoder_case_worker, 2, "nccl", (jobs,))
    for label in ("nccl-pp2", "nccl-pp2-lockstep"):  # links in the background; batched exchanges
        check_against_reference(ranks, label, graphed=False)


def check_against_reference(ranks: list[dict], label: str, graphed: bool) -> None:
    want_loss, want_grads = workers.single_process_reference(CFG, MICROBATCHES)
    for name, k in CASES:
        got = {}
        for rank in ranks:
            got.update(rank[(label, name, k)]["grads"])
            assert rank[(label, name, k)]["graphed"] == graphed, rank[(label, name, k)]["graph_note"]
            assert rank[(label, name, k)]["peak"] == rank[(label, name, k)]["predicted"]
        losses = [r[(label, name, k)]["loss"] for r in ranks if r[(label, name, k)]["loss"] is not None]
        assert losses == [pytest.approx(want_loss, rel=1e-6)], f"{label} {name} k={k}: loss"
        for param_name, want in want_grads.items():
            torch.testing.assert_close(got[param_name], want, rtol=1e-6, atol=1e-8,
                                       msg=f"{label} {name} k={k}: gradient of {param_name}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_two_gpu_cuda_graphed_stages_equal_single_process() -> None:
    ranks = launch.run_workers(workers.decoder_case_worker, 2, "nccl",
                               ([("nccl-pp2-graphs", CFG, 2, CASES, MICROBATCHES)],))
    check_against_reference(ranks, "nccl-pp2-graphs", graphed=True)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_stream_link_delivers_in_order_and_times_the_contention_delay() -> None:
    """The CUDA link has no host thread: its delay is a GPU spin and its time comes from CUDA
    events, so check both that messages arrive whole and in order and that the measured
    seconds per message include the throttle's delay (level 0.5: one burst per message)."""
    burst_s, messages = 0.004, 6
    ranks = launch.run_workers(workers.link_worker, 2, "nccl", (0.5, burst_s, messages))
    workers.check_link_run(ranks, "StreamLink", burst_s, messages)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_stream_link_holds_each_message_back_by_its_slow_link_delay() -> None:
    """A slow-link fault on the CUDA link: a GPU spin of `extra_s` per message at level 0, in
    the seconds per message its CUDA events measure."""
    extra_s, messages = 0.01, 6
    ranks = launch.run_workers(workers.link_worker, 2, "nccl", (0.0, 0.004, messages, extra_s))
    workers.check_link_run(ranks, "StreamLink", extra_s, messages)
