"""Other controllers' GPUs after a missed deletion, and the paginated list of every pod.

A watch that reconnects does not report pods deleted while it was away: before, such a pod's GPUs
stayed counted as held (index.ClusterIndex.foreign) until the operator restarted. The operator
now lists every pod again every `foreign_resync_seconds` (handlers.resync_foreign), a page at a
time, as the start-up list does.
"""

from __future__ import annotations

import asyncio
from typing import Any

import kubernetes
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kube import builders
from kube.cluster import EmulatedCluster

from huorn.backends.kubernetes import client as client_mod
from huorn.backends.kubernetes import manifests
from huorn.operator import context, handlers, index

pytest_plugins = ["kube.fixtures"]

NS = "team"


def _pod(name: str, node: str, gpus: int, phase: str = "Running", ns: str = NS) -> dict[str, Any]:
    return {
        "metadata": {"namespace": ns, "name": name, "labels": {"app": "kueue"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {
            "requests": {"nvidia.com/gpu": str(gpus)}, "limits": {"nvidia.com/gpu": str(gpus)}}}]},
        "status": {"phase": phase},
    }


def test_resync_drops_a_pod_the_watch_missed_the_deletion_of() -> None:
    idx = index.ClusterIndex()
    idx.observe_foreign_pod(_pod("gone", "a0", 4))
    idx.observe_foreign_pod(_pod("stays", "a1", 2))
    mark = idx.observations
    # The list began at `mark`; "gone" was deleted while the watch was away, so it is absent.
    dropped = idx.resync_foreign([_pod("stays", "a1", 2), _pod("new", "a0", 1)], mark)
    assert dropped == [(NS, "gone")]
    assert idx.foreign == {(NS, "stays"): ("a1", 2), (NS, "new"): ("a0", 1)}
    assert idx.foreign_gpus() == {"a1": 2, "a0": 1}
    # A pod the list shows ended (its end missed too) gives its GPUs back as well.
    assert idx.resync_foreign([_pod("stays", "a1", 2, phase="Failed"), _pod("new", "a0", 1)],
                              idx.observations) == [(NS, "stays")]
    assert idx.foreign == {(NS, "new"): ("a0", 1)}


def test_resync_keeps_what_the_watch_wrote_after_the_list_began() -> None:
    idx = index.ClusterIndex()
    idx.observe_foreign_pod(_pod("old", "a0", 1))
    idx.observe_foreign_pod(_pod("ending", "a1", 2))
    mark = idx.observations
    # While the list ran: a pod was created (not in the list) and one the list shows running ended.
    idx.observe_foreign_pod(_pod("created", "a0", 3))
    idx.observe_foreign_pod(_pod("ending", "a1", 2), deleted=True)
    listed = [_pod("old", "a0", 1), _pod("ending", "a1", 2)]
    assert idx.resync_foreign(listed, mark) == []
    assert idx.foreign == {(NS, "old"): ("a0", 1), (NS, "created"): ("a0", 3)}
    # Only marks newer than the list are kept; the next list, which lacks "created", is newer.
    assert set(idx.foreign_seen) == {(NS, "created"), (NS, "ending")}
    assert idx.resync_foreign([_pod("old", "a0", 1)], idx.observations) == [(NS, "created")]
    assert idx.foreign_seen == {}


class _PagingClient:
    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = pods
        self.pages = 0

    async def list(self, kind: str, namespace: str | None, labels: Any,
                   page_size: int | None = None, keep: Any = None) -> list[dict[str, Any]]:
        assert (kind, namespace, dict(labels), page_size) == ("Pod", None, {}, handlers.LIST_PAGE)
        assert keep is index.slim_pod
        self.pages += 1
        return [keep(p) for p in self.pods]


@pytest.mark.looptime
async def test_periodic_resync_drops_the_missed_pod_and_wakes_the_line(looptime: Any) -> None:
    listing = _PagingClient([_pod("stays", "a1", 2), _pod("elsewhere", "a0", 8, ns="other")])
    ctx = context.Context(client=listing, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.serve_only([NS])
    woken: list[str | None] = []
    ctx.wake_line = lambda vc=None: woken.append(vc)  # type: ignore[method-assign]
    ctx.index.observe_foreign_pod(_pod("gone", "a0", 4))
    ctx.index.observe_foreign_pod(_pod("stays", "a1", 2))
    ctx.settings = context.OperatorSettings(foreign_resync_seconds=600.0)
    task = asyncio.create_task(handlers._resync_foreign_loop(ctx))
    while listing.pages < 2:
        await asyncio.sleep(1.0)
    task.cancel()
    assert float(looptime) == pytest.approx(1200.0), "one list each foreign_resync_seconds"
    # A namespace the install does not serve stays out, as its watch would keep it out.
    assert ctx.index.foreign == {(NS, "stays"): ("a1", 2)}
    assert woken == [None]  # the first round freed GPUs; the second found nothing to drop


def test_foreign_resync_seconds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="foreign_resync_seconds must be > 0, got 0"):
        context.OperatorSettings(foreign_resync_seconds=0)


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


