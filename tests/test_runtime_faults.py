"""Fault injection's slow-compute forms: once a step, per micro-batch, and per layer (a slower
device whose cost moves with the layers a pipeline stage holds, which S3 can win back), by a
fixed delay or by a factor of the rank's own compute; and slow-link."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from huorn import models
from huorn.runtime import config as run_config
from huorn.runtime import faults
from huorn.runtime.pipeline import split


def injector(tmp_path: Path, rank: int, **fault: object) -> faults.FaultInjector:
    spec = run_config.Fault.model_validate({"kind": "slow-compute", "ms": 40, **fault})
    return faults.FaultInjector([spec], tmp_path, rank=rank, replica=None)


def timed(fn: object, repeats: int = 3) -> float:
    """The fastest of a few calls: a sleep is never shorter than asked, but a loaded host can add
    a scheduling delay of its own to any one call (164 ms for a 40 ms delay once, on three test
    workers sharing two cores), which the minimum leaves out."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - start)
    return best


def test_per_layer_delay_follows_the_layers_a_stage_holds(tmp_path: Path, monkeypatch) -> None:
    """Counted, not timed: the delays a stage's forward asks for. A timed upper bound (one delay
    took under two) failed on a loaded host, 125 ms for 40 asked, even as the fastest of three."""
    torch.manual_seed(0)
    decoder = models.build_model(models.ModelConfig(layers=4, width=16, heads=2, vocabulary=32, context=8))
    slow = injector(tmp_path, 0, perLayer=True)
    assert timed(slow.before_layer) >= 0.04  # the delay is really slept
    for layer in decoder.layers:  # as huorn.runtime.train.Trainer registers them
        layer.register_forward_pre_hook(lambda *_: slow.before_layer())
    one, three = split.split_decoder(decoder, 2, [1, 3])
    tokens = torch.randint(0, 32, (2, 8))
    asked: list[float] = []
    monkeypatch.setattr(slow, "_sleep", asked.append)
    with torch.no_grad():
        out = one(tokens)
        assert asked == [0.04]  # one layer: one delay
        hidden = out if isinstance(out, tuple) else (out,)
        three(*hidden)
        assert asked == [0.04] * 4  # three layers: three delays
    slow.before_compute()
    assert asked == [0.04] * 4  # and nothing once per step


def test_per_layer_delay_hits_only_its_rank_and_steps(tmp_path: Path) -> None:
    other = injector(tmp_path, rank=0, perLayer=True, fromStep=5)
    other.rank = 1
    assert timed(other.before_layer) < 0.02
    other.rank, other.step = 0, 4
    assert timed(other.before_layer) < 0.02
    other.step = 5
    assert timed(other.before_layer) >= 0.04


