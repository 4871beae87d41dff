"""Adaptive k under a contention level that changes mid-run (2 stages, gloo, spawned
processes, the send-path throttle): k stays 1 on a calm link, switches to k > 1 once the
link is preempted, and the decisions carry the cost-model numbers that justify it. Switching
between steps loses and repeats nothing: every step runs each micro-batch once, and the
weights after the run equal single-process SGD over the same batches."""

from __future__ import annotations

import pipeline_workers as workers
import pytest
import torch

from huorn.runtime.pipeline import launch

# Measures wall-clock behaviour of real processes: runs beside at most one other such test
# (scripts/test's serial part); the tests that read the calm link run by themselves (below).
pytestmark = pytest.mark.serial
# The calm window's claim (k stays 1) holds only on a calm box: in CI's serial part, beside another
# test's ranks, the calm link read 2.19 ms a message against the F+B's 8.25 ms (0.26x, what the
# scan above finds 9-13 % gain at) and the planner rightly switched to k=2 at step 3 (2026-12-06).
# Alone these three tests take 8 s.
READS_THE_CALM_LINK = pytest.mark.alone

STAGES, WIDTH, DEPTH, MICROBATCHES, SIZE = 2, 384, 10, 8, 64
BURST_S = 0.0025  # the calm runs' burst (no contention: never waited for)
LEVELS = [0.0] * 4 + [0.8] * 8
# Contention's delay a message, in micro-batches' F+B of one stage (measured in the calm steps;
# the worker sets its burst from them). What kFkB gains depends on this ratio, not on the burst
# alone: a fixed 2.5 ms burst predicted k>1 15 % faster on an idle 2-core box and 7 % beside
# another test, whose load made the F+B 1.7× longer. Scanned on the idle box, the gain at step 7
# was 9-13 % at 0.25, 18-20 % at 0.35-0.7; under the suite's parallel part 20 % at 0.5, 9 % at 1.0
# and 2-6 % at 2-3. The calm link's noise predicted k>1 4-7 % faster on the idle box, but up to
# 9 % alone and 13 % in CI's serial part later (2026-12-07: the planner read a link's mean
# message, and one message of a step's eight often waited 2-8 ms; it reads the median message
# now, contention.LinkStats.typical_s), while the contended steps predict 20-23 %: the 15 %
# switching margin sits between the two.
DELAY_PER_MICROBATCH = 0.5
MIN_GAIN = 0.15
REPLAN_EVERY = 4  # decisions after step 3 (a calm window), 7 and 11 (contended)


@pytest.fixture(scope="module")
def run() -> list[dict]:
    args = (STAGES, WIDTH, DEPTH, MICROBATCHES, SIZE, LEVELS, BURST_S, REPLAN_EVERY, "overlap",
            {"min_gain": MIN_GAIN}, DELAY_PER_MICROBATCH)
    return launch.run_workers(workers.adaptive_worker, STAGES, "gloo", args)


def decisions(run: list[dict]) -> dict[int, dict]:
    return {r.step: r.decision for r in run[0]["reports"] if r.decision is not None}


@pytest.mark.slow
@READS_THE_CALM_LINK
def test_k_rises_when_the_link_is_preempted_and_the_numbers_say_why(run: list[dict]) -> None:
    made = decisions(run)
    for step, decision in made.items():
        print(f"step {step}: k {decision['previous_k']} -> {decision['k']}: {decision['reason']}")
    calm, contended = made[3], made[7]
    assert calm["k"] == 1 and not calm["changed"], calm["reason"]
    assert contended["previous_k"] == 1 and contended["k"] > 1, contended["reason"]
    # why: the measured seconds per message grew by the throttle's queueing delay ...
    assert contended["link_forward_s"][0] >= 4 * run[0]["burst_s"] * 0.9
    # ... and is more than the calm link's. (Not a fixed multiple: with two busy stages on two
    # cores, a calm message waits for its sender's gloo thread to get a core, which read 0.1 ms
    # in most runs and 1.5-2 ms in one run of three, every message of it, against 2.6-2.9 ms
    # contended; 2x failed so, 2026-12-07.)
    assert contended["link_forward_s"][0] > calm["link_forward_s"][0]
    # ... which the replay charges to 1F1B once per micro-batch and to kFkB once per group
    predicted = contended["predicted_step_s"]
    # (by at least the planner's switching margin, MIN_GAIN)
    assert predicted[contended["k"]] <= (1 - MIN_GAIN) * predicted[1]
    # On a calm link no k is predicted to pay for a switch. (A spread of all k's predictions under
    # 1.1 was asserted before: the replay of a measured window put a larger k 10.2 % slower once,
    # which is no reason to switch either.)
    calm_predicted = calm["predicted_step_s"]
    assert min(calm_predicted.values()) > (1 - MIN_GAIN) * calm_predicted[1], calm_predicted
    ks = [r.k for r in run[0]["reports"]]
    assert ks[:8] == [1] * 8 and all(k > 1 for k in ks[8:])


