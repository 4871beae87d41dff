"""KMock's Kubernetes emulator with the gaps that a kopf operator hits filled in.

KMock 0.8 stores objects as plain JSON and leaves out what an API server adds on its own. Each
override below closes one gap measured in /work/shared/notes/kubernetes-testing.md; without
them kopf's finalizer patches never settle, Events fail with 500 and namespaced watches drop
objects. The scale subresource is emulated the way the API server does it for a CRD, from the
kind's scale paths in huorn.api.kinds, so that `kubectl scale` has a test double.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
from kmock._internal import dicts, dsl, enums

from huorn.api import base, kinds

_CORE_RESOURCES = {
    "pods": ("Pod", True),
    "services": ("Service", True),
    "configmaps": ("ConfigMap", True),
    "events": ("Event", True),
    "nodes": ("Node", False),
    "persistentvolumeclaims": ("PersistentVolumeClaim", True),
}
_VERBS = {"get", "list", "watch", "create", "patch", "delete"}


def _plain_chain_contains(view: dsl.View, request: kmock.Request) -> bool | None:
    """Whether `request` is in `view`, answered without replaying the request log, or None when
    the chain holds a node (a slice, a group, an exclusion) that needs the log's order.

    KMock decides which reaction serves a request by asking each reaction's source `request in
    view`, and `View.__contains__` answers by iterating every request recorded so far through
    every filter. With the fifteen fallback reactions that makes each request cost O(requests so
    far), and a test minutes long quadratic: py-spy put 50 % of `tests/test_operator_lifecycle.py`'s
    CPU there. A chain of plain filters and priorities on a root has the same answer as the
    replay: the request is one the root recorded, and every filter's criteria accept it.
    """
    node: dsl.View = view
    criteria = []
    while not isinstance(node, dsl.Root):
        if type(node) is dsl.Filter:
            criteria.append(node.criteria)
        elif type(node) is not dsl.Priority:
            return None
        node = node._source
    recorded = node._requests
    if not any(r is request for r in reversed(recorded)):  # the newest, as a rule
        return False
    return all(check(request) for check in reversed(criteria))


_replayed_contains = dsl.View.__contains__


def _contains(self: dsl.View, item: Any) -> bool:
    if isinstance(item, kmock.Request):
        answer = _plain_chain_contains(self, item)
        if answer is not None:
            return answer
    return _replayed_contains(self, item)


dsl.View.__contains__ = _contains  # type: ignore[method-assign]


def _now() -> str:
    return datetime.datetime.now(tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _get_path(obj: dict, json_path: str) -> Any:
    node: Any = obj
    for part in json_path.strip(".").split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _nest(json_path: str, value: Any) -> dict:
    """{'spec': {'elasticity': {'minReplicas': value}}} from '.spec.elasticity.minReplicas'."""
    result: Any = value
    for part in reversed(json_path.strip(".").split(".")):
        result = {part: result}
    return result


def _rewrite(request: kmock.Request, **changes: Any) -> kmock.Request:
    """Change a recorded request in place.

    NOTE: KMock finds the reactions of a request by identity among the requests it recorded, so
    an `attrs.evolve` copy matches no reaction (not even the fallbacks); the frozen instance has
    to be edited instead.
    """
    for name, value in changes.items():
        object.__setattr__(request, name, value)
    return request


@attrs.define(kw_only=True)
class HuornEmulator(kmock.KubernetesEmulator):
    """An API emulator that behaves like a real server for what Huorn's operator relies on."""

    _versions: itertools.count = attrs.field(factory=lambda: itertools.count(1), init=False)
    _last_version: int = attrs.field(default=0, init=False)

    def _next_version(self) -> str:
        self._last_version = next(self._versions)
        return str(self._last_version)

    def declare_resources(self) -> None:
        """Serve Huorn's kinds and the core kinds; posting a CRD to KMock does not serve it."""
        for kind in kinds.KINDS.values():
            subresources = {"status"} | ({"scale"} if kind.scale_spec_path else set())
            self.resources[kmock.resource(kind.group, kind.version, kind.plural)] = kmock.ResourceInfo(
                kind=kind.kind,
                singular=kind.singular,
                namespaced=kind.scope == "Namespaced",
                verbs=_VERBS,
                shortnames=set(kind.short_names),
                subresources=subresources,
            )
        for plural, (kind_name, namespaced) in _CORE_RESOURCES.items():
            self.resources[kmock.resource("", "v1", plural)] = kmock.ResourceInfo(
                kind=kind_name,
                singular=kind_name.lower(),
                namespaced=namespaced,
                verbs=_VERBS,
            )
        self.resources[kmock.resource("kopf.dev", "v1", "clusterkopfpeerings")] = kmock.ResourceInfo(
            kind="ClusterKopfPeering", singular="clusterkopfpeering", namespaced=False, verbs=_VERBS,
        )
        # kopf's observers wait until discovery lists namespaces and CRDs, even when clusterwide.
        self.resources[kmock.resource("", "v1", "namespaces")] = kmock.ResourceInfo(
            kind="Namespace",
            singular="namespace",
            namespaced=False,
            verbs=_VERBS,
        )
        self.resources[kmock.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")] = (
            kmock.ResourceInfo(
                kind="CustomResourceDefinition",
                singular="customresourcedefinition",
                namespaced=False,
                verbs=_VERBS,
            )
        )

    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await super()._handle(request)
        try:
            if request.subresource == "scale":
                return await self._handle_scale(request)
            if request.action == enums.action.CREATE:
                request = self._stamp_create(request)
                response = await super()._handle(request)
                if response.status == 200 and not response.prepared:
                    response.set_status(201)
                return response
            if request.action == enums.action.UPDATE and request.name is not None:
                request = self._stamp_update(request)
        except jsonpatch.JsonPatchTestFailed as exc:
            # kopf retries a failed optimistic patch only on 422, as a real server answers.
            return await self._render_error(
                kmock.KubernetesError(status=422, reason="Invalid", message=str(exc))
            )
        return await super()._handle(request)

    def _stamp_create(self, request: kmock.Request) -> kmock.Request:
        data = copy.deepcopy(request.data) if isinstance(request.data, dict) else {}
        meta = data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["resourceVersion"] = self._next_version()
        if request.resource is not None and request.resource.group == base.GROUP:
            meta["generation"] = 1
        return _rewrite(request, data=data)

    def _stamp_update(self, request: kmock.Request) -> kmock.Request:
        """Add resourceVersion and, when the spec changes, bump metadata.generation."""
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return request
        current = dict(self.objects[key].raw)
        version = self._next_version()
        patched = dicts.patch_dict(current, request.data or {})
        bump = (
            request.subresource != "status"
            and request.resource is not None
            and request.resource.group == base.GROUP
            and patched.get("spec") != current.get("spec")
        )
        generation = int(current.get("metadata", {}).get("generation", 1)) + (1 if bump else 0)
        if isinstance(request.data, list):
            ops = [*request.data, {"op": "add", "path": "/metadata/resourceVersion", "value": version}]
            if bump:
                ops.append({"op": "add", "path": "/metadata/generation", "value": generation})
            return _rewrite(request, data=ops)
        data = copy.deepcopy(request.data or {})
        data.setdefault("metadata", {})["resourceVersion"] = version
        if bump:
            data["metadata"]["generation"] = generation
        return _rewrite(request, data=data)

    async def _serve_list(self, request: kmock.Request) -> Any:
        """A list carries the version it was taken at (KMock answers '...'), for the watch after it."""
        taken = self._last_version  # before the objects: a change racing the list is replayed, not lost
        payload = await super()._serve_list(request)
        payload["metadata"]["resourceVersion"] = str(taken)
        return payload

    async def _serve_watch(self, request: kmock.Request) -> AsyncIterator[Any]:
        """A watch from a list's resourceVersion does not replay what that list returned.

        KMock replays every object as ADDED. kopf then sees a new object twice at one version:
        its second finalizer patch fails its resourceVersion test (422), and it waits for a
        next event that already passed, so a job created while the operator starts sat until its
        resync. Live ADDED events always carry a newer version, so only replays are dropped.
        """
        since = request.params.get("resourceVersion", "")
        floor = int(since) if since.isdigit() else 0
        async for event in super()._serve_watch(request):
            if floor and isinstance(event, dict) and event.get("type") == "ADDED":
                version = str(event["object"].get("metadata", {}).get("resourceVersion", ""))
                if version.isdigit() and int(version) <= floor:
                    continue
            yield event

    async def _handle_scale(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """The autoscaling/v1 Scale view of a custom resource, mapped by the CRD's scale paths."""
        kind = next((k for k in kinds.KINDS.values() if k.plural == request.resource.plural), None)
        key = (request.resource, request.namespace, request.name)
        if (
            kind is None
            or kind.scale_spec_path is None
            or key not in self.objects
            or self.objects[key].deleted
        ):
            return await self._render_error(kmock.KubernetesObjectNotFoundError())
        if request.action == enums.action.UPDATE:
            replicas = (request.data or {}).get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return await self._render_error(
                    kmock.KubernetesError(
                        status=422, reason="Invalid", message="spec.replicas must be a non-negative integer"
                    )
                )
            inner = _rewrite(request, subresource=None, data=_nest(kind.scale_spec_path, replicas))
            await super()._handle(self._stamp_update(inner))
        obj = dict(self.objects[key].raw)
        scale = {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {
                k: v
                for k, v in obj["metadata"].items()
                if k in ("name", "namespace", "uid", "resourceVersion")
            },
            "spec": {"replicas": _get_path(obj, kind.scale_spec_path) or 0},
            "status": {
                "replicas": _get_path(obj, kind.scale_status_path or ".status.replicas") or 0,
                "selector": _get_path(obj, ".status.selector") or "",
            },
        }
        return aiohttp.web.json_response(scale)
