"""The contention throttle: zero at level 0, the documented M/M/1-style growth with level,
FIFO links, and bad levels rejected with the valid range in the message."""

from __future__ import annotations

import math

import pipeline_workers as workers
import pytest
from hypothesis import given
from hypothesis import strategies as st

from huorn.runtime.pipeline import contention, launch


def test_level_zero_adds_nothing_whatever_the_link() -> None:
    assert contention.Throttle(level=0.0, burst_s=0.01, bandwidth_bytes_s=1e6).delay_s(10**6) == 0.0


def test_eighty_percent_is_four_bursts_plus_four_emulated_transfers() -> None:
    throttle = contention.Throttle(level=0.8, burst_s=0.002, bandwidth_bytes_s=1e9)
    assert throttle.delay_s(10**6) == pytest.approx(4 * 0.002 + 4 * 1e-3)
    assert contention.Throttle(level=0.4, burst_s=0.003).delay_s(123) == pytest.approx(0.003 * 0.4 / 0.6)


@given(low=st.floats(0.0, 0.8), high=st.floats(0.0, 0.8), nbytes=st.integers(0, 10**8))
def test_delay_never_falls_as_contention_rises(low: float, high: float, nbytes: int) -> None:
    low, high = sorted((low, high))
    a = contention.Throttle(level=low, burst_s=0.001, bandwidth_bytes_s=1e8).delay_s(nbytes)
    b = contention.Throttle(level=high, burst_s=0.001, bandwidth_bytes_s=1e8).delay_s(nbytes)
    assert 0.0 <= a <= b and math.isfinite(b)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"level": 0.9}, "0..0.8"), ({"level": -0.1}, "0..0.8"),
    ({"burst_s": -1.0}, "burst_s"), ({"bandwidth_bytes_s": 0.0}, "bandwidth_bytes_s"),
])
def test_bad_settings_are_rejected_with_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        contention.Throttle(**kwargs)


def test_level_can_change_mid_run_and_is_checked() -> None:
    throttle = contention.Throttle(burst_s=0.001)
    throttle.set_level(0.5)
    assert throttle.delay_s(0) == pytest.approx(0.001)
    with pytest.raises(ValueError, match="0–80%"):
        throttle.set_level(0.85)
    assert throttle.level == 0.5


@pytest.mark.serial
def test_gloo_link_delivers_in_order_and_times_the_contention_delay() -> None:
    """The same check as the CUDA link's GPU test, on the host-thread link that gloo gets."""
    burst_s, messages = 0.02, 4
    ranks = launch.run_workers(workers.link_worker, 2, "gloo", (0.5, burst_s, messages))
    workers.check_link_run(ranks, "LinkSender", burst_s, messages)


@pytest.mark.serial
def test_gloo_link_holds_each_message_back_by_its_slow_link_delay_without_contention() -> None:
    """A slow-link fault's `extra_s` acts at level 0, on this link alone, and shows in the
    seconds per message the detector reads."""
    extra_s, messages = 0.03, 4
    ranks = launch.run_workers(workers.link_worker, 2, "gloo", (0.0, 0.02, messages, extra_s))
    workers.check_link_run(ranks, "LinkSender", extra_s, messages)


def test_the_planner_prices_a_host_timed_link_at_its_median_message_and_a_cuda_one_at_its_mean() -> None:
    """Measured on two gloo stages of a 2-core box: one message of a step's eight waited 8 ms for
    a thread to get a core while the others took 0.1-0.2 ms. The mean (1.1 ms) read a calm link
    as a preempted one and the planner predicted kFkB gains there were not. CUDA events have no
    such noise: there a burst that holds 3 of 8 messages is contention, which the median would
    have priced as a calm link (found by review). A slow link's detection sums the mean."""
    one_slow = [0.0001, 0.00012, 0.00011, 0.008, 0.0001, 0.00013, 0.0001, 0.00011]
    burst = [0.0002] * 5 + [0.006] * 3
    host, cuda = contention.LinkStats(host_timed=True), contention.LinkStats()
    for seconds in one_slow:
        host.record(98_304, seconds)
    for seconds in burst:
        cuda.record(98_304, seconds)
    assert host.messages == 8 and host.nbytes == 8 * 98_304
    assert host.typical_s == pytest.approx(0.00011)
    assert host.seconds_per_message == pytest.approx(sum(one_slow) / 8)
    assert host.seconds_per_message > 9 * host.typical_s
    assert cuda.typical_s == cuda.seconds_per_message == pytest.approx(sum(burst) / 8)
    assert contention.LinkStats(host_timed=True).typical_s == 0.0  # a link that sent nothing


def test_the_gloo_link_is_host_timed() -> None:
    """LinkSender's clock is its thread's (module docstring); StreamLink's stats stay CUDA-timed."""
    ranks = launch.run_workers(workers.link_worker, 2, "gloo", (0.0, 0.0, 2))
    assert ranks[0]["kind"] == "LinkSender" and ranks[0]["host_timed"] is True
