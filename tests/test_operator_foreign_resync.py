"""The paginated list of every pod (the operator's start-up list)."""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes
import pytest
from kube import builders
from kube.cluster import EmulatedCluster

from huorn.backends.kubernetes import client as client_mod

pytest_plugins = ["kube.fixtures"]

NS = "team"


def _pod(name: str, node: str, gpus: int, phase: str = "Running", ns: str = NS) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name, "labels": {"app": "kueue"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {
            "requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}}]},
        "status": {"phase": phase},
    }


class _PagingCore:
    """A CoreV1Api stand-in that answers two objects a page, with a continue token between."""

    def __init__(self, total: int) -> None:
        self.items = [_pod(f"p{i}", "a0", 1) for i in range(total)]
        self.calls: list[dict[str, Any]] = []

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> dict[str, Any]:
        self.calls.append(kwargs)
        start = int(kwargs.get("_continue") or 0)
        end = start + int(kwargs.get("limit") or len(self.items))
        token = str(end) if end < len(self.items) else None
        return {"metadata": {"continue": token}, "items": self.items[start:end]}


def test_list_pages_through_every_item() -> None:
    kube = client_mod.KubeClient(kubernetes.client.ApiClient())
    core = kube.core = _PagingCore(5)  # type: ignore[assignment]
    pods = asyncio.run(kube.list("Pod", None, {}, page_size=2))
    assert [p["metadata"]["name"] for p in pods] == [f"p{i}" for i in range(5)]
    assert [c.get("_continue") for c in core.calls] == [None, "2", "4"]
    assert {c["limit"] for c in core.calls} == {2}
    # A caller that asks for no page size gets one request, without `limit`, as before.
    core.calls.clear()
    assert len(asyncio.run(kube.list("Pod", None, {}))) == 5
    assert len(core.calls) == 1 and "limit" not in core.calls[0] and "_continue" not in core.calls[0]
    with pytest.raises(ValueError, match="page_size must be a positive"):
        asyncio.run(kube.list("Pod", None, {}, page_size=0))


def test_list_ends_when_the_server_ignores_limit(cluster: EmulatedCluster) -> None:
    """KMock answers every object at once with no continue token: the loop must still end."""
    k = builders.Kube(cluster.api_client())
    k.create_node(builders.make_node("a0", 4, pool="a"))
    for i in range(3):
        k.core.create_namespaced_pod(NS, _pod(f"p{i}", "a0", 1))
    kube = client_mod.KubeClient(cluster.api_client())
    pods = asyncio.run(kube.list("Pod", None, {}, page_size=1))
    assert sorted(p["metadata"]["name"] for p in pods) == ["p0", "p1", "p2"]

