"""The checks that only the operator can make, because they span fields or other objects.

The CRD's OpenAPI schema catches a wrong type or range at `kubectl apply`; it cannot say that
globalBatch must be a multiple of microBatch, or that the virtual cluster must admit the job's
namespace. A job that fails here is Stalled (it cannot progress until a person edits it) with a
message that names the field and the fix, and nothing is created for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huorn.api import kinds, manifests


class InvalidSpec(ValueError):
    """A spec the operator refuses; the message names the field and how to fix it."""


def load_job(body: Mapping[str, Any]) -> kinds.Resource:
    """The validated resource, through the API's own loader (the rules the CRD's CEL holds, with
    the same messages as `huorn validate`); InvalidSpec naming every field at fault otherwise.

    Only apiVersion, kind, spec and the user's metadata are judged: the server's bookkeeping
    (resourceVersion, managedFields, kopf's progress in status) is not the user's input.
    """
    manifest = {k: body[k] for k in ("apiVersion", "kind", "spec") if k in body}
    manifest["metadata"] = {
        k: v
        for k, v in (body.get("metadata") or {}).items()
        if k in ("name", "namespace", "labels", "annotations", "generation", "uid")
    }
    try:
        return manifests.load_manifest(manifest)
    except manifests.ManifestError as exc:
        raise InvalidSpec("; ".join(str(error) for error in exc.errors)) from None


def check_namespace(namespace: str, vc_name: str, vc_spec: Mapping[str, Any]) -> None:
    allowed = vc_spec.get("namespaces") or []
    if allowed and namespace not in allowed:
        raise InvalidSpec(
            f"spec.virtualCluster: virtual cluster {vc_name!r} admits namespaces {allowed}, "
            f"not {namespace!r}; "
            "use another virtual cluster or add the namespace to its spec.namespaces"
        )
