"""A reclaim's grace outlives the operator that decided it: real kopf against KMock.

A lender's reclaim shrinks a borrower with the lender's `reclaimGraceSeconds` (its checkpoint
window), deleting the pods it gives up with that grace. The decision reaches the borrower's status
before any pod is deleted; an operator that dies between the two leaves the deletes to the next
reconcile. Before, that reconcile deleted them with the pods' own 30 s, cutting a longer
checkpoint window short.
"""

from __future__ import annotations

from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, hold_kopf_lists, wait_for
from kube.kubelet import Kubelet

from huorn.graph import mutate, serialise
from huorn.operator import training

pytest_plugins = ["kube.fixtures"]

NS = "team"


def record_shrink_of_trainer_1(kube: builders.Kube, grace: int) -> None:
    """What preempting.shrink_gang writes into the borrower's status before it deletes anything:
    the state an operator that died right after leaves."""
    g = serialise.from_status(kube.job_status(NS, "elastic")["graph"])
    m = mutate.resize(g, "trainer", 1, remove=["trainer-1"], reason="reclaim: serve reclaims 2 GPU(s)")
    assert m is not None
    m.detail[training.GRACE_KEY] = grace
    kube.custom.patch_namespaced_custom_object_status(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
        {"status": {"graph": serialise.to_status(g), "decisions": training.build_decisions(g),
                    "targetReplicas": 2}})


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
    record_shrink_of_trainer_1(kube, grace=120)
    kubelet.hold(["elastic-trainer-1"])
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        wait_for(lambda: [d for d in kubelet.deletes() if d[0] == "elastic-trainer-1"], what="the delete")
        assert [params for name, params in kubelet.deletes() if name == "elastic-trainer-1"] == [
            {"gracePeriodSeconds": "120"}]
        assert [p.metadata.name for p in kube.pods(NS, "elastic", "trainer")
                if not p.metadata.deletion_timestamp] == ["elastic-trainer-0"]
    kubelet.release(["elastic-trainer-1"])


def test_a_restarted_operator_does_not_reclaim_twice_what_a_recorded_shrink_gives_back(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """An elastic borrower of b0 (2 replicas × 2 GPUs) was shrunk for serve's demand and the
    operator died before deleting the pod it gave up. The new operator's first reclaim pass comes
    before the job's own reconcile (its watch's list is held), and sees that pod still running:
    it is debt being paid, not a loan. Before, it was counted as lent, the job could no longer
    shrink (at its minimum in the graph), and serve's default reclaimPolicy preempted it whole."""
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.custom.patch_cluster_custom_object(
            builders.GROUP, builders.VERSION, "virtualclusters", "serve",
            {"spec": {"purpose": "inference", "lending": {"lendable": True, "maxGPUsLent": 4,
                                                            "reclaimGraceSeconds": 45}}})
        serving.borrow_four_gpus_of_b0(kube, NS)
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
            {"spec": {"elasticity": {"minReplicas": 1}}})
        wait_for(lambda: serialise.from_status(kube.job_status(NS, "elastic")["graph"]).vertex(
            "trainer").min_replicas == 1, what="the new minimum in the graph")
    # serve now needs 6 of b0's 8 GPUs: 2 back, which the recorded shrink of trainer-1 gives
    kube.create_job(NS, serving.make_inference_job("chat", "serve", gpus=2, min_replicas=3, max_replicas=3),
                    plural="inferencejobs")
    record_shrink_of_trainer_1(kube, grace=45)
    held = hold_kopf_lists(cluster, "trainingjobs")
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST) as operator:
        wait_for(lambda: operator.ctx.index.demand_of("serve") == 6 and held, what="serve's demand known")
        wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "elastic", "trainer")
                          if not p.metadata.deletion_timestamp] == ["elastic-trainer-0"],
                 what="the recorded shrink carried out")
        wait_for(lambda: len(kube.pods(NS, "chat", "server")) == 3, what="chat's 3 replicas on b0")
        status = kube.job_status(NS, "elastic")
        assert not status.get("preemptReplacements"), status.get("decisions")
        changes = [d["action"] for d in status["decisions"] if d["action"] in ("resize", "replace")]
        assert changes == ["resize"], status["decisions"]
        assert [p.metadata.name for p in kube.pods(NS, "elastic", "trainer")] == ["elastic-trainer-0"]