@pytest.mark.slow
@READS_THE_CALM_LINK
def test_larger_k_is_really_faster_under_contention(run: list[dict]) -> None:
    reports = run[0]["reports"]
    one = [r.seconds for r in reports if r.contention == 0.8 and r.k == 1][1:]  # skip the switch-in step
    more = [r.seconds for r in reports if r.contention == 0.8 and r.k > 1]
    ran = [(r.contention, r.k) for r in reports]
    assert one and more, f"needs contended steps at k=1 and at k>1; ran (contention, k) {ran}"
    assert sum(more) / len(more) < sum(one) / len(one), (one, more)


@pytest.mark.slow
@READS_THE_CALM_LINK
def test_switching_k_loses_and_repeats_no_micro_batch(run: list[dict]) -> None:
    for rank in run:
        for report in rank["reports"]:
            for m in range(MICROBATCHES):
                assert report.executed.count(f"F{m}") == 1 and report.executed.count(f"B{m}") == 1
    assert_equals_single_process_sgd(run, len(LEVELS))


def assert_equals_single_process_sgd(run: list[dict], steps: int) -> None:
    """Every rank's final weights and rank 0's losses equal one process's SGD."""
    stages = workers.build_mlp_stages(STAGES, WIDTH, DEPTH)
    optimizer = torch.optim.SGD([p for s in stages for p in s.parameters()], lr=0.05)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers ran single-threaded; many threads thrash a busy box
    try:
        losses = replay(stages, optimizer, steps)
    finally:
        torch.set_num_threads(threads)
    assert [r.loss for r in run[0]["reports"]] == pytest.approx(losses, rel=1e-5)
    for rank, stage in enumerate(stages):
        for name, value in stage.state_dict().items():
            torch.testing.assert_close(run[rank]["state"][name], value, rtol=1e-5, atol=1e-6)


def replay(stages: list[torch.nn.Sequential], optimizer: torch.optim.Optimizer, steps: int = len(LEVELS)
           ) -> list[float]:
    """Single-process SGD with gradient accumulation over the same micro-batches."""
    losses = []
    for step in range(steps):
        inputs, targets = workers.make_mlp_batch(step, MICROBATCHES, SIZE, WIDTH)
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(inputs, targets, strict=True):
            for stage in stages:
                x = stage(x)
            loss = workers.mse_loss((x,), y) / MICROBATCHES
            loss.backward()
            total += loss.item()
        optimizer.step()
        losses.append(total)
    return losses


@pytest.mark.slow
def test_comm_auto_switches_to_lockstep_between_steps_and_the_weights_stay_exact() -> None:
    """With comm auto the planner may move the gang between overlap and lockstep at a step
    boundary (here it is told every link is fast enough, and to re-measure after each window):
    all ranks switch together, each step runs the mode decided before it, and training stays
    exactly single-process SGD."""
    steps, every = 8, 2
    # min_gain 0.99: k stays 1 (a k switch skips the probe), whatever the loaded box measures
    options = {"lockstep": True, "lockstep_link_fraction": 0.99, "reprobe_every": 1, "min_gain": 0.99}
    run = launch.run_workers(workers.adaptive_worker, STAGES, "gloo",
                             (STAGES, WIDTH, DEPTH, MICROBATCHES, SIZE, [0.0] * steps, BURST_S, every,
                              "auto", options))
    expected, planned = "overlap", []  # decisions are made (and reported) on rank 0
    for report in run[0]["reports"]:
        planned.append(expected)
        if report.decision is not None:
            expected = report.decision["comm"]
    assert run[0]["reports"][1].decision["comm"] == "lockstep"  # the first window probes it
    assert planned[2:4] == ["lockstep", "lockstep"]
    for rank in run:
        assert [r.comm for r in rank["reports"]] == planned
    assert_equals_single_process_sgd(run, steps)
