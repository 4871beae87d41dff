"""Idempotent writes through the official kubernetes client: create-or-patch, delete-if-present.

Every write may be repeated: the operator can die between any two calls and reconcile again, so
a create that meets 409 AlreadyExists patches instead, and a delete that meets 404 counts as
done. Pods are special: most of a pod's spec is immutable, so an existing pod gets only its
metadata patched, and a pod that must change is replaced by the caller under a new name (the
graph's instance generation). Label selectors are applied on the client side as well, which is
harmless against a real server and required by the KMock emulator, which ignores them.

The client is synchronous (urllib3); calls run in worker threads so that kopf's event loop
never blocks on the network.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes

from huorn.api import base
from huorn.backends.kubernetes import retry


@dataclass(frozen=True)
class CoreKind:
    plural: str
    namespaced: bool = True
    patchable: tuple[str, ...] = ("metadata",)


CORE_KINDS: dict[str, CoreKind] = {
    "Pod": CoreKind("pods", patchable=()),  # never patched: `apply` returns the existing one
    "Service": CoreKind("services", patchable=("metadata", "spec")),
    "ConfigMap": CoreKind("configmaps", patchable=("metadata", "data")),
    "Node": CoreKind("nodes", namespaced=False),
}


# (connect, read) seconds for one API call: a list of a large cluster's pods takes seconds, not a
# minute
REQUEST_TIMEOUT = (5.0, 60.0)
CORDON_ATTEMPTS = 5  # read-and-patch rounds a busy node's taint list may take


def build_api_client(
    kubeconfig: str | None = None, context: str | None = None
) -> kubernetes.client.ApiClient:
    """An ApiClient from a kubeconfig file, or from the pod's service account when there is none."""
    config = kubernetes.client.Configuration()
    if kubeconfig:
        kubernetes.config.load_kube_config(
            config_file=kubeconfig, context=context, client_configuration=config
        )
    else:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(context=context, client_configuration=config)
    # Reconciles run API calls from a thread pool; urllib3's default of 10 pooled connections
    # would open and drop a connection for every call beyond the tenth.
    config.connection_pool_maxsize = 32
    return kubernetes.client.ApiClient(config)


