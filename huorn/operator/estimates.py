"""How far a training job is and how long it has left: status.progressPercent and the ETA.

Kubeflow Trainer's trainerStatus gives its users a progress percentage and an estimated
remaining time, and `kubectl get trainjob` prints them; Huorn's TrainingJob does the same, from
the budget its spec declares (steps, or tokens against the tokens trained) and the rate its
telemetry shows.
"""

from __future__ import annotations

from typing import Any


def human_seconds(seconds: float) -> str:
    """'45s', '12m', '3h05m', '2d04h': an ETA a person reads at a glance, as kubectl prints ages."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def estimate_progress(done: int, total: int | None, now: float, since: tuple[float, int] | None,
                      unit_seconds: float | None) -> dict[str, Any]:
    """progressPercent and the ETA, as Kubeflow Trainer's trainerStatus gives them, for `done` of
    `total` units: steps for a budget in steps, tokens for one in tokens (a step's tokens change
    with the global batch, so steps do not measure such a run).

    The rate is the units made since the previous progress write (`since`: its time and units)
    over the time between, so the pauses of resizes and restarts count, as they will in the time
    left. Before a second write, or when the count went back (a restart from a checkpoint), it
    is the newest step's own: one unit per `unit_seconds`."""
    if not total:
        return {}
    out: dict[str, Any] = {"progressPercent": min(100, max(0, 100 * done // total))}
    rate = None
    if since is not None and done > since[1] and now > since[0]:
        rate = (done - since[1]) / (now - since[0])
    elif unit_seconds is not None and unit_seconds > 0:
        rate = 1.0 / unit_seconds
    if rate is not None:
        left = max(0, total - done) / rate
        out |= {"estimatedRemainingSeconds": round(left), "estimatedRemaining": human_seconds(left)}
    return out