@pytest.mark.parametrize(("fault", "message"), [
    ({"perLayer": True, "perMicroBatch": True}, "exclude each other"),
    ({"kind": "slow-comm", "perLayer": True}, "slow-compute only"),
])
def test_contradictory_fault_forms_are_refused(fault: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        run_config.Fault.model_validate({"kind": "slow-compute", "ms": 10, **fault})


# -- slow-compute by a factor of the rank's own compute -------------------------------------------
def factor_injector(tmp_path: Path, **fault: object) -> faults.FaultInjector:
    spec = run_config.Fault.model_validate({"kind": "slow-compute", "factor": 3, **fault})
    return faults.FaultInjector([spec], tmp_path, rank=0, replica=None)


def asked_sleeps(slow: faults.FaultInjector, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays the injector asks for, counted as slept (timed upper bounds failed on a loaded
    host, where any sleep can overrun by a scheduling delay of its own)."""
    asked: list[float] = []

    def record(seconds: float) -> None:
        asked.append(round(seconds, 9))
        slow._slept_this_step += seconds

    monkeypatch.setattr(slow, "_sleep", record)
    return asked


def test_a_per_micro_batch_factor_stretches_each_micro_batch_it_is_told_of(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = factor_injector(tmp_path, perMicroBatch=True)
    assert timed(lambda: slow.after_micro_batch(0.03)) >= 2 * 0.03  # the delay is really slept
    asked = asked_sleeps(slow, monkeypatch)
    slow.before_micro_batch()  # nothing before: the work is not known yet
    slow.after_micro_batch(0.03)
    slow.after_micro_batch(0.06)  # twice the work
    slow.before_compute()  # and nothing once per step
    assert asked == [2 * 0.03, 2 * 0.06]


def test_a_whole_step_factor_follows_the_last_steps_own_compute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = factor_injector(tmp_path, fromStep=1)
    slow.before_compute()
    slow.after_step(0.02)  # step 0: not slowed yet
    slow.step = 1
    started = time.perf_counter()
    slow.before_compute()
    assert time.perf_counter() - started >= 2 * 0.02  # really slept
    asked = asked_sleeps(slow, monkeypatch)
    slow.before_compute()
    assert asked == [2 * 0.02]
    slow.after_step(0.05 + asked[-1])  # the step measured its compute with the sleep inside it
    assert slow.last_compute_s == pytest.approx(0.05)  # the rank's own work only
    slow.before_compute()
    assert asked == [2 * 0.02, 2 * 0.05]


def test_an_overrunning_sleep_is_not_counted_as_the_ranks_compute(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded host overran a 40 ms sleep by 7 ms (the suite, 2026-12-05), and the injector had
    counted only the 40 ms asked: the overrun became the rank's own compute, which the next step's
    factor multiplied. Here every sleep overruns by 30 ms."""
    real_sleep = time.sleep
    monkeypatch.setattr(faults.time, "sleep", lambda seconds: real_sleep(seconds + 0.03))
    slow = factor_injector(tmp_path, fromStep=1)
    slow.after_step(0.02)
    slow.step = 1
    started = time.perf_counter()
    slow.before_compute()  # asks for 2 × 20 ms, sleeps 70
    slept = time.perf_counter() - started
    assert slept >= 2 * 0.02 + 0.03
    slow.after_step(0.05 + slept)
    assert slow.last_compute_s == pytest.approx(0.05, abs=0.003)


@pytest.mark.parametrize(("fault", "message"), [
    ({"factor": 2, "perLayer": True}, "not perLayer"),
    ({"factor": 2, "ms": 10}, "ms and factor exclude each other"),
    ({"kind": "slow-comm", "factor": 2}, "factor applies to slow-compute only"),
    ({"factor": 1.0}, "factor"),
    ({}, "ms > 0.* or factor > 1"),
])
def test_bad_factor_specs_are_refused_naming_the_field(fault: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        run_config.Fault.model_validate({"kind": "slow-compute", **fault})


# -- slow-link: a pipeline rank's point-to-point sends -------------------------------------------
def link_injector(tmp_path: Path, *specs: dict) -> faults.FaultInjector:
    parsed = [run_config.Fault.model_validate({"kind": "slow-link", **spec}) for spec in specs]
    return faults.FaultInjector(parsed, tmp_path, rank=1, replica="trainer-0")


def test_slow_link_delays_the_direction_it_names_from_its_step_on_its_rank(tmp_path: Path) -> None:
    slow = link_injector(tmp_path, {"ms": 20, "direction": "forward", "fromStep": 5, "untilStep": 9,
                                    "rank": 1})
    assert slow.link_delays() == (0.0, 0.0)  # step 0: not yet
    slow.step = 5
    assert slow.link_delays() == (0.02, 0.0)
    slow.step = 9
    assert slow.link_delays() == (0.0, 0.0)  # untilStep is exclusive
    slow.step, slow.rank = 6, 2
    assert slow.link_delays() == (0.0, 0.0)  # another rank's link
    backward = link_injector(tmp_path, {"ms": 30, "direction": "backward", "replica": "trainer-0"})
    assert backward.link_delays() == (0.0, 0.03)
    backward.replica = "trainer-1"
    assert backward.link_delays() == (0.0, 0.0)


def test_slow_link_without_a_direction_slows_both_and_faults_add_up(tmp_path: Path) -> None:
    both = link_injector(tmp_path, {"ms": 10}, {"ms": 5, "direction": "backward"})
    forward, backward = both.link_delays()
    assert forward == pytest.approx(0.01) and backward == pytest.approx(0.015)
    # and the other kinds leave the links alone, slow-comm (the DDP collectives) included
    other = faults.FaultInjector([run_config.Fault(kind="slow-comm", ms=50),
                                  run_config.Fault(kind="slow-compute", ms=50)],
                                 tmp_path, rank=1, replica=None)
    assert other.link_delays() == (0.0, 0.0)


def test_slow_link_from_the_control_file_is_read_at_the_next_refresh(tmp_path: Path) -> None:
    slow = faults.FaultInjector([], tmp_path, rank=0, replica=None)
    (tmp_path / run_config.FAULTS_FILE).write_text(
        '{"faults": [{"kind": "slow-link", "ms": 25, "direction": "forward", "rank": 0}]}')
    slow.refresh()
    assert slow.link_delays() == (0.025, 0.0)


@pytest.mark.parametrize(("fault", "message"), [
    ({"kind": "slow-link"}, "needs ms > 0"),
    ({"kind": "slow-link", "ms": -1}, "ms"),
    ({"kind": "slow-link", "ms": 10, "direction": "sideways"}, "direction"),
    ({"kind": "slow-comm", "ms": 10, "direction": "forward"}, "direction applies to slow-link only"),
    ({"kind": "slow-compute", "ms": 10, "direction": "backward"}, "direction applies to slow-link only"),
    ({"kind": "slow-link", "ms": 10, "perLayer": True}, "slow-compute only"),
    ({"kind": "slow-links", "ms": 10}, "kind"),
])
def test_bad_slow_link_specs_are_refused_naming_the_field(fault: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        run_config.Fault.model_validate(fault)
