"""FALCON fail-slow detection: BOCD + validation over randomised synthetic traces, localisation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.scheduler.remediation import bocd, failslow, period, steptable

WORKERS = 4
STEPS = 300


def build_trace(rng: np.random.Generator, slow: tuple[int, int, float] | None) -> steptable.StepTable:
    """Per-worker busy times with realistic noise: lognormal jitter (1-4%), per-worker speed
    differences, a slow drift and 2% spikes (GC pauses, checkpoint steps) of 1.3-2.5×."""
    noise = rng.uniform(0.01, 0.04)
    base = rng.uniform(0.05, 2.0)
    rows = []
    for w in range(WORKERS):
        t = base * rng.uniform(0.95, 1.05) * np.exp(rng.normal(0, noise, STEPS))
        t *= np.linspace(1.0, rng.uniform(0.98, 1.02), STEPS)
        spikes = rng.random(STEPS) < 0.02
        t[spikes] *= rng.uniform(1.3, 2.5, spikes.sum())
        if slow is not None and slow[0] == w:
            t[slow[1]:] *= slow[2]
        rows += [{"iteration": i, "worker": f"w{w}", "time": float(t[i])} for i in range(STEPS)]
    return steptable.build_table(rows, steptable.REQUIRED)


def test_fifty_randomised_trials_meet_precision_recall_and_onset() -> None:
    rng = np.random.default_rng(2026)
    true_pos = false_pos = false_neg = clean_alarms = 0
    onset_errors = []
    for _ in range(50):
        worker, onset, factor = int(rng.integers(WORKERS)), int(rng.integers(30, 260)), rng.uniform(1.2, 3.0)
        trace = build_trace(rng, (worker, onset, factor))
        found = [f for f in failslow.detect_fail_slow(trace) if f.factor > 1]
        hits = [f for f in found if f.worker == f"w{worker}" and abs(f.onset_iteration - onset) <= 20]
        true_pos += min(len(hits), 1)
        false_neg += 1 - min(len(hits), 1)
        false_pos += len(found) - min(len(hits), 1)
        onset_errors += [abs(h.onset_iteration - onset) for h in hits[:1]]
        if hits:
            assert hits[0].kind == "compute"
            assert hits[0].factor == pytest.approx(factor, rel=0.08)
        clean_alarms += len(failslow.detect_fail_slow(build_trace(rng, None)))
    precision = true_pos / max(true_pos + false_pos, 1)
    recall = true_pos / (true_pos + false_neg)
    assert precision >= 0.95 and recall >= 0.95, (precision, recall)
    assert max(onset_errors) <= 20
    assert clean_alarms == 0


def test_spike_without_level_shift_is_rejected_by_validation() -> None:
    """Plain BOCD flags a lone burst; the ≥10% median shift check throws it away."""
    x = np.full(200, 0.1) * np.exp(np.random.default_rng(1).normal(0, 0.02, 200))
    x[100:103] *= 3.0
    filt = bocd.RunLengthFilter(float(np.log(x[0])), 0.02, bocd.BocdConfig())
    flagged = max(float(filt.update(float(np.log(v)))[:16].sum()) for v in x)
    assert flagged > 0.9  # the raw change-point mass does fire on the burst
    assert bocd.detect_changes(x) == []


def test_a_shift_whose_first_high_step_ends_the_warm_up_is_reported_after_it() -> None:
    """Step times up 1.6× from step 9, the last of the 10-step warm-up (a slow link's first
    delayed messages under CPU load can land there): the shift is reported at the first step
    after the warm-up. The onset used to be refined into the warm-up and rejected, and the run
    that held the shift absorbed it: it was never reported. Three high steps at the same place,
    followed by the old level, are still no change."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        base = 0.065 * np.exp(rng.normal(0, 0.04, 50))
        shifted = base.copy()
        shifted[9:] *= 1.6
        found = bocd.detect_changes(shifted)
        assert [c.onset for c in found] == [10], found
        assert found[0].factor == pytest.approx(1.6, rel=0.1)
        spiked = base.copy()
        spiked[9:12] *= 1.6
        assert bocd.detect_changes(spiked) == []


def test_a_slowdown_soon_after_a_start_up_transient_eased_is_found() -> None:
    """A loaded host's first steps run slow and then ease (a validated change, factor < 1, at
    step 12); a rank slows down 1.5× eight steps later. Both are found, each at its onset. The
    second was missed for good while a change needed a whole warm-up of its segment before it
    (8 < 10 steps): the candidate was skipped at every step, and the run holding it grew."""
    rng = np.random.default_rng(11)
    for _ in range(20):
        x = 0.05 * np.exp(rng.normal(0, 0.03, 80))
        x[:12] *= 2.0
        x[20:] *= 1.5
        found = bocd.detect_changes(x)
        assert [c.onset for c in found] == [12, 20], found
        assert found[0].factor == pytest.approx(0.5, rel=0.1)
        assert found[1].factor == pytest.approx(1.5, rel=0.1)
        legacy = bocd.BocdConfig(min_segment=bocd.BocdConfig().warmup)
        assert [c.onset for c in bocd.detect_changes(x, legacy)] == [12]


