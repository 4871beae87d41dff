"""S2 on a pipelined job, the trainer's side: 2 stages × 2 replicas (gloo, 4 spawned processes,
one world for every case) whose replicas run unequal micro-batch counts give the loss and every
parameter's gradient of single-process gradient accumulation over the same batch. The decoder
runs in float64, so a micro-batch weighed 1/N_r instead of 1/M, or one run twice, shows up."""

from __future__ import annotations

import functools

import pipeline_workers as workers
import pytest
import torch

from huorn import models
from huorn.runtime.pipeline import launch

pytestmark = pytest.mark.timeout(300)

CFG = models.ModelConfig(layers=4, width=16, heads=2, vocabulary=32, context=8)
CASES = [
    ("even", None, "1f1b", 1),
    ("2-2", (2, 2), "1f1b", 1),  # equal counts, as S2's way back writes them
    ("3-1", (3, 1), "1f1b", 1),
    ("1-3", (1, 3), "kfkb", 2),
    ("5-1-gpipe", (5, 1), "gpipe", 1),
    ("3-1-auto", (3, 1), "auto", 2),
    ("3-1-refuse", (3, 1), "1f1b", 1),
]


@functools.cache
def reference(total: int) -> tuple[float, dict[str, torch.Tensor]]:
    return workers.single_process_reference(CFG, total)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch.run_workers(workers.unequal_counts_worker, 4, "gloo", (CFG, 2, CASES))


def check_against_reference(ranks: list[dict], label: str, total: int) -> None:
    want_loss, want_grads = reference(total)
    got: dict[str, torch.Tensor] = {}
    for r in ranks:
        case = r[label]
        for report in case["reports"]:
            # every rank reports the step's loss: the mean over all M micro-batches
            assert report.loss == pytest.approx(want_loss, rel=1e-6), (label, case["stage"], case["replica"])
        for name, grad in case["grads"].items():
            if name in got:  # the other replica of the same stage holds the same summed gradient
                torch.testing.assert_close(grad, got[name], rtol=0, atol=0)
            got[name] = grad
    assert set(got) == set(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-6, atol=1e-9, msg=f"{label}: gradient of {name}")


@pytest.mark.parametrize(("label", "counts"), [(c[0], c[1]) for c in CASES if c[0] != "3-1-refuse"])
def test_unequal_counts_give_the_single_process_step(ranks: list[dict], label: str,
                                                     counts: tuple[int, ...] | None) -> None:
    check_against_reference(ranks, label, sum(counts) if counts else 4)


@pytest.mark.parametrize(("label", "counts"), [("3-1", (3, 1)), ("1-3", (1, 3)), ("5-1-gpipe", (5, 1))])
def test_each_replica_runs_its_own_table_once(ranks: list[dict], label: str, counts: tuple[int, ...]) -> None:
    for r in ranks:
        report = r[label]["reports"][0]
        mine = counts[r[label]["replica"]]
        assert report.microbatches == mine
        assert sorted(report.executed) == sorted([f"{kind}{m}" for m in range(mine) for kind in "FB"])
        assert report.microbatch_s > 0


def test_adaptive_k_plans_on_unequal_tables(ranks: list[dict]) -> None:
    """With schedule auto and a re-plan every step, rank 0 decides from the critical replica
    and the second step, on the chosen k, is exact too. The critical replica is the one with the
    most measured time: the 3-micro-batch one (k up to 3), unless on a loaded machine the other
    replica's single micro-batch of this tiny model took over 3× as long (k = 1 only), as one
    full-suite run on the 2-core VM saw."""
    decisions = [rep.decision for rep in ranks[0]["3-1-auto"]["reports"] if rep.decision]
    assert len(decisions) == 2
    for decision in decisions:
        assert decision["reason"].startswith("link ")
        assert set(decision["predicted_step_s"]) in ({1, 2, 3}, {1})  # the critical table's k
        assert decision["peak_bytes"]
    # A decision equal to the k the critical table runs means "keep": the job's k (2) stays in
    # force. When the 1-micro-batch replica is critical it runs k = 1 whatever is in force, so
    # its decision of 1 leaves the other replica on 2 (its own table holds 3).
    in_force = decisions[0]["k"] if decisions[0]["changed"] else 2
    for r in ranks:  # every rank runs the k in force after step 0, capped by its own table
        case = r["3-1-auto"]
        assert case["reports"][1].k == min(in_force, (3, 1)[case["replica"]])


def test_a_plan_that_does_not_fit_is_refused_and_the_counts_in_force_stay(ranks: list[dict]) -> None:
    for r in ranks:
        wrong_length, empty, wrong_sum, kept = r["3-1-refuse"]["refusals"]
        assert wrong_length.startswith("counts has 3 entries but the job has 2 pipeline replicas")
        assert "at least one micro-batch" in empty and "sum to 5" in wrong_sum
        assert kept == (3, 1)
        assert r["3-1-refuse"]["reports"][0].microbatches == (3, 1)[r["3-1-refuse"]["replica"]]
    check_against_reference(ranks, "3-1-refuse", 4)


def test_equal_counts_run_the_plain_path_bit_for_bit(ranks: list[dict]) -> None:
    """S2's way back ([2, 2]) must not leave a summed-gradient path behind: same bits as no plan."""
    for r in ranks:
        assert r["2-2"]["reports"][0].loss == r["even"]["reports"][0].loss
        for name, grad in r["even"]["grads"].items():
            torch.testing.assert_close(r["2-2"]["grads"][name], grad, rtol=0, atol=0)
