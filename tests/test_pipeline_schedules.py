"""Schedule tables: valid for every schedule, stage count, micro-batch count and k (each
micro-batch's forward before its backward on every stage, same order on every stage, and no
deadlock when the send/recv dependencies are simulated); broken tables are caught with a
message that says where; the memory profile is k × 1F1B's; the drawing is a real PNG."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.runtime.pipeline import drawing, schedules
from huorn.runtime.pipeline.schedules import Action, Schedule


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(schedules.SCHEDULE_NAMES), stages=st.integers(1, 8),
       microbatches=st.integers(1, 24), k=st.integers(1, 8))
def test_every_table_is_valid_and_deadlock_free(name: str, stages: int, microbatches: int, k: int) -> None:
    schedule = schedules.build_schedule(name, stages, microbatches, k)
    schedules.check_schedule(schedule)  # raises on any broken invariant
    assert schedules.find_deadlock(schedule) == []
    timeline = schedules.simulate_timeline(schedule)
    assert timeline is not None
    for stage, row in enumerate(schedule.table):
        assert len(row) == 2 * microbatches
        starts = {(a.kind, a.microbatch): start for a, start, _ in timeline[stage]}
        for m in range(microbatches):
            assert starts[("F", m)] < starts[("B", m)]


@settings(max_examples=40, deadline=None)
@given(stages=st.integers(1, 8), microbatches=st.integers(1, 24), k=st.integers(1, 6))
def test_kfkb_holds_k_times_the_1f1b_micro_batches(stages: int, microbatches: int, k: int) -> None:
    in_flight = schedules.count_in_flight(schedules.build_schedule("kfkb", stages, microbatches, k))
    one = schedules.count_in_flight(schedules.build_schedule("1f1b", stages, microbatches))
    for stage in range(stages):
        assert in_flight[stage] == min(k * (stages - stage), microbatches)
        assert one[stage] == min(stages - stage, microbatches)


def test_k_one_is_1f1b_and_k_at_least_m_is_gpipe() -> None:
    assert schedules.build_schedule("kfkb", 4, 8, 1).table == schedules.build_schedule("1f1b", 4, 8).table
    assert schedules.build_schedule("kfkb", 4, 8, 8).table == schedules.build_schedule("gpipe", 4, 8).table
    assert schedules.build_schedule("kfkb", 4, 8, 20).k == 8


def test_kfkb_last_stage_alternates_groups_of_k() -> None:
    last = schedules.build_schedule("kfkb", 3, 6, 2).table[-1]
    assert " ".join(map(str, last)) == "F0 F1 B0 B1 F2 F3 B2 B3 F4 F5 B4 B5"
    first = schedules.build_schedule("kfkb", 3, 6, 2).table[0]
    assert " ".join(map(str, first)) == "F0 F1 F2 F3 F4 F5 B0 B1 B2 B3 B4 B5"


def broken(table: list[str]) -> Schedule:
    rows = tuple(tuple(Action(t[0], int(t[1:])) for t in row.split()) for row in table)  # type: ignore[arg-type]
    return Schedule(name="custom", stages=len(rows), microbatches=2, k=1, table=rows)


@pytest.mark.parametrize(("rows", "message"), [
    (["F0 B0 F1 B1", "F0 F1 B1 B0"], "not ascending"),
    (["F0 B0 B1 F1", "F0 B0 F1 B1"], "before its forward"),
    (["F0 F0 B0 B1", "F0 B0 F1 B1"], "runs twice"),
    (["F0 F1 B0", "F0 B0 F1 B1"], "covers micro-batches"),
])
def test_broken_tables_are_rejected_with_the_reason(rows: list[str], message: str) -> None:
    with pytest.raises(schedules.ScheduleError, match=message):
        schedules.check_schedule(broken(rows))


def test_a_table_that_waits_on_itself_is_reported_as_a_deadlock() -> None:
    # stage 0 wants B0 before it has sent F1, stage 1 wants F1 before it runs B0: a cycle
    table = broken(["F0 B0 F1 B1", "F0 F1 B0 B1"])
    stuck = schedules.find_deadlock(table)
    assert stuck == ["stage 0 blocks at B0 waiting for B0 of stage 1",
                     "stage 1 blocks at F1 waiting for F1 of stage 0"]
    assert schedules.simulate_timeline(table) is None
    with pytest.raises(schedules.ScheduleError, match="deadlock: stage 0 blocks at B0"):
        schedules.check_schedule(table)


@pytest.mark.parametrize(("args", "field"), [
    (("zigzag", 4, 8, 1), "schedule name"), (("kfkb", 0, 8, 1), "stages"),
    (("kfkb", 4, 0, 1), "microbatches"), (("kfkb", 4, 8, 0), "k must be"),
])
def test_bad_arguments_name_the_field(args: tuple, field: str) -> None:
    with pytest.raises(schedules.ScheduleError, match=field):
        schedules.build_schedule(*args)


def test_the_unit_time_makespan_is_the_same_for_all_k_without_communication() -> None:
    # with no link time every kFkB has the same bubble: the trade-off only appears with links
    ends = set()
    for k in (1, 2, 3, 4, 8):
        timeline = schedules.simulate_timeline(schedules.build_schedule("kfkb", 4, 8, k))
        ends.add(max(end for row in timeline for _, _, end in row))
    assert ends == {3 * (8 + 4 - 1)}


def test_drawing_writes_a_png(tmp_path: Path) -> None:
    items = [schedules.build_schedule("1f1b", 4, 8), schedules.build_schedule("kfkb", 4, 8, 2)]
    path = drawing.draw_schedules(items, tmp_path / "schedules.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


@settings(max_examples=60, deadline=None)
@given(stages=st.integers(2, 8), microbatches=st.integers(1, 24), k=st.integers(1, 3))
def test_lockstep_exchanges_move_every_message_once_in_order_without_deadlock(
        stages: int, microbatches: int, k: int) -> None:
    """Up to k = 3 every kFkB table (and so 1F1B) has lockstep exchanges. Each message is sent
    once and received once, in micro-batch order per direction, never before the action that
    makes it, its receive sits right before the action that needs it, and the strict NCCL
    rendezvous model runs to the end."""
    schedule = schedules.build_schedule("kfkb", stages, microbatches, k)
    exchanges = schedules.lockstep_exchanges(schedule)
    assert schedules.find_lockstep_deadlock(schedule, exchanges) == []
    for stage, row in enumerate(schedule.table):
        assert len(exchanges[stage]) == len(row) + 1
        done = {(a.kind, a.microbatch): i for i, a in enumerate(row)}
        sends: dict[str, list[int]] = {"F": [], "B": []}
        for index, ops in enumerate(exchanges[stage]):
            for t in ops:
                if t.op == "send":
                    assert done[(t.kind, t.microbatch)] < index, f"{t} before its action"
                    assert t.peer == (stage + 1 if t.kind == "F" else stage - 1)
                    sends[t.kind].append(t.microbatch)
                else:
                    assert (row[index].kind, row[index].microbatch) == (t.kind, t.microbatch)
        if stage < stages - 1:
            assert sends["F"] == list(range(microbatches))
        if stage > 0:
            assert sends["B"] == list(range(microbatches))


def test_1f1b_lockstep_pairs_each_send_with_the_next_receive_as_torch_does() -> None:
    exchanges = schedules.lockstep_exchanges(schedules.build_schedule("1f1b", 2, 3))
    text = [[", ".join(map(str, ops)) for ops in per_stage] for per_stage in exchanges]
    assert text[0] == ["", "send F0 → stage 1", "send F1 → stage 1, recv B0 ← stage 1", "",
                       "send F2 → stage 1, recv B1 ← stage 1", "recv B2 ← stage 1", ""]
    assert text[1] == ["recv F0 ← stage 0", "", "send B0 → stage 0, recv F1 ← stage 0", "",
                       "send B1 → stage 0, recv F2 ← stage 0", "", "send B2 → stage 0"]


def test_2f2b_defers_the_sends_that_would_close_a_rendezvous_cycle() -> None:
    """Sent right after F2, stage 0's F2 would wait for stage 1, which waits to hand B1 to
    stage 0 behind it: the naive pairing is a cycle, and the deferral resolves it."""
    schedule = schedules.build_schedule("kfkb", 2, 4, 2)
    exchanges = schedules.lockstep_exchanges(schedule)
    first = [", ".join(map(str, ops)) for ops in exchanges[0]]
    assert "send F2 → stage 1" not in first[3]  # not in the exchange right after F2
    assert schedules.find_lockstep_deadlock(schedule, exchanges) == []
    naive = [[[t for t in ops] for ops in per_stage] for per_stage in exchanges]
    naive[0][3] = [schedules.Transfer("send", "F", 1, 2)]  # back where the naive pairing puts it
    for index, ops in enumerate(naive[0]):
        if index != 3:
            naive[0][index] = [t for t in ops if (t.op, t.kind, t.microbatch) != ("send", "F", 2)]
    assert schedules.describe_blocked(naive)


def test_tables_without_lockstep_exchanges_say_so() -> None:
    schedule = schedules.build_schedule("kfkb", 4, 16, 5)
    with pytest.raises(schedules.ScheduleError, match="cannot run in lockstep"):
        schedules.lockstep_exchanges(schedule)
    assert schedules.find_lockstep_deadlock(schedule)
