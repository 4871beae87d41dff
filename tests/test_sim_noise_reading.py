"""The simulator's policies read the gradient noise scale as the runtime reports it, not the truth:
nothing before a job has trained, then the truth with the runtime's measured error."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import sim_support

from huorn.sim import engine, policies, run, state, workload


def _job(name: str = "j") -> workload.TrainingJob:
    fam = workload.FAMILIES["cnn"]
    return workload.TrainingJob(name, 0.0, 1, fam, fam.params, fam.noise_scale, 1, 8, 1, 1e9, 3600.0)


def test_a_job_that_has_not_trained_reads_no_noise_scale_and_the_policy_sees_zero() -> None:
    js = state.JobState(_job())
    js.read_noise_scale(600.0)
    assert js.noise_reading == 0.0 and js.noise_scale > 0
    assert policies.job_view(js).noise_scale == 0.0


@pytest.mark.parametrize(("replicas", "sigma"), [(1, state.NOISE_READING_SIGMA_ALONE),
                                                  (2, state.NOISE_READING_SIGMA)])
def test_the_reading_scatters_around_the_truth_with_the_measured_sigma(replicas: int, sigma: float) -> None:
    """One GPU reads two halves of its micro-batches, a little more widely than two or more ranks."""
    js = state.JobState(_job())
    js.replicas = replicas
    js.done = js.job.work / 2  # the true noise scale no longer moves while nothing trains
    errors = []
    for tick in range(2000):
        js.read_noise_scale(60.0 * tick)
        errors.append(math.log(js.noise_reading / js.noise_scale))
        assert policies.job_view(js).noise_scale == js.noise_reading
    assert float(np.std(errors)) == pytest.approx(sigma, rel=0.1)
    assert abs(float(np.mean(errors))) < 0.05


def test_a_job_reads_the_same_at_the_same_time_under_every_policy() -> None:
    """Readings are indexed by job and time, not drawn from the engine's generator, which each
    policy consumes differently: a policy's luck with readings would otherwise differ."""
    one, other, neighbour = state.JobState(_job()), state.JobState(_job()), state.JobState(_job("k"))
    for js in (one, other, neighbour):
        js.done = 1.0
    seen = []
    for t in (60.0, 120.0, 180.0):
        for js in (one, other, neighbour):
            js.read_noise_scale(t)
        assert one.noise_reading == other.noise_reading
        seen.append((one.noise_reading, neighbour.noise_reading))
    assert len({a for a, _ in seen}) == 3 and any(a != b for a, b in seen)


@pytest.mark.skipif(not sim_support.TRACE.exists(), reason="shared OpenB trace not present")
def test_in_a_run_every_job_that_trained_was_last_seen_through_a_reading() -> None:
    config = engine.SimConfig(gpus=32, seed=1)
    _, sims = run.run_policies(sim_support.TRACE, sim_support.NODES, sim_support.QPS, ["huorn"], config)
    trained = [js for js in sims["huorn"].jobs if js.done > 0]
    assert trained
    # a job whose whole run fell between two ticks never reported; every other one did
    read = [js for js in trained if js.noise_reading > 0]
    assert len(read) >= 0.8 * len(trained)
    assert all(js.noise_reading != js.noise_scale for js in read)
    ratios = np.log([js.noise_reading / js.noise_scale for js in read])
    assert float(np.max(np.abs(ratios))) < 6 * state.NOISE_READING_SIGMA_ALONE


@pytest.mark.skipif(not sim_support.TRACE.exists(), reason="shared OpenB trace not present")
@pytest.mark.parametrize("period", [60.0, 300.0])
def test_a_reading_is_kept_for_noise_reading_seconds_but_a_first_one_comes_at_once(
        period: float, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: dict[str, list[float]] = {}
    first_read_at: dict[str, float] = {}
    original = state.JobState.read_noise_scale

    def record(js: state.JobState, t: float) -> None:
        had = js.noise_reading > 0
        original(js, t)
        if had:
            calls.setdefault(js.job.name, []).append(t)
        elif js.noise_reading > 0:
            first_read_at[js.job.name] = t

    monkeypatch.setattr(state.JobState, "read_noise_scale", record)
    config = engine.SimConfig(gpus=32, seed=1, noise_reading_seconds=period)
    run.run_policies(sim_support.TRACE, sim_support.NODES, sim_support.QPS, ["huorn"], config)
    gaps = [b - a for times in calls.values() for a, b in itertools.pairwise(times)]
    assert gaps and min(gaps) >= period
    # a job that has trained reads at the first tick after, not at the next reading time
    off_period = [t for t in first_read_at.values() if t % period]
    assert (len(off_period) > 0) == (period > 60.0)


def test_noise_reading_seconds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="noise_reading_seconds must be > 0, got 0"):
        engine.SimConfig(gpus=32, noise_reading_seconds=0)
