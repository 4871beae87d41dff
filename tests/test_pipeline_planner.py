"""The adaptive-k planner: its cost model (an event replay of the table with FIFO links)
agrees with the schedule module's own dependency simulation when links are free, charges
1F1B for every round trip once links are slow, and the planner picks the fastest k that fits
in memory, with hysteresis, and says why in numbers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.runtime.pipeline import memory, schedules
from huorn.runtime.pipeline import planner as pipeline_planner


def plain_candidates(stages: int, microbatches: int, ks: tuple[int, ...] = (1, 2, 3, 4)) -> dict:
    return {k: t.to_plain() for k, t in schedules.build_candidates(stages, microbatches, ks).items()}


def peaks(stages: int, microbatches: int, per_microbatch: int, ks: tuple[int, ...] = (1, 2, 3, 4)) -> dict:
    return {k: memory.predict_peak_bytes(t, [per_microbatch] * stages)
            for k, t in schedules.build_candidates(stages, microbatches, ks).items()}


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(schedules.SCHEDULE_NAMES), stages=st.integers(1, 6),
       microbatches=st.integers(1, 16), k=st.integers(1, 5),
       forward=st.floats(0.1, 3.0), backward=st.floats(0.1, 3.0))
def test_cost_model_with_free_links_matches_the_dependency_simulation(
        name: str, stages: int, microbatches: int, k: int, forward: float, backward: float) -> None:
    schedule = schedules.build_schedule(name, stages, microbatches, k)
    timeline = schedules.simulate_timeline(schedule, forward, backward)
    want = max(end for row in timeline for _, _, end in row)
    got = pipeline_planner.predict_step_seconds(schedule.to_plain(), [forward] * stages, [backward] * stages,
                                                [0.0] * (stages - 1), [0.0] * (stages - 1))
    assert got == pytest.approx(want)


def test_slow_links_cost_1f1b_a_round_trip_per_micro_batch_and_kfkb_one_per_group() -> None:
    tables = plain_candidates(4, 16)
    ones, twos = [1.0] * 4, [2.0] * 4
    free = {k: pipeline_planner.predict_step_seconds(t, ones, twos, [0] * 3, [0] * 3)
            for k, t in tables.items()}
    slow = {k: pipeline_planner.predict_step_seconds(t, ones, twos, [1.0] * 3, [1.0] * 3)
            for k, t in tables.items()}
    assert set(free.values()) == {3.0 * (16 + 3)}  # same bubble for all k without links
    assert slow[1] == pytest.approx(85.0)  # 1F1B: about 2 link times added per micro-batch
    assert slow[2] < slow[1] * 0.8  # kFkB hides most of it
    assert all(slow[k] >= free[k] for k in tables)


def test_planner_switches_to_larger_k_when_links_slow_and_explains_with_numbers() -> None:
    planner = pipeline_planner.AdaptiveKPlanner()
    args = dict(forward_s=[0.01] * 4, backward_s=[0.02] * 4, candidates=plain_candidates(4, 16),
                peak_bytes=peaks(4, 16, 1000))
    calm = planner.decide(step=4, current_k=1, link_forward_s=[0.0002] * 3, link_backward_s=[0.0002] * 3,
                          measured_step_s=0.6, **args)
    assert (calm.k, calm.changed) == (1, False)
    busy = planner.decide(step=9, current_k=1, link_forward_s=[0.01] * 3, link_backward_s=[0.01] * 3,
                          measured_step_s=0.85, **args)
    assert busy.changed and busy.k > 1
    assert busy.predicted_step_s[busy.k] < 0.8 * busy.predicted_step_s[1]
    assert "switch" in busy.reason and "link 10.00 ms/message" in busy.reason
    assert busy.model_scale == pytest.approx(0.85 / 0.085 / 10, rel=0.05)  # replay predicted 85 ms
    assert planner.history == [calm, busy]
    assert busy.to_dict()["k"] == busy.k


def test_memory_limit_rules_out_large_k_and_forces_a_switch_down() -> None:
    per_mb = 1000
    limit = 2 * 4 * per_mb  # stage 0 of 4 holds k × 4 micro-batches: only k <= 2 fits
    planner = pipeline_planner.AdaptiveKPlanner(memory_limit_bytes=limit)
    decision = planner.decide(step=0, current_k=4, forward_s=[0.01] * 4, backward_s=[0.02] * 4,
                              link_forward_s=[0.05] * 3, link_backward_s=[0.05] * 3, measured_step_s=1.0,
                              candidates=plain_candidates(4, 16), peak_bytes=peaks(4, 16, per_mb))
    assert decision.feasible == (1, 2)
    assert decision.k == 2
    assert "exceeds the memory limit" in decision.reason and "rules out k=[3, 4]" in decision.reason


def test_small_predicted_gains_do_not_flap_k() -> None:
    planner = pipeline_planner.AdaptiveKPlanner(min_gain=0.5)
    decision = planner.decide(step=0, current_k=1, forward_s=[0.01] * 4, backward_s=[0.02] * 4,
                              link_forward_s=[0.01] * 3, link_backward_s=[0.01] * 3, measured_step_s=1.0,
                              candidates=plain_candidates(4, 16), peak_bytes=peaks(4, 16, 1))
    assert decision.k == 1 and not decision.changed
    assert "keep k=1" in decision.reason


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"memory_limit_bytes": 0}, "memory_limit_bytes"), ({"min_gain": 1.5}, "min_gain"),
    ({"lockstep_link_fraction": 1.0}, "lockstep_link_fraction"), ({"reprobe_every": 0}, "reprobe_every"),
])
def test_bad_planner_settings_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        pipeline_planner.AdaptiveKPlanner(**kwargs)


def test_measurements_of_the_wrong_length_are_rejected() -> None:
    with pytest.raises(ValueError, match="link_forward_s: need 3 values"):
        pipeline_planner.predict_step_seconds(plain_candidates(4, 4)[1], [1] * 4, [1] * 4, [0], [0] * 3)


def calm_window(planner: pipeline_planner.AdaptiveKPlanner, step: int, measured: float,
                link: float = 0.0002, comm: str = "overlap") -> pipeline_planner.KDecision:
    return planner.decide(step=step, current_k=1, forward_s=[0.01] * 4, backward_s=[0.02] * 4,
                          link_forward_s=[link] * 3, link_backward_s=[link] * 3, measured_step_s=measured,
                          candidates=plain_candidates(4, 16), peak_bytes=peaks(4, 16, 1000), comm=comm,
                          lockstep_ok={1: True, 2: True, 3: True, 4: True})


def test_a_fast_link_gets_a_lockstep_window_and_the_faster_mode_is_kept() -> None:
    planner = pipeline_planner.AdaptiveKPlanner(lockstep=True, reprobe_every=3)
    first = calm_window(planner, 4, 0.60)
    assert first.comm == "lockstep" and "0.007× F+B" in first.reason and "never measured" in first.reason
    kept = calm_window(planner, 9, 0.55, comm="lockstep")
    assert (kept.comm, kept.k) == ("lockstep", 1) and "faster than overlap's 600.0 ms" in kept.reason
    assert calm_window(planner, 14, 0.56, comm="lockstep").comm == "lockstep"  # within min_gain
    reprobe = calm_window(planner, 19, 0.55, comm="lockstep")
    assert reprobe.comm == "overlap" and "re-measure overlap" in reprobe.reason
    back = calm_window(planner, 24, 0.60)  # overlap still slower: straight back to lockstep
    assert back.comm == "lockstep" and "measured 550.0 ms against overlap's 600.0 ms" in back.reason


def test_lockstep_that_is_not_faster_is_left_and_not_retried_until_the_reprobe() -> None:
    planner = pipeline_planner.AdaptiveKPlanner(lockstep=True, reprobe_every=3)
    assert calm_window(planner, 4, 0.60).comm == "lockstep"
    slower = calm_window(planner, 9, 0.62, comm="lockstep")
    assert slower.comm == "overlap" and "not faster than overlap's 600.0 ms" in slower.reason
    assert [calm_window(planner, s, 0.60).comm for s in (14, 19)] == ["overlap", "overlap"]
    assert calm_window(planner, 24, 0.60).comm == "lockstep"  # third overlap window: re-measure


def test_a_slower_link_ends_lockstep_and_a_slow_link_never_starts_it() -> None:
    planner = pipeline_planner.AdaptiveKPlanner(lockstep=True)
    calm_window(planner, 4, 0.60)
    calm_window(planner, 9, 0.55, comm="lockstep")
    rose = calm_window(planner, 14, 0.70, comm="lockstep")
    assert rose.comm == "overlap" and "27% slower" in rose.reason and rose.k == 1
    busy = calm_window(planner, 19, 0.90, link=0.01)  # link 1/3 of F+B: overlap it, re-plan k
    assert busy.comm == "overlap" and busy.k > 1


def test_lockstep_needs_permission_and_a_table_that_has_it() -> None:
    assert calm_window(pipeline_planner.AdaptiveKPlanner(), 4, 0.6).comm == "overlap"
    planner = pipeline_planner.AdaptiveKPlanner(lockstep=True)
    decision = planner.decide(step=4, current_k=1, forward_s=[0.01] * 4, backward_s=[0.02] * 4,
                              link_forward_s=[0.0002] * 3, link_backward_s=[0.0002] * 3, measured_step_s=0.6,
                              candidates=plain_candidates(4, 16), peak_bytes=peaks(4, 16, 1000),
                              lockstep_ok={1: False})
    assert decision.comm == "overlap"
    with pytest.raises(ValueError, match="comm"):
        calm_window(planner, 9, 0.6, comm="sideways")
