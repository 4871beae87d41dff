"""Review fixes to lending: a lender always gets its GPUs back, whatever the borrower's priority
and whatever the lender's purpose.

Real kopf against KMock, as tests/test_operator_monitor_reclaim.py: time is real, and every wait
polls for what the operator has written (no fixed sleeps).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

from huorn.scheduler import loaning, snapshot

pytest_plugins = ["kube.fixtures"]

NS = "team"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "inference-job.yaml"
SERVE = snapshot.VirtualClusterView("serve", "inference", lendable=True, max_gpus_lent=8,
                                    reclaim_grace_seconds=45)


def trainers(kube: builders.Kube, job: str) -> list[str]:
    return sorted(p.metadata.name for p in kube.pods(NS, job, "trainer"))


def nodes_of(kube: builders.Kube, job: str) -> list[str]:
    return sorted(p.metadata.annotations["huorn.io/node"] for p in kube.pods(NS, job, "trainer"))


def vc_events(kube: builders.Kube, vc: str, reason: str) -> list:
    return [e for e in kube.events("default", vc) + kube.events(NS, vc) if e.reason == reason]


def test_the_planner_reclaims_from_a_pinned_borrower() -> None:
    """Priority 100 pins a job within its own cluster's quota, not on GPUs it borrowed: a tenant
    who may edit a job may set it, and before, such a borrower was never a victim."""
    pinned = loaning.LoanView("team/gang", replicas_on_lender=2, replicas_total=2, min_replicas=2,
                              gpus_per_replica=2, priority=100)
    (reclaim,) = loaning.plan_reclaim(SERVE, 2, [pinned], now=0.0, why="demand")
    assert (reclaim.job, reclaim.action, reclaim.gpus_released) == ("team/gang", "preempt", 4)
    # among borrowers, priority does not decide: the least lost work does
    elastic_vip = loaning.LoanView("team/vip", 4, 4, 1, priority=100, checkpoint_seconds=5,
                                   restart_seconds=30)
    fixed_low = loaning.LoanView("team/low", 4, 4, 4, priority=10, seconds_since_checkpoint=600,
                                 checkpoint_seconds=60, restart_seconds=120)
    (cheapest,) = loaning.plan_reclaim(SERVE, 2, [elastic_vip, fixed_low], now=0.0, why="demand")
    assert (cheapest.job, cheapest.action) == ("team/vip", "shrink")


def test_a_pinned_borrower_gives_an_inference_lender_its_gpus_back(kube: builders.Kube, operator) -> None:
    """The reviewer's case: a training gang at priority 100 borrows 4 of the serving cluster's
    GPUs; an InferenceJob then needs 3 × 2 of b0's 8. The gang is preempted (fixed, so it cannot
    shrink) and the third replica gets its GPUs; before, nothing happened and nothing said why."""
    kube.custom.patch_cluster_custom_object(
        builders.GROUP, builders.VERSION, "virtualclusters", "serve",
        {"spec": {"purpose": "inference", "lending": {"lendable": True, "maxGPUsLent": 8,
                                                        "reclaimGraceSeconds": 45}}})
    kube.create_job(NS, builders.make_training_job("fill", "train", replicas=2, max_replicas=2, gpus=4))
    wait_for(lambda: len(trainers(kube, "fill")) == 2, what="the filler's pods")
    kube.create_job(NS, builders.make_training_job("gang", "train", replicas=2, max_replicas=2, gpus=2,
                                                   priority=100))
    wait_for(lambda: nodes_of(kube, "gang") == ["b0", "b0"], what="the pinned gang borrowing b0")
    kube.run_all_pods(NS, "gang")
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": "chat"}
    body["spec"].update(virtualCluster="serve")
    body["spec"]["resources"]["gpus"] = 2
    body["spec"]["autoscaling"] = {"minReplicas": 3, "maxReplicas": 3}
    kube.custom.create_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "inferencejobs", body)

    wait_for(lambda: [e for e in kube.events(NS, "gang") if e.reason == "Preempted"], what="gang preempted")
    wait_for(lambda: len(kube.pods(NS, "chat", "server")) == 3, what="the InferenceJob's third replica")
    assert kube.job_status(NS, "gang").get("preemptReplacements") == 2
    wait_for(lambda: any("(preempted)" in e.message and "team/gang" in e.message
                         for e in vc_events(kube, "serve", "Reclaimed")), what="serve's Reclaimed event")
    assert not vc_events(kube, "serve", "ReclaimBlocked")


def training_lender(cluster: EmulatedCluster) -> builders.Kube:
    """Pool a (a0, a1: 8 GPUs) is a training cluster that lends all 8; pool b has no GPU, so the
    borrower cluster's jobs run only on loan."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(builders.make_node("a0", 4, pool="a"))
    kube.create_node(builders.make_node("a1", 4, pool="a"))
    kube.create_node(builders.make_node("b0", 0, pool="b"))
    lender = builders.make_virtual_cluster("lender", pool="a", lend=8)
    lender["spec"]["lending"]["reclaimGraceSeconds"] = 20
    kube.create_vc(lender)
    kube.create_vc(builders.make_virtual_cluster("borrower", pool="b", borrow=8))
    return kube