@pytest.mark.parametrize("min_segment", [1, 11])
def test_a_segment_shorter_than_two_steps_or_longer_than_the_warm_up_is_refused(min_segment: int) -> None:
    with pytest.raises(ValueError, match="min_segment"):
        bocd.BocdConfig(min_segment=min_segment)


def test_small_shift_below_ten_percent_is_not_reported() -> None:
    x = np.full(300, 1.0) * np.exp(np.random.default_rng(3).normal(0, 0.01, 300))
    x[150:] *= 1.05
    assert bocd.detect_changes(x) == []


def test_job_wide_shift_is_reported_once_as_job_wide() -> None:
    rng = np.random.default_rng(5)
    rows = []
    for w in range(4):
        t = 0.2 * np.exp(rng.normal(0, 0.02, 200))
        t[120:] *= 1.4
        rows += [{"iteration": i, "worker": str(w), "time": float(t[i])} for i in range(200)]
    found = failslow.detect_fail_slow(steptable.build_table(rows, steptable.REQUIRED))
    assert [(f.worker, f.kind) for f in found] == [("*", "job-wide")]
    assert abs(found[0].onset_iteration - 120) <= 5


def test_compute_straggler_does_not_also_blame_the_waiting_peers_comm() -> None:
    rng = np.random.default_rng(8)
    rows = []
    for w in range(4):
        compute = 0.1 * np.exp(rng.normal(0, 0.02, 200))
        comm = 0.02 * np.exp(rng.normal(0, 0.02, 200))
        if w == 2:
            compute[90:] *= 2.0
        else:
            comm[90:] += 0.1  # peers now wait for rank 2 inside the all-reduce
        rows += [{"iteration": i, "worker": str(w), "time": float(compute[i] + comm[i]),
                  "compute": float(compute[i]), "comm": float(comm[i])} for i in range(200)]
    table = steptable.build_table(rows, (*steptable.REQUIRED, *steptable.OPTIONAL))
    found = failslow.detect_fail_slow(table)
    assert [(f.worker, f.kind) for f in found] == [("2", "compute")]


def rank_2_shaped(shape: np.ndarray, seed: int = 3) -> steptable.StepTable:
    """Four ranks of 0.1 s compute each step, rank 2's scaled by `shape`; each waits for the
    slowest, then the all-reduce."""
    rng = np.random.default_rng(seed)
    computes = [0.1 * np.exp(rng.normal(0, 0.02, len(shape))) * (shape if w == 2 else 1.0) for w in range(4)]
    step = np.max(computes, axis=0) + 0.02
    rows = []
    for w, compute in enumerate(computes):
        rows += [{"iteration": i, "worker": str(w), "time": float(step[i]), "compute": float(compute[i]),
                  "comm": float(step[i] - compute[i])} for i in range(len(shape))]
    return steptable.build_table(rows, (*steptable.REQUIRED, *steptable.OPTIONAL))


def test_a_change_after_a_change_is_validated_against_the_segment_it_ends() -> None:
    """Rank 2 computes 4× slower from step 30, 2× from 50, 4× from 70 and 2× from 90. The last
    drop was measured against the median of the 100 steps before it (healthy, 4× and 2× ones:
    about 2× itself), moved nothing, and was dropped: the worker read as 4× slow to the end."""
    shape = np.array([1.0 if i < 30 else 4.0 if i < 50 or 70 <= i < 90 else 2.0 for i in range(140)])
    found = failslow.detect_fail_slow(rank_2_shaped(shape))
    assert [(f.worker, f.onset_iteration, round(f.factor, 1)) for f in found if f.kind == "compute"] == [
        ("2", 30, 4.0), ("2", 50, 0.5), ("2", 70, 2.0), ("2", 90, 0.5)], found


@pytest.mark.parametrize("burst", [5, 6, 8])
def test_a_burst_of_a_few_steps_leaves_no_lone_change(burst: int) -> None:
    """A burst starts and ends a change for BOCD, and 20 steps after its start are mostly past it,
    so its rise is not validated. Its fall was measured from the rise all the same (against the
    burst's own steps) and reported alone: an easing of a healthy worker, and on a 4× straggler
    an easing to 2× that made its later real easing to 2× read as its recovery."""
    healthy = np.array([2.0 if 100 <= i < 100 + burst else 1.0 for i in range(200)])
    assert failslow.detect_fail_slow(rank_2_shaped(healthy)) == []
    straggler = np.array([1.0 if i < 30 else 8.0 if 100 <= i < 100 + burst else 4.0 for i in range(200)])
    found = failslow.detect_fail_slow(rank_2_shaped(straggler))
    assert [(f.worker, f.onset_iteration) for f in found] == [("2", 30)], found
    assert found[0].factor == pytest.approx(4.0, rel=0.05)


