"""Schedule tables drawn as Gantt charts (PNG), so that a person can see warm-up, the kFkB
groups and the bubbles at a glance. Times come from the dependency simulation in `schedules`
(unit forward, double backward) unless measured ones are given."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from huorn.runtime.pipeline import schedules

FORWARD_COLOR = "#4C72B0"
BACKWARD_COLOR = "#DD8452"


def draw_schedules(items: Sequence[schedules.Schedule], path: str | Path, forward_s: float = 1.0,
                   backward_s: float = 2.0) -> Path:
    """Draw one panel per schedule, stacked, into a PNG at `path`; returns the path."""
    if not items:
        raise ValueError("draw_schedules: give at least one schedule")
    figure, axes = plt.subplots(len(items), 1, figsize=(12, 1.1 + 0.55 * sum(s.stages for s in items)),
                                squeeze=False)
    for axis, schedule in zip(axes[:, 0], items, strict=True):
        timeline = schedules.simulate_timeline(schedule, forward_s, backward_s)
        if timeline is None:
            raise schedules.ScheduleError(f"{schedule.name} k={schedule.k} deadlocks; nothing to draw")
        for stage, row in enumerate(timeline):
            for action, start, end in row:
                color = FORWARD_COLOR if action.kind == "F" else BACKWARD_COLOR
                axis.barh(stage, end - start, left=start, color=color, edgecolor="white", height=0.8)
                axis.text((start + end) / 2, stage, str(action.microbatch), ha="center", va="center",
                          color="white", fontsize=7)
        makespan = max(end for row in timeline for _, _, end in row)
        axis.set_yticks(range(schedule.stages), [f"stage {s}" for s in range(schedule.stages)])
        axis.invert_yaxis()
        axis.set_title(f"{schedule.name} k={schedule.k}, {schedule.microbatches} micro-batches, "
                       f"peak in flight {schedules.count_in_flight(schedule)}, makespan {makespan:g}",
                       fontsize=9)
        axis.set_xlim(0, makespan)
    axes[-1, 0].set_xlabel("time (forward = 1, backward = 2)")
    figure.tight_layout()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=110)
    plt.close(figure)
    return target
