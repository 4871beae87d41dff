"""A borrower whose VirtualCluster is deleted while its pods run still holds the lender's GPUs.

Its pods keep their cluster's name (the huorn.io/virtual-cluster annotation). Before, the mirror
bound them with no cluster once that name was gone, the snapshot counted nothing lent for them and
the lender's status dropped them from `lent`: the lender then lent the same GPUs again, past its
maxGPUsLent (a third cluster's gang was placed on them while the orphan still ran).

The unit tests need no API; the last one runs the real kopf operator against KMock, as
tests/test_lending_review_fixes.py does: time is real, and every wait polls for what the
operator has written (no fixed sleeps).
"""

from __future__ import annotations

from kube import builders, serving
from kube.cluster import wait_for

from huorn.operator import index, virtualclusters
from huorn.operator.context import Context
from huorn.scheduler import placement, snapshot

pytest_plugins = ["kube.fixtures"]

NS = "team"
SERVE = snapshot.VirtualClusterView("serve", lendable=True, max_gpus_lent=4)
OTHER = snapshot.VirtualClusterView("other", max_gpus_borrowed=8)


def _pod(name: str, node: str, gpus: int, vc: str) -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"huorn.io/job": name.split("-")[0], "huorn.io/vertex": "trainer"},
            "annotations": {"huorn.io/node": node, "huorn.io/gpus": str(gpus),
                            "huorn.io/virtual-cluster": vc},
        },
        "spec": {"containers": [{"resources": {"limits": {"cpu": "1"}}}]},
        "status": {"phase": "Running"},
    }


def _cluster_without_train() -> Context:
    """b0 (8 GPUs) of `serve`, which lends 4; `other` borrows; an elastic job of `train`, a cluster
    deleted since, runs 2 × 2 GPUs on b0."""
    ctx = Context(client=None, post_event=lambda *a: None)  # type: ignore[arg-type]
    ctx.index.nodes["b0"] = index.NodeRecord("b0", 8, {"pool": "b"})
    ctx.index.nodes["c0"] = index.NodeRecord("c0", 0, {"pool": "c"})
    ctx.index.vcs = {
        "serve": {"members": {"nodeSelector": {"matchLabels": {"pool": "b"}}},
                  "lending": {"lendable": True, "maxGPUsLent": 4}},
        "other": {"members": {"nodeSelector": {"matchLabels": {"pool": "c"}}},
                  "borrowing": {"maxGPUsBorrowed": 8}},
    }
    for i in range(2):
        ctx.index.observe_pod(_pod(f"elastic-trainer-{i}", "b0", 2, "train"))
    return ctx


def test_the_snapshot_counts_a_deleted_clusters_gpus_as_lent() -> None:
    snap = snapshot.ClusterSnapshot(
        [placement.NodeView("b0", gpus_total=8, gpus_free=8, virtual_cluster="serve")], [SERVE, OTHER])
    snap.assume("team/elastic", "train", placement.Placement(["b0", "b0"]), gpus_per_replica=2)
    assert (snap.lent("serve"), snap.lend_left("serve")) == (4, 0)
    assert snap.borrowed("other") == 0  # the deleted borrower charges no one's budget
    assert isinstance(snap.place("other", 2, 2), placement.Unplaceable)
    snap.forget("team/elastic")  # the orphan's pods are gone: the lender may lend again
    assert (snap.lent("serve"), snap.lend_left("serve")) == (0, 4)
    assert isinstance(snap.place("other", 2, 2), placement.Placement)


def test_the_mirror_and_status_keep_a_deleted_clusters_pods_lent() -> None:
    ctx = _cluster_without_train()
    snap = ctx.index.build_snapshot()
    assert snap.lent("serve") == 4
    assert isinstance(snap.place("other", 2, 2), placement.Unplaceable)  # 4 free on b0, none lendable
    usage = virtualclusters.compute_usage(ctx, "serve")
    assert (usage["allocated"], usage["lent"]) == (4, 4)
    # a pod of an existing borrower is counted as before
    ctx.index.observe_pod(_pod("late-trainer-0", "b0", 2, "other"))
    assert virtualclusters.compute_usage(ctx, "serve")["lent"] == 6
    assert virtualclusters.compute_usage(ctx, "other")["borrowed"] == 2


def test_a_lender_does_not_lend_again_what_a_deleted_clusters_job_holds(
        kube: builders.Kube, operator) -> None:
    """The reviewer's case: `serve` (maxGPUsLent 4) lends 4 of b0's GPUs to `train`'s elastic job;
    `train` is deleted, the job's pods run on. A gang of a third cluster that would borrow 4 more
    of b0 waits, `serve` still shows lent 4, and the gang starts once the orphan's pods are gone."""
    kube.create_node(builders.make_node("c0", 0, pool="c"))
    kube.create_vc(builders.make_virtual_cluster("other", pool="c", borrow=8))
    serving.borrow_four_gpus_of_b0(kube, NS)
    kube.custom.delete_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "train")
    # the operator read the deletion: the elastic job says its cluster is gone
    wait_for(lambda: kube.has_event(NS, "elastic", "VirtualClusterNotFound"), what="train's deletion read")
    assert serving.nodes_of(kube, NS, "elastic") == ["b0", "b0"]

    kube.create_job(NS, builders.make_training_job("late", "other", replicas=2, max_replicas=2, gpus=2))
    wait_for(lambda: serving.nodes_of(kube, NS, "late")
             or kube.condition(NS, "late", "Ready").get("reason") == "Unplaceable",
             what="the late gang placed or found unplaceable")
    assert serving.nodes_of(kube, NS, "late") == [], "serve lent past maxGPUsLent"
    assert "lendable by other virtual clusters 0" in kube.job_status(NS, "late")["message"]
    # a status written after the deletion (a spec change asks for one) still counts the orphan
    kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "serve",
                                            {"spec": {"borrowing": {"maxGPUsBorrowed": 1}}})
    generation = kube.get_vc("serve")["metadata"]["generation"]
    assert generation > 1, "the status waited for must be written after the change"
    status = wait_for(lambda: (s := kube.get_vc("serve").get("status") or {})
                      .get("observedGeneration") == generation and s, what="serve's status after the change")
    assert (status["lent"], status["allocated"]) == (4, 4)
    assert serving.nodes_of(kube, NS, "late") == [], "serve lent past maxGPUsLent"

    kube.delete_job(NS, "elastic")  # its pods go, and with them the loan
    wait_for(lambda: serving.nodes_of(kube, NS, "late") == ["b0", "b0"],
             what="the late gang on the freed GPUs")
    assert not serving.nodes_of(kube, NS, "elastic")