def test_localisation_uses_two_x_for_compute_and_one_point_one_x_for_comm() -> None:
    compute = {0: 1.0, 1: 1.1, 2: 2.3, 3: 0.9}
    comm = {0: 1.0, 1: 1.0, 2: 1.02, 3: 1.15}
    culprits = failslow.localise_ranks(compute, comm)
    assert [(c.rank, c.kind) for c in culprits] == [(2, "compute"), (3, "communication")]
    assert failslow.localise_ranks({0: 1.0, 1: 1.9, 2: 1.0}, {}) == []  # 1.9× is compute noise


def _smallest_period(pattern: list[int]) -> int:
    n = len(pattern)
    return next(d for d in range(1, n + 1) if n % d == 0 and pattern == pattern[:d] * (n // d))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=2, max_size=9), st.integers(5, 30))
def test_period_from_autocorrelation_finds_calls_per_iteration(pattern: list[int], reps: int) -> None:
    """Message sizes of the calls in one iteration (gradient buckets), repeated every step."""
    assert period.estimate_period(np.tile(pattern, reps)) == _smallest_period(pattern)


def test_period_survives_timing_noise_and_near_repeats() -> None:
    rng = np.random.default_rng(0)
    sizes = np.tile([4.0, 16.0, 4.0, 17.0, 64.0], 40) * np.exp(rng.normal(0, 0.01, 200))
    assert period.estimate_period(sizes) == 5


def test_iteration_times_are_cut_from_a_raw_collective_log() -> None:
    sizes = [4, 16, 16, 1] * 30
    step = np.concatenate([[0.5] * 60, [0.8] * 60])
    starts = np.cumsum(np.repeat(step / 4, 1))[: len(sizes)]
    durations = period.iteration_times(starts, sizes)
    assert period.estimate_period(sizes) == 4
    assert durations[0] == pytest.approx(0.5) and durations[-1] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("iteration,worker\n1,a\n", "'time'"),
        ("iteration,worker,time\nx,a,0.1\n", "column 'iteration'"),
        ("iteration,worker,time\n1,a,fast\n", "column 'time'"),
        ("iteration,worker,time\n1,a,-1\n", "column 'time'"),
        ("iteration,worker,time\n1,a,0.1\n1,a,0.2\n", "duplicate"),
        ("iteration,worker,time\n1,,0.1\n", "column 'worker'"),
        ("", "header"),
    ],
)
def test_malformed_step_tables_name_the_column(text: str, needle: str) -> None:
    with pytest.raises(steptable.StepTableError, match=needle):
        steptable.parse_csv(text)


def test_step_table_round_trips_through_csv() -> None:
    table = build_trace(np.random.default_rng(0), None)
    again = steptable.parse_csv(steptable.format_csv(table))
    assert again.workers == table.workers
    for w in table.workers:
        assert np.allclose(again.times[w], table.times[w])


@settings(max_examples=15, deadline=None)
@given(st.floats(1e-3, 1e3), st.integers(0, 10_000))
def test_detection_does_not_depend_on_the_unit_of_time(scale: float, seed: int) -> None:
    """Log-space BOCD: milliseconds or hours, the same trace gives the same change-points."""
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(0, 0.02, 150))
    x[int(rng.integers(30, 120)):] *= 1.5
    base = [(c.onset, round(c.factor, 6)) for c in bocd.detect_changes(x)]
    assert [(c.onset, round(c.factor, 6)) for c in bocd.detect_changes(x * scale)] == base
    assert len(base) == 1


def test_slow_network_is_found_on_the_minimum_comm_time_as_job_wide_communication() -> None:
    rng = np.random.default_rng(9)
    rows = []
    for w in range(4):
        compute = 0.1 * np.exp(rng.normal(0, 0.02, 200))
        comm = 0.03 * np.exp(rng.normal(0, 0.02, 200)) + rng.uniform(0, 0.02, 200)  # waiting jitter
        comm[110:] += 0.03  # every collective now takes 30 ms longer
        rows += [{"iteration": i, "worker": str(w), "time": float(compute[i] + comm[i]),
                  "compute": float(compute[i]), "comm": float(comm[i])} for i in range(200)]
    table = steptable.build_table(rows, (*steptable.REQUIRED, *steptable.OPTIONAL))
    found = failslow.detect_fail_slow(table)
    assert [(f.worker, f.kind) for f in found] == [(failslow.JOB_WIDE, "communication")]
    assert abs(found[0].onset_iteration - 110) <= 5
