"""RLJob: accepted and validated now, placed once the operator runs it (its runtime, the RL
controller over Ray, runs on one machine already: `huorn run`). InferenceJobs are run by
huorn.operator.serving.

A user who applies one should learn at once whether the spec is right, and then that it waits
for a runtime rather than for GPUs. So the operator validates the spec like any other
(pydantic plus the graph compiler, which checks roles and edges) and reports Stalled with reason
RuntimeNotAvailable: kstatus readers stop waiting, and nothing is created.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huorn.graph import compiler
from huorn.operator import conditions, validation
from huorn.operator.context import Context

PLURALS = {"RLJob": "rljobs"}


async def reconcile(ctx: Context, body: Mapping[str, Any]) -> str:
    meta = body["metadata"]
    kind = body["kind"]
    old = body.get("status") or {}
    try:
        job = validation.load_job(body)
        graph = compiler.compile(job)
        reason = "RuntimeNotAvailable"
        message = (
            f"{kind} spec is valid ({len(graph.vertices)} vertices); the operator does not run this "
            "kind in this Huorn version, so nothing is scheduled"
            + " (an RLJob runs on one machine: huorn run, or python -m huorn.runtime.rl.controller)"
        )
        kind_event = "Normal"
    except (validation.InvalidSpec, ValueError) as exc:
        reason, message, kind_event = "InvalidSpec", str(exc), "Warning"
    if old.get("message") != message:
        ctx.post_event(body, kind_event, reason, message)
    status = {
        "phase": "Stalled",
        "observedGeneration": meta.get("generation"),
        "message": message,
        "replicas": 0,
        "conditions": conditions.build_conditions(
            old.get("conditions"),
            meta.get("generation"),
            ready=(False, reason, message),
            stalled=(True, reason, message),
        ),
    }
    if conditions.strip_times({**old, **status}) != conditions.strip_times(old):
        await ctx.client.patch_status(PLURALS[kind], meta["namespace"], meta["name"], status)
    ctx.metrics.record_phase(kind, f"{meta['namespace']}/{meta['name']}", "Stalled")
    return "Stalled"
