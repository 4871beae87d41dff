"""A reclaim's grace outlives the operator that decided it: real kopf against KMock.

A lender's reclaim shrinks a borrower with the lender's `reclaimGraceSeconds` (its checkpoint
window), deleting the pods it gives up with that grace. The decision reaches the borrower's status
before any pod is deleted; an operator that dies between the two leaves the deletes to the next
reconcile. Before, that reconcile deleted them with the pods' own 30 s, cutting a longer
checkpoint window short.
"""

from __future__ import annotations

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.kubelet import Kubelet

from huorn.graph import mutate, serialise
from huorn.operator import training

pytest_plugins = ["kube.fixtures"]

NS = "team"


def test_a_shrink_left_by_a_dead_operator_is_carried_out_with_the_lenders_grace(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, builders.make_training_job(
            "elastic", "train", replicas=2, max_replicas=2, gpus=2,
            elasticity={"minReplicas": 2, "maxReplicas": 2, "policy": "goodput"}))
        wait_for(lambda: len(kube.pods(NS, "elastic", "trainer")) == 2, what="two trainer pods")
        kube.run_all_pods(NS, "elastic")
        wait_for(lambda: kube.job_status(NS, "elastic").get("phase") == "Running", what="Running")
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
            {"spec": {"elasticity": {"minReplicas": 1}}})  # room to shrink
        wait_for(lambda: serialise.from_status(kube.job_status(NS, "elastic")["graph"]).vertex(
            "trainer").min_replicas == 1, what="the new minimum in the graph")
    # what preempting.shrink_gang writes before it deletes anything, for a lender whose grace is 120 s
    g = serialise.from_status(kube.job_status(NS, "elastic")["graph"])
    m = mutate.resize(g, "trainer", 1, remove=["trainer-1"],
                      reason="reclaim: serve reclaims 2 GPU(s) from team/elastic")
    assert m is not None
    m.detail[training.GRACE_KEY] = 120
    kube.custom.patch_namespaced_custom_object_status(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
        {"status": {"graph": serialise.to_status(g), "decisions": training.build_decisions(g),
                    "targetReplicas": 2}})
    kubelet.hold(["elastic-trainer-1"])
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        wait_for(lambda: [d for d in kubelet.deletes() if d[0] == "elastic-trainer-1"], what="the delete")
        assert [params for name, params in kubelet.deletes() if name == "elastic-trainer-1"] == [
            {"gracePeriodSeconds": "120"}]
        assert [p.metadata.name for p in kube.pods(NS, "elastic", "trainer")
                if not p.metadata.deletion_timestamp] == ["elastic-trainer-0"]
    kubelet.release(["elastic-trainer-1"])