def match_labels(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


def selector_string(selector: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


class KubeClient:
    """The backend's only door to the API; every method is safe to repeat."""

    def __init__(self, api: kubernetes.client.ApiClient, policy: retry.RetryPolicy | None = None) -> None:
        self.api = api
        self.core = kubernetes.client.CoreV1Api(api)
        self.custom = kubernetes.client.CustomObjectsApi(api)
        self.policy = policy or retry.RetryPolicy()
        self.retries = 0  # how often a write was retried; the operator exports it as a metric

    async def _call(self, fn: Callable[..., Any], *args: Any, conflicts: bool = True, **kwargs: Any) -> Any:
        policy = (
            self.policy
            if conflicts
            else retry.RetryPolicy(
                self.policy.attempts, self.policy.base_delay, self.policy.max_delay, retry_conflicts=False
            )
        )

        def count(_exc: BaseException, _attempt: int) -> None:
            self.retries += 1

        # A half-open connection (an API server failed over) would block its thread, and the job
        # lock the reconcile holds, forever: every call has a deadline, and its timeout is retried.
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT)
        bound = functools.partial(fn, *args, **kwargs)
        return await retry.call_with_retry(lambda: asyncio.to_thread(bound), policy, on_retry=count)

    def _sanitize(self, obj: Any) -> Any:
        return self.api.sanitize_for_serialization(obj)

    # ------------------------------------------------------------------ core objects
    async def apply(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Create the object, or patch the mutable parts of the one that exists (a Pod that exists
        is returned unchanged)."""
        kind = CORE_KINDS[manifest["kind"]]
        ns = manifest["metadata"].get("namespace")
        name = manifest["metadata"]["name"]
        create = getattr(self.core, f"create_namespaced_{_snake(manifest['kind'])}")
        try:
            created = await self._call(create, ns, manifest, conflicts=False)
            return self._sanitize(created)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
        if manifest["kind"] == "Pod":
            # A pod cannot move, and its annotations say where it was placed and from which
            # template: the one that exists (a create retried after it landed, or one the mirror
            # had not seen yet) is returned as it is, so the mirror records its real node. Patched
            # with this manifest's metadata, it claimed the node this placement chose while running
            # on another, and every mirror counted its GPUs there.
            # (read by a list of that one name: the ClusterRole grants pods list, not get)
            found = await self._call(self.core.list_namespaced_pod, ns,
                                     field_selector=f"metadata.name={name}")
            live = [p for p in self._sanitize(found).get("items", []) if p["metadata"]["name"] == name]
            if not live:  # deleted since the 409: the next reconcile finds it missing
                raise kubernetes.client.ApiException(status=409, reason=f"pod {ns}/{name} existed, then went")
            return {"apiVersion": "v1", "kind": "Pod", **live[0]}
        patch_body = {k: manifest[k] for k in kind.patchable if k in manifest}
        if manifest["kind"] == "Service":
            # clusterIP is immutable once allocated; the headless "None" is set at create.
            patch_body["spec"] = {k: v for k, v in manifest["spec"].items() if k != "clusterIP"}
        patch = getattr(self.core, f"patch_namespaced_{_snake(manifest['kind'])}")
        return self._sanitize(await self._call(patch, name, ns, patch_body))

    async def create_event(self, involved: Mapping[str, Any], kind: str, reason: str, message: str,
                           component: str) -> None:
        """A core/v1 Event about `involved` (an object's body), as kopf.event writes one: for the
        code that runs outside a kopf handler, where kopf has no event queue to post to."""
        meta = involved.get("metadata") or {}
        namespace = meta.get("namespace") or "default"
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"namespace": namespace, "generateName": "huorn-event-"},
            "involvedObject": {"apiVersion": involved.get("apiVersion"), "kind": involved.get("kind"),
                               "name": meta.get("name"), "namespace": meta.get("namespace"),
                               "uid": meta.get("uid")},
            "type": kind, "reason": reason, "message": message[:1024],
            "source": {"component": component}, "reportingComponent": component,
            "firstTimestamp": now, "lastTimestamp": now, "eventTime": None, "count": 1,
        }
        await self._call(self.core.create_namespaced_event, namespace, event, conflicts=False)

    async def annotate(self, kind: str, namespace: str, name: str, annotations: Mapping[str, str]) -> bool:
        """Merge these annotations into the object's; False when it is gone."""
        fn = getattr(self.core, f"patch_namespaced_{_snake(kind)}")
        try:
            await self._call(fn, name, namespace, {"metadata": {"annotations": dict(annotations)}})
            return True
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> bool:
        """Delete if present; True when this call deleted it, False when it was already gone.

        `grace_seconds` is the pod's termination grace: SIGTERM now, SIGKILL after it, which is
        the time a trainer has to write its checkpoint when a lender reclaims its GPUs.
        """
        fn = getattr(self.core, f"delete_namespaced_{_snake(kind)}")
        extra = {} if grace_seconds is None else {"grace_period_seconds": int(grace_seconds)}
        try:
            await self._call(fn, name, namespace, **extra)
            return True
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def list(self, kind: str, namespace: str | None, labels: Mapping[str, str],
                   page_size: int | None = None,
                   keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Objects of `kind` whose labels match; None lists every namespace.

        `keep` reduces each object as its page arrives, to what the caller reads of it: paged
        but kept whole, a list of every pod still held every body at once until the caller was
        done with it (a 5 KiB pod in JSON is about 32 KiB of Python dicts: 625 MiB for 20,000).

        `page_size` asks the server for that many objects a response (`limit`, then `continue`
        until the server gives no token): a list of every pod of a large cluster in one response
        would be held whole, and its deserialised copy beside it, in the operator's memory.
        A server that ignores `limit` answers everything at once with no token, which ends it.
        A continue token the server no longer honours (410 Gone: etcd compacted past the list's
        resourceVersion, about 5 minutes on a default cluster) starts the list over in one
        response, as client-go's pager does (FullListIfExpired): pages already read may be
        stale by then, and a second paged pass could expire the same way.
        """
        if page_size is not None and page_size <= 0:
            raise ValueError(f"page_size must be a positive number of objects or None, got {page_size}")
        snake = _snake(kind)
        spec = CORE_KINDS[kind]
        selector = selector_string(labels)
        if not spec.namespaced:
            fn, args = getattr(self.core, f"list_{snake}"), ()
        elif namespace is None:
            fn, args = getattr(self.core, f"list_{snake}_for_all_namespaces"), ()
        else:
            fn, args = getattr(self.core, f"list_namespaced_{snake}"), (namespace,)
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            extra: dict[str, Any] = {} if page_size is None else {"limit": page_size}
            if token:
                extra["_continue"] = token
            try:
                page = self._sanitize(await self._call(fn, *args, label_selector=selector, **extra))
            except kubernetes.client.ApiException as exc:
                if exc.status != 410 or not token:
                    raise
                items, token, page_size = [], None, None
                continue
            matched = [i for i in page.get("items") or [] if match_labels(i, labels)]
            items += matched if keep is None else [keep(i) for i in matched]
            token = (page.get("metadata") or {}).get("continue") if page_size is not None else None
            if not token:
                return items

    async def cordon_node(self, name: str, taint: Mapping[str, str]) -> dict[str, Any] | None:
        """Mark a node unschedulable and taint it; None when the node is gone. Repeatable.

        The taint list is read and written whole (a merge patch replaces lists), so the patch
        carries the resourceVersion it read: a taint another controller added meanwhile (the node
        controller's unreachable, say) makes the server answer 409, and the read and the patch
        are done again, rather than the write erasing that taint.
        """
        for attempt in range(CORDON_ATTEMPTS):
            try:
                node = self._sanitize(await self._call(self.core.read_node, name))
                others = (node.get("spec") or {}).get("taints") or []
                taints = [t for t in others if t.get("key") != taint["key"]]
                body = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]},
                        "spec": {"unschedulable": True, "taints": [*taints, dict(taint)]}}
                return self._sanitize(await self._call(self.core.patch_node, name, body, conflicts=False))
            except kubernetes.client.ApiException as exc:
                if exc.status == 404:
                    return None
                if exc.status != 409 or attempt + 1 == CORDON_ATTEMPTS:
                    raise
        raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover

    async def get_peering(self, name: str) -> dict[str, Any] | None:
        """kopf's ClusterKopfPeering object (its status lists the peers), or None when absent."""
        try:
            return await self._call(self.custom.get_cluster_custom_object, "kopf.dev", "v1",
                                    "clusterkopfpeerings", name)
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    # ------------------------------------------------------------------ Huorn's own kinds
    async def get_custom(self, plural: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        try:
            if namespace is None:
                return await self._call(
                    self.custom.get_cluster_custom_object, base.GROUP, base.VERSION, plural, name
                )
            return await self._call(
                self.custom.get_namespaced_custom_object, base.GROUP, base.VERSION, namespace, plural, name
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    async def delete_custom(self, plural: str, namespace: str, name: str) -> bool:
        """Delete a namespaced Huorn object; True when this call deleted it, False when it was
        already gone. Its finalizer then lets the operator delete its children first."""
        try:
            await self._call(self.custom.delete_namespaced_custom_object, base.GROUP, base.VERSION,
                             namespace, plural, name)
            return True
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return False
            raise

    async def list_custom(self, plural: str, namespace: str | None) -> list[dict[str, Any]]:
        if namespace is None:
            result = await self._call(
                self.custom.list_cluster_custom_object, base.GROUP, base.VERSION, plural
            )
        else:
            result = await self._call(
                self.custom.list_namespaced_custom_object, base.GROUP, base.VERSION, namespace, plural
            )
        return list(result.get("items", []))

    async def patch_status(
        self, plural: str, namespace: str | None, name: str, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge-patch status; None when the object is gone (a deletion raced the reconcile)."""
        body = {"status": status}
        try:
            if namespace is None:
                return await self._call(
                    self.custom.patch_cluster_custom_object_status,
                    base.GROUP,
                    base.VERSION,
                    plural,
                    name,
                    body,
                )
            return await self._call(
                self.custom.patch_namespaced_custom_object_status,
                base.GROUP,
                base.VERSION,
                namespace,
                plural,
                name,
                body,
            )
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise


def _snake(kind: str) -> str:
    return {"Pod": "pod", "Service": "service", "ConfigMap": "config_map", "Node": "node"}[kind]