class _ExpiringCore(_PagingCore):
    """Its first continue token has expired by the time it is used (410 Gone), once."""

    def __init__(self, total: int) -> None:
        super().__init__(total)
        self.expired = False

    def list_pod_for_all_namespaces(self, **kwargs: Any) -> dict[str, Any]:
        if kwargs.get("_continue") and not self.expired:
            self.expired = True
            self.calls.append(kwargs)
            raise kubernetes.client.ApiException(status=410, reason="Expired")
        return super().list_pod_for_all_namespaces(**kwargs)


def test_an_expired_continue_token_starts_the_list_over_in_one_response() -> None:
    """Before, the 410 went up to the caller: the operator's start-up listing failed, and a
    resync waited for its next period (ten minutes)."""
    kube = client_mod.KubeClient(kubernetes.client.ApiClient())
    core = kube.core = _ExpiringCore(5)  # type: ignore[assignment]
    pods = asyncio.run(kube.list("Pod", None, {}, page_size=2))
    assert [p["metadata"]["name"] for p in pods] == [f"p{i}" for i in range(5)]  # none twice
    assert [(c.get("limit"), c.get("_continue")) for c in core.calls] == [(2, None), (2, "2"), (None, None)]
    # A 410 on a first page (no token of ours expired) is the caller's to see.
    kube.core = _GoneCore()  # type: ignore[assignment]
    with pytest.raises(kubernetes.client.ApiException):
        asyncio.run(kube.list("Pod", None, {}, page_size=2))


class _GoneCore:
    def list_pod_for_all_namespaces(self, **kwargs: Any) -> dict[str, Any]:
        raise kubernetes.client.ApiException(status=410, reason="Gone")


def test_list_ends_when_the_server_ignores_limit(cluster: EmulatedCluster) -> None:
    """KMock answers every object at once with no continue token: the loop must still end."""
    k = builders.Kube(cluster.api_client())
    k.create_node(builders.make_node("a0", 4, pool="a"))
    for i in range(3):
        k.core.create_namespaced_pod(NS, _pod(f"p{i}", "a0", 1))
    kube = client_mod.KubeClient(cluster.api_client())
    pods = asyncio.run(kube.list("Pod", None, {}, page_size=1))
    assert sorted(p["metadata"]["name"] for p in pods) == ["p0", "p1", "p2"]



def test_a_list_keeps_each_object_as_reduced_while_its_page_arrives() -> None:
    """Paged but kept whole, a list of every pod held every body until the caller was done."""
    kube = client_mod.KubeClient(kubernetes.client.ApiClient())
    core = kube.core = _PagingCore(5)  # type: ignore[assignment]
    seen: list[int] = []

    def keep(body: dict[str, Any]) -> dict[str, Any]:
        seen.append(len(core.calls))  # the page this object came in
        return {"name": body["metadata"]["name"]}

    listed = asyncio.run(kube.list("Pod", None, {}, page_size=2, keep=keep))
    assert listed == [{"name": f"p{i}"} for i in range(5)]
    assert seen == [1, 1, 2, 2, 3]  # each page's objects reduced before the next page is asked for


_GPU_COUNTS = st.sampled_from([None, "0", "1", "2", "8", "500m", "x"])


@st.composite
def _any_pod(draw: st.DrawFn) -> dict[str, Any]:
    def container() -> dict[str, Any]:
        resources = {part: {"nvidia.com/gpu": value, "cpu": "1"}
                     for part in ("requests", "limits") if (value := draw(_GPU_COUNTS)) is not None}
        return {"name": "c", "image": "x", "env": [{"name": "A", "value": "b"}], "resources": resources}

    labels = {"app": "x", **({manifests.LABEL_JOB: "j"} if draw(st.booleans()) else {})}
    body: dict[str, Any] = {
        "metadata": {"namespace": draw(st.sampled_from([NS, "other"])), "name": f"p{draw(st.integers(0, 5))}",
                     "labels": labels, "annotations": {"note": "y" * 100}},
        "spec": {"containers": [container() for _ in range(draw(st.integers(0, 3)))],
                 "initContainers": [container() for _ in range(draw(st.integers(0, 2)))]},
    }
    if draw(st.booleans()):
        body["spec"]["nodeName"] = draw(st.sampled_from(["a0", "a1", ""]))
    if draw(st.booleans()):
        body["status"] = {"phase": draw(st.sampled_from(["Pending", "Running", "Succeeded", "Failed"])),
                          "conditions": [{"type": "Ready", "status": "True"}]}
    return body


@settings(max_examples=200, deadline=None)
@given(st.lists(_any_pod(), max_size=8), st.lists(_any_pod(), max_size=8))
def test_a_slim_pod_is_mirrored_as_its_whole_body(watched: list[dict[str, Any]],
                                                  listed: list[dict[str, Any]]) -> None:
    """What the start-up list and the foreign resync keep of a pod changes nothing the mirror
    records: the same GPUs held by other controllers, the same pods dropped."""
    whole, slim = index.ClusterIndex(), index.ClusterIndex()
    for body in watched:
        whole.observe_foreign_pod(body)
        slim.observe_foreign_pod(index.slim_pod(body))
    assert slim.foreign == whole.foreign
    mark = whole.observations
    dropped = whole.resync_foreign(listed, mark)
    assert slim.resync_foreign([index.slim_pod(b) for b in listed], mark) == dropped
    assert slim.foreign == whole.foreign
    for body in listed:
        if manifests.LABEL_JOB in body["metadata"]["labels"]:
            assert index.slim_pod(body) is body  # observe_pod reads Huorn's pods whole
