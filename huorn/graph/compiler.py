"""`compile(resource)`: turn a custom resource into its execution graph, through a registry.

Each job kind registers one compiler, so the operator, the CLI and the local backend share a
single entry point and a new kind (or a plug-in's variant of one) touches no caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from huorn.api import base, common, kinds
from huorn.graph.model import Graph, ResourceRequest

Compiler = Callable[[Any], Graph]

_COMPILERS: dict[str, Compiler] = {}


def register(kind: str) -> Callable[[Compiler], Compiler]:
    """Register the compiler of one resource kind (a decorator); the last registration wins."""

    def decorate(fn: Compiler) -> Compiler:
        _COMPILERS[kind] = fn
        return fn

    return decorate


def registered_kinds() -> list[str]:
    return sorted(_COMPILERS)


def compile(resource: BaseModel | dict) -> Graph:
    """Compile a resource (a model from huorn.api.kinds, or a manifest dict) into a new graph."""
    if isinstance(resource, dict):
        resource = load_resource(resource)
    kind = getattr(resource, "kind", type(resource).__name__)
    try:
        compiler = _COMPILERS[kind]
    except KeyError:
        raise ValueError(
            f"kind {kind!r} has no graph compiler; compilable kinds: {registered_kinds()}"
        ) from None
    return compiler(resource)


def load_resource(manifest: dict) -> BaseModel:
    """Validate a manifest dict into its resource model; pydantic's error names the field."""
    kind = manifest.get("kind")
    model = kinds.RESOURCE_MODELS.get(str(kind))
    if model is None:
        raise ValueError(f"kind: {kind!r} is not a Huorn kind; use one of {sorted(kinds.RESOURCE_MODELS)}")
    return model.model_validate(manifest)


def build_request(resources: common.Resources) -> ResourceRequest:
    return ResourceRequest(
        gpus=resources.gpus,
        cpu=base.parse_quantity(resources.cpu),
        memory=base.parse_quantity(resources.memory),
    )


def resource_name(resource: BaseModel) -> str:
    metadata = getattr(resource, "metadata", None)
    return (metadata.name if metadata is not None else None) or "job"
