"""Readers of the step log (`steps.jsonl` in the run dir), which rank 0 appends one JSON line to
per event: `start` (a worker gang began, with the step it resumed from), `regroup` (an in-place
resize formed a new gang, huorn.runtime.membership, with the step it continues from), `step`,
`checkpoint` and `done`. Backends read it for status (step, loss), tests and benchmarks to prove that a
resize neither skipped nor repeated a step."""

from __future__ import annotations

import json
from pathlib import Path

from huorn.runtime import config as run_config


def read_events(run_dir: Path) -> list[dict]:
    """All events so far; a line still being written is skipped, not an error."""
    path = Path(run_dir) / run_config.STEPS_FILE
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    events = []
    for line in lines:
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events


def missed_join(event: dict) -> bool:
    """A regroup for a join that formed at the old size: on a loaded host the joiner can miss the
    round its gang formed for it (most likely c10d's last call closing before it synced). It
    stays in the wait list and is counted again at the next step boundary; nothing is lost."""
    return (event.get("event") == "regroup" and event.get("reason") == "join"
            and event.get("world_size") == event.get("from_world_size"))


def steps_of(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("event") == "step"]


def last_step(run_dir: Path) -> int:
    steps = steps_of(read_events(run_dir))
    return steps[-1]["step"] if steps else 0


def split_attempts(events: list[dict]) -> list[dict]:
    """Group the log by gang: each attempt has the event that formed it (`start`, or `regroup`
    after an in-place resize) and the steps it logged."""
    attempts: list[dict] = []
    for event in events:
        if event.get("event") in ("start", "regroup"):
            attempts.append({"start": event, "steps": []})
        elif event.get("event") == "step" and attempts:
            attempts[-1]["steps"].append(event)
    return attempts


def effective_steps(events: list[dict]) -> dict[int, dict]:
    """The step history that counts: an attempt that resumed from step k overrides whatever an
    earlier attempt logged after k (that work died with the crash and was redone)."""
    history: dict[int, dict] = {}
    for attempt in split_attempts(events):
        resumed = attempt["start"]["resumed_from"]
        history = {k: v for k, v in history.items() if k <= resumed}
        for step in attempt["steps"]:
            history[step["step"]] = step
    return history


def first_step_after(run_dir: Path, since: float, world_size: int) -> float | None:
    """Wall time of the first step of an attempt at `world_size` that started after `since`:
    the end of a resize or a recovery as a user sees it."""
    for attempt in split_attempts(read_events(run_dir)):
        start = attempt["start"]
        if start["time"] > since and start["world_size"] == world_size and attempt["steps"]:
            return attempt["steps"][0]["time"]
    return None
