"""How far a training job is and how long it has left: status.progressPercent and the ETA.

Kubeflow Trainer's trainerStatus gives its users a progress percentage and an estimated
remaining time, and `kubectl get trainjob` prints them; Huorn's TrainingJob does the same, from
the steps its spec declares and the rate its telemetry shows.
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


def estimate_progress(step: int, total: int | None, now: float, since: tuple[float, int] | None,
                      step_seconds: float | None) -> dict[str, Any]:
    """progressPercent and the ETA, as Kubeflow Trainer's trainerStatus gives them.

    The rate is the steps made since the previous progress write over the time between, so the
    pauses of resizes and restarts count, as they will in the time left. Before a second write,
    or when the step went back (a restart from a checkpoint), it is the newest step's own time."""
    if not total:
        return {}
    out: dict[str, Any] = {"progressPercent": min(100, max(0, 100 * step // total))}
    rate = None
    if since is not None and step > since[1] and now > since[0]:
        rate = (step - since[1]) / (now - since[0])
    elif step_seconds is not None and step_seconds > 0:
        rate = 1.0 / step_seconds
    if rate is not None:
        left = max(0, total - step) / rate
        out |= {"estimatedRemainingSeconds": round(left), "estimatedRemaining": human_seconds(left)}
    return out
