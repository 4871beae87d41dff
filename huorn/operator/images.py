"""Which image a job's pods run, and why it never changes under a running job by itself.

A job that names no `spec.image` runs the operator's job image (`--job-image`; the Helm chart
passes its own `image.repository:tag` with the CUDA build's `jobImageSuffix` unless `jobImage` says
otherwise), so a platform team that mirrors the operator's images into a private registry has its
jobs pulled from there too. Before,
the CRD defaulted the field to the public registry's image: every job in an air-gapped cluster
sat in ImagePullBackOff until each manifest named the mirror.

The image a job resolved to is pinned in `status.image` before any of its pods is created, and a
job without `spec.image` keeps it for its life. An operator upgrade (a new chart tag) therefore
starts new jobs on the new image and leaves running gangs alone: a replacement pod of a running
gang on a newer runtime than its peers would rendezvous with code it was never tested against.
Setting `spec.image` moves a job on purpose, as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huorn.api import common
from huorn.operator.context import Context

TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})


def resolve(body: Mapping[str, Any], job_image: str) -> str:
    """The image the job's pods run: its spec's, else the one pinned at its first reconcile,
    else the operator's job image."""
    named = (body.get("spec") or {}).get("image")
    if named is not None:  # "" too: validation refuses it, naming the field
        return str(named)
    status = body.get("status") or {}
    if status.get("image"):
        return str(status["image"])
    if status.get("graph"):
        # Placed by an operator from before pinning (a job created between the new CRDs and the
        # new operator, which the docs order): it ran that operator's default, which it keeps.
        return common.DEFAULT_IMAGE
    return job_image


async def pin(ctx: Context, plural: str, body: Mapping[str, Any]) -> Mapping[str, Any]:
    """The body a reconcile works from: `spec.image` filled in with the resolved image, which
    `status.image` records first. Every reconcile starts here (the monitor's and a preemption's
    too), so no path builds a pod, or compares the spec in force, without it.

    A finished job is left as it is: its pods are gone, and an upgrade should not write to every
    job the cluster still keeps."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    image = resolve(body, ctx.settings.job_image)
    if status.get("image") != image and status.get("phase") not in TERMINAL_PHASES:
        meta = body["metadata"]
        # a job deleted meanwhile (None) is left to the writes after this one, which see it too
        await ctx.client.patch_status(plural, meta["namespace"], meta["name"], {"image": image})
    return {**body, "spec": {**spec, "image": image}, "status": {**status, "image": image}}
