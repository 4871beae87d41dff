"""kstatus conditions: Ready, Reconciling and Stalled, each with observedGeneration.

kstatus (what `kubectl wait`, Argo CD and Flux read) treats an object as current when
observedGeneration equals metadata.generation and neither Reconciling nor Stalled is True. The
three conditions are always written together so that a reader never sees a stale mix, and a
condition's lastTransitionTime changes only when its status does, as metav1.Condition requires.

A job that was ever suspended has a fourth, Suspended, as Kubernetes Jobs and JobSets do: it is
written from the first suspension on (so `kubectl wait --for=condition=Suspended` works), and
turns False with reason Resumed when the job runs again.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
SUSPENDED = "Suspended"


def now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def build_conditions(
    previous: list[Mapping[str, Any]] | None,
    generation: int | None,
    *,
    ready: tuple[bool, str, str],
    reconciling: tuple[bool, str, str] | None = None,
    stalled: tuple[bool, str, str] | None = None,
    suspended: tuple[bool, str, str] | None = None,
) -> list[dict[str, Any]]:
    """The three conditions, and Suspended once there was one; each tuple is (status, reason,
    message). Absent means False."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    kinds = [(READY, ready), (RECONCILING, reconciling), (STALLED, stalled)]
    if suspended is not None or SUSPENDED in before:
        kinds.append((SUSPENDED, suspended if suspended is not None else (False, "Resumed", "")))
    for kind, value in kinds:
        status, reason, message = value if value is not None else (False, "AsExpected", "")
        text = "True" if status else "False"
        old = before.get(kind) or {}
        since = old.get("lastTransitionTime") if old.get("status") == text else None
        out.append(
            {
                "type": kind,
                "status": text,
                "reason": reason,
                "message": message,
                "lastTransitionTime": since or now(),
                "observedGeneration": generation,
            }
        )
    return out


def is_true(conditions: list[Mapping[str, Any]] | None, kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions or [])


def strip_times(status: Mapping[str, Any]) -> dict[str, Any]:
    """Status without timestamps, to tell whether a write would change anything."""
    out = {k: v for k, v in status.items() if k not in ("conditions", "decisions", "kopf") and v is not None}
    out["conditions"] = [
        {k: v for k, v in c.items() if k != "lastTransitionTime"} for c in status.get("conditions") or []
    ]
    out["decisions"] = [{k: v for k, v in d.items() if k != "time"} for d in status.get("decisions") or []]
    return out
