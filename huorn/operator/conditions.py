"""kstatus conditions: Ready, Reconciling and Stalled, each with observedGeneration.

kstatus (what `kubectl wait`, Argo CD and Flux read) treats an object as current when
observedGeneration equals metadata.generation and neither Reconciling nor Stalled is True. The
three conditions are always written together so that a reader never sees a stale mix, and a
condition's lastTransitionTime changes only when its status does, as metav1.Condition requires.

A job that was ever suspended has a fourth, Suspended, as Kubernetes Jobs and JobSets do: it is
written from the first suspension on (so `kubectl wait --for=condition=Suspended` works), and
turns False with reason Resumed when the job runs again.

A finished TrainingJob or RLJob has a terminal condition, as a Kubernetes Job has `Complete` or
`Failed`: `Succeeded` (named as the phase is) or `Failed`, status True, written with the phase and
kept as it is from then on; before the end neither is there. So CI can `kubectl wait
--for=condition=Succeeded` (or Failed) on either kind. A finished job is not Ready: Ready=False
with reason Succeeded, or with the failure's reason. An InferenceJob has no end, so neither.

A job that finished under an operator older than the terminal conditions has none, and `kubectl
wait` would wait on it forever; the first reconcile of it adds one (late_terminal), once.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

READY = "Ready"
RECONCILING = "Reconciling"
STALLED = "Stalled"
SUSPENDED = "Suspended"
SUCCEEDED = "Succeeded"
FAILED = "Failed"
TERMINAL = (SUCCEEDED, FAILED)


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
    terminal: tuple[str, str, str] | None = None,
) -> list[dict[str, Any]]:
    """The three conditions, Suspended once there was one, and the terminal one once the job
    ended; each tuple is (status, reason, message), absent means False. `terminal` is (SUCCEEDED
    or FAILED, reason, message), its status True: a job ends once, so a terminal condition
    already True is kept as it was (its time too), whatever `terminal` says."""
    if terminal is not None and terminal[0] not in TERMINAL:
        raise ValueError(f"terminal: {terminal[0]!r} is not one of {TERMINAL}")
    before = {c.get("type"): c for c in previous or []}
    out = []
    kinds = [(READY, ready), (RECONCILING, reconciling), (STALLED, stalled)]
    if suspended is not None or SUSPENDED in before:
        kinds.append((SUSPENDED, suspended if suspended is not None else (False, "Resumed", "")))
    ended = next((kind for kind in TERMINAL if (before.get(kind) or {}).get("status") == "True"), None)
    if ended is not None:
        kinds.append((ended, (True, before[ended].get("reason", ""), before[ended].get("message", ""))))
    elif terminal is not None:
        kinds.append((terminal[0], (True, terminal[1], terminal[2])))
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


def late_terminal(status: Mapping[str, Any], generation: int | None) -> list[dict[str, Any]] | None:
    """The conditions of a job that finished before its operator wrote terminal conditions: the
    terminal one from status.phase, Ready False with its reason, the others as they were. None when
    there is nothing to add (not finished, or a terminal condition already True), so that a
    finished job's status is written once and then never again."""
    phase = status.get("phase")
    previous = status.get("conditions") or []
    if phase not in TERMINAL or any(is_true(previous, kind) for kind in TERMINAL):
        return None
    before = {c.get("type"): c for c in previous}
    ready = before.get(READY) or {}
    message = ready.get("message") or status.get("message") or ""
    if phase == SUCCEEDED:
        reason = SUCCEEDED
    else:  # the failure's reason, as the operator that failed it wrote it on Ready
        reason = (ready.get("status") == "False" and ready.get("reason")) or FAILED

    def kept(kind: str) -> tuple[bool, str, str] | None:
        c = before.get(kind)
        return None if c is None else (c.get("status") == "True", c.get("reason", ""), c.get("message", ""))

    return build_conditions(previous, generation, ready=(False, reason, message),
                            reconciling=kept(RECONCILING), stalled=kept(STALLED), suspended=kept(SUSPENDED),
                            terminal=(phase, reason, message))


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
