"""The elastic-recovery benchmark's own bookkeeping: what it counts as lost time, and that a run
which ends before the event it waits for is reported at once, not after its 600 s timeout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import runtime_elastic_recovery as bench


def _write(run_dir: Path, *events: dict) -> None:
    with open(run_dir / "steps.jsonl", "a") as log:
        for event in events:
            log.write(json.dumps(event) + "\n")


def test_a_run_that_ended_before_the_join_is_named_with_the_fix(tmp_path: Path) -> None:
    _write(tmp_path, {"event": "start", "world_size": 2, "resumed_from": 0, "time": 0.0},
           {"event": "step", "step": 1, "world_size": 2, "time": 1.0})
    assert bench._ended_before(tmp_path, "join", 60) is False
    _write(tmp_path, {"event": "done", "step": 60, "time": 2.0})
    with pytest.raises(RuntimeError, match=r"finished all 60 steps before the join: .*--steps.*--pace-ms"):
        bench._ended_before(tmp_path, "join", 60)


def test_lost_seconds_leave_out_the_steps_the_gang_still_made() -> None:
    # one step a second, then a pause: no step between t = 3 and t = 8
    steps = [{"step": n, "time": t} for n, t in enumerate([0.0, 1.0, 2.0, 3.0, 8.0, 9.0, 10.0])]
    assert bench.lost_seconds(steps, at=3.5, done=8.0) == pytest.approx(4.5)
    # from t = 2.5 the gang still made the step at t = 3: one second of the 5.5 was not lost
    assert bench.lost_seconds(steps, at=2.5, done=8.0) == pytest.approx(4.5)
    assert bench.lost_seconds(steps, at=0.5, done=1.2) == 0.0  # a step made in 0.7 s: never negative