def test_a_training_lender_shrinks_an_elastic_borrower_for_its_own_job(cluster: EmulatedCluster) -> None:
    """The lender's job needs 4 GPUs, all 8 are lent to an elastic gang of 2 × 4: one replica
    (4 GPUs, no more) comes back by a graceful shrink, and the lender's job is placed on them.
    Before, a training cluster never reclaimed, and its job waited as long as the borrower ran."""
    kube = training_lender(cluster)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, builders.make_training_job(
            "guest", "borrower", replicas=2, max_replicas=2, gpus=4,
            elasticity={"minReplicas": 2, "maxReplicas": 2, "policy": "goodput"}))
        wait_for(lambda: len(trainers(kube, "guest")) == 2, what="guest placed on the lender")
        kube.run_all_pods(NS, "guest")
        kube.custom.patch_namespaced_custom_object(  # room to shrink, once it runs at two
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "guest",
            {"spec": {"elasticity": {"minReplicas": 1}}})
        wait_for(lambda: kube.get_vc("lender").get("status", {}).get("lent") == 8, what="lender lends 8")
        kube.create_job(NS, builders.make_training_job("owner", "lender", replicas=1, max_replicas=1, gpus=4))

        wait_for(lambda: len(trainers(kube, "owner")) == 1, what="the lender's own job placed")
        assert len(trainers(kube, "guest")) == 1, "only what the lender's job needs is reclaimed"
        decisions = kube.job_status(NS, "guest").get("decisions") or []
        (shrink,) = [d for d in decisions if d["action"] == "resize"]
        assert shrink["reason"].startswith("reclaim: lender reclaims 4 GPU(s) (its own jobs in line need 4")
        assert "team/owner" in shrink["reason"]
        told = wait_for(lambda: [e for e in kube.events(NS, "owner") if e.reason == "Reclaiming"],
                        what="the owner told its GPUs are lent and coming back")
        assert "lender had lent 4 GPU(s)" in told[0].message
        kube.run_all_pods(NS, "owner")
        wait_for(lambda: kube.job_status(NS, "owner").get("phase") == "Running", what="owner Running")
        wait_for(lambda: kube.get_vc("lender").get("status", {}).get("lent") == 4, what="lender lends 4")


def test_a_training_lender_preempts_a_fixed_borrower_which_does_not_take_the_gpus_back(
        cluster: EmulatedCluster) -> None:
    """A fixed gang cannot shrink, so it is preempted (the lender's reclaimPolicy is Preempt) and
    requeued. Its successors must not re-borrow the lender's GPUs before the lender's job has
    them, which would start the reclaim over and again (ping-pong): one preemption, the lender's
    job placed, and the gang waiting since half of the lender is now its owner's."""
    kube = training_lender(cluster)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, builders.make_training_job("guest", "borrower", replicas=2, max_replicas=2,
                                                       gpus=4))
        wait_for(lambda: len(trainers(kube, "guest")) == 2, what="guest placed on the lender")
        kube.run_all_pods(NS, "guest")
        wait_for(lambda: kube.job_status(NS, "guest").get("phase") == "Running", what="guest running")
        kube.create_job(NS, builders.make_training_job("owner", "lender", replicas=1, max_replicas=1, gpus=4))

        wait_for(lambda: len(trainers(kube, "owner")) == 1, what="the lender's own job placed")
        kube.run_all_pods(NS, "owner")
        wait_for(lambda: kube.job_status(NS, "owner").get("phase") == "Running", what="owner Running")
        wait_for(lambda: [e for e in kube.events(NS, "guest") if e.reason == "Unplaceable"],
                 what="the preempted gang waits")
        assert trainers(kube, "guest") == []
        assert kube.job_status(NS, "guest").get("preemptReplacements") == 2, "preempted once, not again"
        assert trainers(kube, "owner") == ["owner-trainer-0"]
