"""Pipelined training equals single-process training: for GPipe, 1F1B and kFkB with k in
1..4, on 4 stages and on 2 stages × 2 data-parallel replicas (gloo, 4 spawned processes, one
world for both layouts to pay process start-up once), the loss and every
parameter's gradient after one step match gradient accumulation over the same micro-batches
in one process. The models run in float64, so the tolerance is tight and a single misrouted
or repeated micro-batch shows up. The same runs check the memory model against the measured
peak of saved activations."""

from __future__ import annotations

import functools

import pipeline_workers as workers
import pytest
import torch

from huorn import models
from huorn.runtime.pipeline import launch

pytestmark = pytest.mark.slow  # one 4-process world: ~20 s of start-up on a busy 2-core box

CASES = [("gpipe", 1), ("1f1b", 1), ("kfkb", 1), ("kfkb", 2), ("kfkb", 3), ("kfkb", 4)]
JIT_CASES = [("1f1b", 1), ("kfkb", 2)]  # receives posted just in time, the NCCL path
MICROBATCHES = 6  # not a multiple of 4: the last kFkB group is short
DENSE = models.ModelConfig(layers=4, width=16, heads=2, vocabulary=32, context=8)
FUSED = models.ModelConfig(layers=4, width=16, heads=2, vocabulary=32, context=8, kv_sharing="fusedkv")


@functools.cache
def reference(cfg: models.ModelConfig, microbatches: int) -> tuple[float, dict[str, torch.Tensor]]:
    return workers.single_process_reference(cfg, microbatches)


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    jobs = [("pp4-fused", FUSED, 4, CASES, MICROBATCHES), ("dp2xpp2", DENSE, 2, CASES, MICROBATCHES),
            ("pp4-fused-jit", FUSED, 4, JIT_CASES, MICROBATCHES),
            ("pp4-fused-lockstep", FUSED, 4, CASES, MICROBATCHES),
            ("dp2xpp2-lockstep", DENSE, 2, CASES, MICROBATCHES),
            ("pp4-fused-graphs", FUSED, 4, [("1f1b", 1)], MICROBATCHES)]
    merged: dict = {}
    for rank_result in launch.run_workers(workers.decoder_case_worker, 4, "gloo", (jobs,)):
        for key, value in rank_result.items():
            merged.setdefault(key, []).append(value)
    return merged


def assert_matches_reference(per_rank: list[dict], cfg: models.ModelConfig, microbatches: int) -> None:
    want_loss, want_grads = reference(cfg, microbatches)
    losses = [r["loss"] for r in per_rank if r["loss"] is not None]
    replicas = len(losses)
    assert sum(losses) / replicas == pytest.approx(want_loss, rel=1e-6)  # the CE runs in float32
    got: dict[str, torch.Tensor] = {}
    for r in per_rank:
        for name, grad in r["grads"].items():
            if name in got:  # another data-parallel replica: averaged, so must agree exactly
                torch.testing.assert_close(grad, got[name], rtol=0, atol=0)
            got[name] = grad
    assert set(got) == set(want_grads), "every parameter must get a gradient from exactly one stage"
    for name, grad in want_grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-9, msg=f"gradient of {name}")


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-k{k}" for n, k in CASES])
def test_four_stage_fusedkv_step_equals_single_process(four_ranks: dict, case: tuple[str, int]) -> None:
    # FusedKV: the upper stages rebuild K/V from tensors that lower stages send beside the
    # hidden state, so this also checks that K/V and their gradients cross stage boundaries
    assert_matches_reference(four_ranks[("pp4-fused", *case)], FUSED, MICROBATCHES)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-k{k}" for n, k in CASES])
def test_two_stages_times_two_replicas_step_equals_single_process(four_ranks: dict, case: tuple[str, int]
                                                                  ) -> None:
    # each replica runs a 2-stage pipeline on half of the micro-batches; the averaged gradient
    # is that of all 2 × MICROBATCHES micro-batches in one process
    assert_matches_reference(four_ranks[("dp2xpp2", *case)], DENSE, 2 * MICROBATCHES)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-k{k}" for n, k in CASES])
def test_every_microbatch_runs_forward_then_backward_once(four_ranks: dict, case: tuple[str, int]) -> None:
    for r in [*four_ranks[("pp4-fused", *case)], *four_ranks[("dp2xpp2", *case)]]:
        executed = r["executed"]
        for m in range(MICROBATCHES):
            assert executed.count(f"F{m}") == 1 and executed.count(f"B{m}") == 1
            assert executed.index(f"F{m}") < executed.index(f"B{m}")


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-k{k}" for n, k in CASES])
def test_measured_activation_peak_matches_memory_model(four_ranks: dict, case: tuple[str, int]) -> None:
    for r in [*four_ranks[("dp2xpp2", *case)], *four_ranks[("pp4-fused", *case)]]:
        assert r["microbatch_bytes"] > 0
        # received buffers, FusedKV tensors and per-layer saves all counted; the prediction is
        # in-flight count × one micro-batch, measured on its own, so they agree to the byte
        assert r["peak"] == r["predicted"], f"stage {r['stage']}: measured {r['peak']} != {r['predicted']}"


def test_larger_k_costs_proportionally_more_activation_memory(four_ranks: dict) -> None:
    first_stage = {k: next(r for r in four_ranks[("pp4-fused", "kfkb", k)] if r["stage"] == 0)
                   for k in (1, 2)}
    # stage 0 of 4 holds 4 micro-batches under 1F1B and min(2 × 4, 6) = 6 under 2F2B
    assert first_stage[2]["peak"] * 4 == first_stage[1]["peak"] * 6


@pytest.mark.parametrize(("name", "k"), JIT_CASES)
def test_receives_posted_when_needed_give_the_same_step(four_ranks: dict, name: str, k: int) -> None:
    """The NCCL path posts each receive only when it is consumed; the result must not change."""
    assert_matches_reference(four_ranks[("pp4-fused-jit", name, k)], FUSED, MICROBATCHES)


@pytest.mark.parametrize("case", CASES, ids=[f"{n}-k{k}" for n, k in CASES])
def test_lockstep_exchanges_give_the_same_step(four_ranks: dict, case: tuple[str, int]) -> None:
    """Batched exchanges (torch's pairing, with kFkB's deferred sends) route every message to
    the right micro-batch: 4 stages, and 2 stages × 2 replicas."""
    assert_matches_reference(four_ranks[("pp4-fused-lockstep", *case)], FUSED, MICROBATCHES)
    assert_matches_reference(four_ranks[("dp2xpp2-lockstep", *case)], DENSE, 2 * MICROBATCHES)
    assert all(r["comm"] == "lockstep" for r in four_ranks[("pp4-fused-lockstep", *case)])


def test_cuda_graphs_asked_for_on_cpu_run_eagerly_and_say_why(four_ranks: dict) -> None:
    """An executor built with cuda_graphs=True on gloo keeps training correctly (three steps on
    the same weights, the last one compared) and names why it did not replay graphs."""
    per_rank = four_ranks[("pp4-fused-graphs", "1f1b", 1)]
    assert not any(r["graphed"] for r in per_rank)
    assert all("CUDA graphs need a CUDA device" in r["graph_note"] for r in per_rank)
    assert_matches_reference(per_rank, FUSED, MICROBATCHES)
