"""The checks that only the operator can make, because they span fields or other objects.

The CRD's OpenAPI schema catches a wrong type or range at `kubectl apply`; it cannot say that
globalBatch must be a multiple of microBatch, or that the virtual cluster must admit the job's
namespace. A job that fails here is Stalled (it cannot progress until a person edits it) with a
message that names the field and the fix, and nothing is created for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import pydantic

from huorn.api import kinds


class InvalidSpec(ValueError):
    """A spec the operator refuses; the message names the field and how to fix it."""


def _location(error: Mapping[str, Any]) -> str:
    parts = [str(p) for p in error.get("loc", ()) if not str(p).startswith("function-")]
    return ".".join(parts)


def load_job(body: Mapping[str, Any]) -> Any:
    """The validated resource model; InvalidSpec with the first error's field path otherwise."""
    kind = body.get("kind", "")
    model = kinds.RESOURCE_MODELS.get(kind)
    if model is None:
        raise InvalidSpec(f"kind {kind!r} is not a Huorn kind")
    manifest = {k: body[k] for k in ("apiVersion", "kind", "spec") if k in body}
    manifest["metadata"] = {
        k: v
        for k, v in (body.get("metadata") or {}).items()
        if k in ("name", "namespace", "labels", "annotations", "generation", "uid")
    }
    try:
        return model.model_validate(manifest)
    except pydantic.ValidationError as exc:
        first = exc.errors()[0]
        where = _location(first) or "spec"
        message = str(first.get("msg", "invalid")).removeprefix("Value error, ")
        # A model-level validator names its field at the start of the message ("optimization.
        # globalBatch: ..."): join it to the location so the path reads whole.
        match = re.match(r"^([A-Za-z][\w.]*): ", message)
        if match:
            return_path = f"{where}.{match.group(1)}"
            raise InvalidSpec(f"{return_path}: {message[match.end():]}") from None
        raise InvalidSpec(f"{where}: {message}") from None


def check_training(job: Any) -> None:
    """Cross-field rules of a TrainingJob that the runtime would otherwise hit at step 0."""
    spec = job.spec
    el = spec.elasticity
    if el.min_replicas > el.max_replicas:
        raise InvalidSpec(
            f"spec.elasticity.minReplicas ({el.min_replicas}) exceeds spec.elasticity.maxReplicas "
            f"({el.max_replicas}); raise maxReplicas or lower minReplicas"
        )
    opt = spec.optimization
    if opt.global_batch % opt.micro_batch:
        raise InvalidSpec(
            f"spec.optimization.globalBatch ({opt.global_batch}) must be a multiple of "
            f"spec.optimization.microBatch ({opt.micro_batch}); change one of them"
        )
    if opt.steps is None and opt.tokens is None:
        raise InvalidSpec("spec.optimization.steps: set steps or tokens so the trainer knows when to stop")
    if spec.task.kind.value == "distill" and spec.task.teacher is None:
        raise InvalidSpec("spec.task.teacher: a distill task needs a teacher checkpoint")
    if spec.model.width % spec.model.heads:
        raise InvalidSpec(
            f"spec.model.width ({spec.model.width}) must be a multiple of "
            f"spec.model.heads ({spec.model.heads})"
        )
    if spec.model.kv_heads is not None and spec.model.heads % spec.model.kv_heads:
        raise InvalidSpec(
            f"spec.model.kvHeads ({spec.model.kv_heads}) must divide spec.model.heads ({spec.model.heads})"
        )


def check_namespace(namespace: str, vc_name: str, vc_spec: Mapping[str, Any]) -> None:
    allowed = vc_spec.get("namespaces") or []
    if allowed and namespace not in allowed:
        raise InvalidSpec(
            f"spec.virtualCluster: virtual cluster {vc_name!r} admits namespaces {allowed}, "
            f"not {namespace!r}; "
            "use another virtual cluster or add the namespace to its spec.namespaces"
        )
