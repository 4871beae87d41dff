"""One name per namespace across Huorn's job kinds.

Every kind names its children after the job (`<job>-config`, `<job>-trainer-0`, `<job>-rdzv`,
...), labels them `huorn.io/job: <job>`, and keys its locks, its place in line and its mirror
lookups by (namespace, name). A TrainingJob `llama` and an InferenceJob `llama` in one namespace
would therefore overwrite each other's ConfigMap and delete each other's pods as strays. The
newer of two such jobs is refused at its first reconcile, before it creates anything, with a
message that names the field and the fix; the older one never notices. Once the older one is
deleted, the newer one starts at its next reconcile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huorn.api import kinds
from huorn.operator import images
from huorn.operator.context import Context
from huorn.operator.index import parse_time

REASON = "NameTaken"


def _seniority(body: Mapping[str, Any]) -> tuple[float, int]:
    """Older first; two created in the same second go by kind, so both see the same order."""
    order = [k.kind for k in kinds.JOB_KINDS]
    return parse_time((body.get("metadata") or {}).get("creationTimestamp")), order.index(body["kind"])


async def older_namesake(ctx: Context, body: Mapping[str, Any]) -> str | None:
    """Why this job may not run while an older job of another kind has its name, or None.

    Asked only until the job is first admitted (status.image pinned): after that it owns its
    children, and a namesake created later is the one refused."""
    status = body.get("status") or {}
    if status.get("image") or status.get("phase") in images.TERMINAL_PHASES:  # finished: ran already
        return None
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    for other_kind in kinds.JOB_KINDS:
        if other_kind.kind == body["kind"]:
            continue
        other = await ctx.client.get_custom(other_kind.plural, namespace, name)
        if other is None or (other.get("metadata") or {}).get("uid") == meta.get("uid"):
            continue
        # One already admitted owns the name, whatever the times (two created in one second
        # could otherwise each pass: the first before the second existed, the second by kind
        # order); between two not yet admitted, the older goes first.
        admitted = bool((other.get("status") or {}).get("image"))
        if admitted or _seniority(other) < _seniority(body):
            return (f"metadata.name {name!r} is taken in namespace {namespace!r} by the "
                    f"{other_kind.kind} {name}: every Huorn job kind names its pods, Services and "
                    f"ConfigMap after the job, so two kinds cannot share a name; create this "
                    f"{body['kind']} again under another name, or delete the {other_kind.kind} (this "
                    "one starts once it is gone)")
    return None


def owns(body: Mapping[str, Any], child: Mapping[str, Any]) -> bool:
    """Whether a child found by the job's label is this job's: a namesake's children carry the
    same label, and a child without owner references predates them."""
    refs = (child.get("metadata") or {}).get("ownerReferences") or []
    uid = (body.get("metadata") or {}).get("uid")
    return not refs or any(ref.get("uid") == uid for ref in refs)


def refused(body: Mapping[str, Any]) -> bool:
    """Whether the job is held back by an older namesake: it made nothing, and whatever the
    operator keeps under its (namespace, name) is the namesake's."""
    status = body.get("status") or {}
    return not status.get("image") and any(
        c.get("reason") == REASON for c in status.get("conditions") or [])
