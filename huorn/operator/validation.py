"""The checks that only the operator can make, because they span fields or other objects.

The CRD's OpenAPI schema catches a wrong type or range at `kubectl apply`; it cannot say that
globalBatch must be a multiple of microBatch, or that the virtual cluster must admit the job's
namespace. A job that fails here is Stalled (it cannot progress until a person edits it) with a
message that names the field and the fix, and nothing is created for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from huorn.api import kinds, manifests, rl, training
from huorn.api.common import Checkpoint


class InvalidSpec(ValueError):
    """A spec the operator refuses; the message names the field and how to fix it."""


# Fields the CRDs before 2026-12-06 gave (and defaulted into) kinds that never read them. The
# API server prunes them from stored objects once the new CRDs are applied; an operator upgraded
# first (Helm never upgrades CRDs) would otherwise Stall every stored InferenceJob (its CRD wrote
# `priority: 50` into each) and RLJob as InvalidSpec.
RETIRED_FIELDS = {"InferenceJob": ("priority", "elasticity", "remediation"), "RLJob": ("elasticity",)}


def load_job(body: Mapping[str, Any]) -> kinds.Resource:
    """The validated resource, through the API's own loader (the rules the CRD's CEL holds, with
    the same messages as `huorn validate`); InvalidSpec naming every field at fault otherwise.

    Only apiVersion, kind, spec and the user's metadata are judged: the server's bookkeeping
    (resourceVersion, managedFields, kopf's progress in status) is not the user's input.
    """
    manifest = {k: body[k] for k in ("apiVersion", "kind", "spec") if k in body}
    retired = RETIRED_FIELDS.get(str(body.get("kind")), ())
    if retired and isinstance(manifest.get("spec"), Mapping):
        manifest["spec"] = {k: v for k, v in manifest["spec"].items() if k not in retired}
    manifest["metadata"] = {
        k: v
        for k, v in (body.get("metadata") or {}).items()
        if k in ("name", "namespace", "labels", "annotations", "generation", "uid")
    }
    try:
        return manifests.load_manifest(manifest)
    except manifests.ManifestError as exc:
        raise InvalidSpec("; ".join(str(error) for error in exc.errors)) from None


def load_job_on_cluster(body: Mapping[str, Any],
                        vcs: Mapping[str, Mapping[str, Any]]) -> tuple[Any, Mapping[str, Any] | None]:
    """The validated job and its virtual cluster's spec (None while the cluster does not exist,
    which is a wait, not an error); InvalidSpec if the job is invalid or its namespace is not
    one the cluster admits."""
    job: Any = load_job(body)
    vc_spec = vcs.get(job.spec.virtual_cluster)
    if vc_spec is not None:
        check_namespace(body["metadata"]["namespace"], job.spec.virtual_cluster, vc_spec)
    return job, vc_spec


def check_namespace(namespace: str, vc_name: str, vc_spec: Mapping[str, Any]) -> None:
    allowed = vc_spec.get("namespaces") or []
    if allowed and namespace not in allowed:
        raise InvalidSpec(
            f"spec.virtualCluster: virtual cluster {vc_name!r} admits namespaces {allowed}, "
            f"not {namespace!r}; "
            "use another virtual cluster or add the namespace to its spec.namespaces"
        )


def check_spec_alone(job: kinds.Resource) -> None:
    """Every check the operator makes of a job's spec alone, before it looks at the cluster.
    `huorn validate` runs them too: it had called specs ok that the operator then Stalled as
    InvalidSpec (a teacher off the checkpoint volume, a role larger than its Ray worker pod)."""
    if isinstance(job, kinds.TrainingJob):
        check_mounted_paths(job.spec)
        if (problem := training.gpu_pipeline_problem(job.spec)) is not None:
            raise InvalidSpec(problem)
    elif isinstance(job, kinds.RLJob):
        check_on_volume(job.spec.checkpoint, [("spec.initCheckpoint", job.spec.init_checkpoint)])
        try:
            rl.ray_layout(job.spec)
        except ValueError as exc:
            raise InvalidSpec(str(exc)) from None
        if (problem := rl.reference_for_kl_problem(job.spec)) is not None:
            raise InvalidSpec(problem)
    elif isinstance(job, kinds.InferenceJob):
        check_on_volume(job.spec.checkpoint, [("spec.model.checkpoint", job.spec.model.checkpoint)])


def check_mounted_paths(spec: training.TrainingJobSpec) -> None:
    """Checkpoints a trainer pod must read (a distillation teacher, cpt's starting weights) lie on
    the job's checkpoint volume, the only persistent storage its pods mount.

    Without a volume the pods mount nothing persistent, so the path can only be in the image and
    is left for the trainer to judge. With one, a path outside spec.checkpoint.path would fail in
    every pod only after the gang was placed and the images pulled: refused here instead.
    """
    reads = [("spec.task.initCheckpoint", spec.task.init_checkpoint)]
    if spec.task.teacher is not None:
        reads.append(("spec.task.teacher.checkpoint", spec.task.teacher.checkpoint))
    check_on_volume(spec.checkpoint, reads)


def check_on_volume(checkpoint: Checkpoint, reads: list[tuple[str, str | None]]) -> None:
    """Each (field, path) read by a pod lies under the checkpoint volume's mount, when there is one."""
    if not checkpoint.volume:
        return
    root = PurePosixPath(checkpoint.path)
    for field, location in reads:
        if location is None:
            continue
        path = PurePosixPath(location)
        if not path.is_absolute() or ".." in path.parts or not path.is_relative_to(root):
            raise InvalidSpec(
                f"{field}: {location!r} is not on the checkpoint volume {checkpoint.volume!r}, "
                f"which pods mount at spec.checkpoint.path {str(root)!r}; copy the checkpoint onto "
                f"that volume and give its absolute path under {str(root)!r}"
            )
