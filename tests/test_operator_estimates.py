"""status.progressPercent and the ETA: the declared steps, and a rate that counts pauses."""

from __future__ import annotations

import pytest

from huorn.api.training import TrainingJobStatus
from huorn.backends import monitor
from huorn.operator import estimates, monitoring


@pytest.mark.parametrize(("seconds", "shown"), [
    (0, "0s"), (45, "45s"), (59.6, "1m"), (720, "12m"), (3 * 3600 + 5 * 60, "3h05m"),
    (2 * 86400 + 4 * 3600, "2d04h")])
def test_an_eta_reads_like_a_kubectl_age(seconds: float, shown: str) -> None:
    assert estimates.human_seconds(seconds) == shown


def test_before_a_second_write_the_newest_steps_own_time_is_the_rate() -> None:
    got = estimates.estimate_progress(7, 100, now=50.0, since=None, unit_seconds=0.4)
    assert got == {"progressPercent": 7, "estimatedRemainingSeconds": 37, "estimatedRemaining": "37s"}


def test_the_rate_between_writes_counts_the_pauses_in_between() -> None:
    # 30 steps in 20 s although each step took 0.1 s: a resize paused the gang for 17 s.
    got = estimates.estimate_progress(40, 100, now=30.0, since=(10.0, 10), unit_seconds=0.1)
    assert got["estimatedRemainingSeconds"] == 40 and got["progressPercent"] == 40


def test_a_step_that_went_back_falls_back_to_the_step_time() -> None:
    """A restart from a checkpoint: the steps since the last write are negative, not a rate."""
    got = estimates.estimate_progress(40, 100, now=30.0, since=(10.0, 50), unit_seconds=2.0)
    assert got["estimatedRemainingSeconds"] == 120 and got["estimatedRemaining"] == "2m"


def test_no_declared_length_or_no_rate_gives_no_estimate() -> None:
    assert estimates.estimate_progress(40, None, now=30.0, since=None, unit_seconds=1.0) == {}
    assert estimates.estimate_progress(40, 100, now=30.0, since=(30.0, 40), unit_seconds=None) == {
        "progressPercent": 40}
    done = estimates.estimate_progress(120, 100, now=30.0, since=None, unit_seconds=1.0)
    assert done["progressPercent"] == 100 and done["estimatedRemainingSeconds"] == 0


def test_what_the_monitor_writes_is_the_status_model() -> None:
    steps = [{"step": s, "time": 100.0 + s, "step_seconds": 0.5, "loss": 3.0 - 0.1 * s,
              "tokens_per_second": 2000.0} for s in range(1, 8)]
    observation = monitor.Observation(time=110.0, steps=steps)
    progress = monitoring.build_progress(observation, 1000, since=(90.0, ("steps", 2)))
    parsed = TrainingJobStatus.model_validate(progress)
    assert parsed.step == 7 and parsed.progress_percent == 0  # 7 of 1,000 rounds down
    assert parsed.estimated_remaining_seconds == 3972  # 5 steps in 20 s: 993 steps left at 0.25 /s
    assert parsed.estimated_remaining == "1h06m"
