"""Priority in the cluster: real kopf against KMock, the test playing the kubelet.

A waiting job of higher priority stops gangs of lower priority on its VirtualCluster's nodes
(gracefully: they checkpoint) and gets their GPUs before anyone else; pinned jobs (priority 100
and above) and jobs of equal priority are never stopped; GPUs that free up go to the first job
in line, not to whichever reconcile runs first.
"""

from __future__ import annotations

import dataclasses

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.kubelet import Kubelet

from huorn.operator import preempting, training
from huorn.operator.context import Context

pytest_plugins = ["kube.fixtures"]

NS = "team"


def solo_cluster(kube: builders.Kube) -> None:
    """A VirtualCluster of one 4-GPU node that neither lends nor borrows."""
    kube.create_node(builders.make_node("c0", 4, pool="c"))
    kube.create_vc(builders.make_virtual_cluster("solo", pool="c"))


def make_job(name: str, priority: int, gpus: int = 2) -> dict:
    return builders.make_training_job(name, "solo", replicas=1, max_replicas=1, gpus=gpus, priority=priority)


def trainers(kube: builders.Kube, job: str) -> list[str]:
    return sorted(p.metadata.name for p in kube.pods(NS, job, "trainer"))


def start(kube: builders.Kube, name: str, priority: int, gpus: int = 2) -> None:
    kube.create_job(NS, make_job(name, priority, gpus))
    wait_for(lambda: trainers(kube, name) != [], what=f"{name}'s trainer pod")
    kube.run_all_pods(NS, name)
    wait_for(lambda: kube.job_status(NS, name).get("phase") == "Running", what=f"{name} Running")


def low_and_mid_then_high(kube: builders.Kube, kubelet: Kubelet) -> None:
    """low (10) and mid (30) fill the cluster; high (60) arrives, and low's pod, held by the
    kubelet while it checkpoints, is deleted."""
    start(kube, "low", 10)
    start(kube, "mid", 30)
    kubelet.hold(["low-trainer-0"])
    kube.create_job(NS, make_job("high", 60))
    wait_for(lambda: ("low-trainer-0", {}) in kubelet.deletes(), what="low's pod deleted, gracefully")


def test_a_higher_priority_job_stops_the_lowest_gang_and_gets_its_gpus_first(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    solo_cluster(kube)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        low_and_mid_then_high(kube, kubelet)
        low = wait_for(lambda: (s := kube.job_status(NS, "low")).get("preemptReplacements") == 1 and s,
                       what="low preempted")
        assert low["decisions"][-1]["action"] == "replace"
        assert low["decisions"][-1]["reason"] == ("preempted by team/high (priority 60) to place its gang: "
                                                  "priority 10 is lower")
        wait_for(lambda: kube.has_event(NS, "low", "Preempted"), what="the Preempted event")
        wait_for(lambda: any(e.reason == "Preempting" and "team/low" in e.message
                             for e in kube.events(NS, "high")), what="high's Preempting event")
        # While low checkpoints, high waits for it and stops nobody else.
        waiting = wait_for(lambda: "waiting for the pods of preempted jobs" in
                           (c := kube.condition(NS, "high", "Reconciling"))["message"] and c,
                           what="high waiting for low's pods")
        assert waiting["reason"] == "Unplaceable"
        assert trainers(kube, "mid") == ["mid-trainer-0"]
        assert {n for n, _ in kubelet.deletes() if n.startswith("mid")} == set()

        # low's pod exits: high, first in line, gets the GPUs, and low's successor waits.
        kubelet.release(["low-trainer-0"])
        wait_for(lambda: trainers(kube, "high") == ["high-trainer-0"], what="high placed")
        assert trainers(kube, "low") == []
        kube.run_all_pods(NS, "high")
        wait_for(lambda: kube.job_status(NS, "high").get("phase") == "Running", what="high Running")
        assert trainers(kube, "low") == []
        assert kube.job_status(NS, "low")["phase"] != "Failed"

        # high goes away: low comes back under its successor's name, its restart budget untouched.
        kube.delete_job(NS, "high")
        wait_for(lambda: trainers(kube, "low") == ["low-trainer-0-g1"], what="low back")
        kube.run_all_pods(NS, "low")
        wait_for(lambda: kube.job_status(NS, "low").get("phase") == "Running", what="low Running again")


def test_pinned_and_equal_priority_gangs_are_never_stopped(kube: builders.Kube, operator) -> None:
    solo_cluster(kube)
    start(kube, "pinned", 100)
    start(kube, "peer", 60)
    kube.create_job(NS, make_job("high", 60))
    cond = wait_for(lambda: (c := kube.condition(NS, "high", "Reconciling")).get("reason") == "Unplaceable"
                    and c, what="high Unplaceable")
    assert "preempting" not in cond["message"] and "waiting for the pods" not in cond["message"]
    assert trainers(kube, "pinned") == ["pinned-trainer-0"] and trainers(kube, "peer") == ["peer-trainer-0"]
    assert kube.job_status(NS, "peer").get("preemptReplacements") is None


def test_freed_gpus_go_to_the_first_job_in_line(kube: builders.Kube, operator) -> None:
    """Two jobs wait behind a full cluster that they may not preempt (equal priority). When it frees,
    the one of higher priority needs all 4 GPUs; the smaller one behind it must not take 2 first."""
    solo_cluster(kube)
    start(kube, "first", 50, gpus=4)
    kube.create_job(NS, make_job("big", 40, gpus=4))
    kube.create_job(NS, make_job("small", 20, gpus=2))
    for name in ("big", "small"):
        wait_for(lambda n=name: kube.condition(NS, n, "Reconciling").get("reason") == "Unplaceable",
                 what=f"{name} waiting")
    # The line is in the VirtualCluster's status (`kubectl get vc` prints Waiting), in order.
    status = wait_for(lambda: (s := kube.get_vc("solo").get("status") or {}).get("waitingJobs") == 2
                      and s["waitingGPUs"] == 6 and s, what="2 jobs and 6 GPUs waiting in solo's status")
    assert status["line"] == [
        {"position": 1, "job": f"{NS}/big", "kind": "TrainingJob", "priority": 40, "gpus": 4},
        {"position": 2, "job": f"{NS}/small", "kind": "TrainingJob", "priority": 20, "gpus": 2}]
    kube.delete_job(NS, "first")
    wait_for(lambda: trainers(kube, "big") == ["big-trainer-0"], what="big placed")
    assert trainers(kube, "small") == []
    status = wait_for(lambda: (s := kube.get_vc("solo").get("status") or {}).get("waitingJobs") == 1
                      and s["waitingGPUs"] == 2 and s, what="small alone in line")
    assert status["line"] == [
        {"position": 1, "job": f"{NS}/small", "kind": "TrainingJob", "priority": 20, "gpus": 2}]
    reason = wait_for(lambda: (c := kube.condition(NS, "small", "Reconciling")).get("reason") in (
        "Queued", "Unplaceable") and c, what="small still waiting")
    assert reason["status"] == "True"


def test_an_elastic_gang_of_lower_priority_shrinks_instead_of_stopping(kube: builders.Kube, operator) -> None:
    solo_cluster(kube)
    body = builders.make_training_job("elastic", "solo", replicas=3, max_replicas=4, gpus=1, priority=10)
    body["spec"]["elasticity"]["policy"] = "goodput"
    kube.create_job(NS, body)
    wait_for(lambda: len(trainers(kube, "elastic")) == 3, what="3 elastic replicas")
    kube.run_all_pods(NS, "elastic")
    # Its minimum goes back to 1; it keeps the 3 replicas it has.
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                               "elastic", {"spec": {"elasticity": {"minReplicas": 1}}})
    wait_for(lambda: kube.job_status(NS, "elastic").get("observedGeneration")
             == kube.get_job(NS, "elastic")["metadata"]["generation"], what="the new minimum observed")
    start(kube, "fixed", 10, gpus=1)

    kube.create_job(NS, make_job("high", 60, gpus=2))
    wait_for(lambda: trainers(kube, "high") == ["high-trainer-0"], what="high placed")
    assert trainers(kube, "elastic") == ["elastic-trainer-0"], "the two newest replicas given up"
    assert trainers(kube, "fixed") == ["fixed-trainer-0"], "nobody stopped"
    status = kube.job_status(NS, "elastic")
    assert status["decisions"][-1]["action"] == "resize"
    assert status["decisions"][-1]["reason"] == ("shrunk by 2 for team/high (priority 60) to place its gang: "
                                                 "priority 10 is lower, and the job is elastic")
    assert status.get("preemptReplacements") is None and status["phase"] != "Failed"
    wait_for(lambda: kube.has_event(NS, "elastic", "Shrunk"), what="the Shrunk event")


def test_a_restarted_operator_finishes_a_preemption_and_stops_no_one_twice(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """The victim's stop is in its status before its pods are deleted; an operator that comes up
    while they still checkpoint rebuilds the line from the jobs, places the preemptor once they are
    gone, and decides nothing twice."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    solo_cluster(kube)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        low_and_mid_then_high(kube, kubelet)
        wait_for(lambda: kube.job_status(NS, "low").get("preemptReplacements") == 1, what="low preempted")
    # No operator while low's pod checkpoints and exits.
    kubelet.release(["low-trainer-0"])
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        wait_for(lambda: trainers(kube, "high") == ["high-trainer-0"], what="high placed by the new operator")
        kube.run_all_pods(NS, "high")
        wait_for(lambda: kube.job_status(NS, "high").get("phase") == "Running", what="high Running")
        assert trainers(kube, "low") == [] and trainers(kube, "mid") == ["mid-trainer-0"]
        low = kube.job_status(NS, "low")
        assert [d["action"] for d in low["decisions"]] == ["replace"] and low["preemptReplacements"] == 1
        assert kube.job_status(NS, "mid").get("preemptReplacements") is None


def test_a_higher_priority_training_job_preempts_a_running_rl_job(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """An RLJob's Ray cluster is a gang like any other: a waiting TrainingJob of higher priority
    stops it (its pods replaced, nothing spent from its restart budget), gets the GPUs first, and
    the RLJob's next gang waits for room instead of taking them back."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    solo_cluster(kube)
    rl = {"apiVersion": f"{builders.GROUP}/{builders.VERSION}", "kind": "RLJob", "metadata": {"name": "rl"},
          "spec": {"virtualCluster": "solo", "priority": 10, "gpus": 4,
                   "resources": {"gpus": 2, "cpu": "2", "memory": "8Gi"},
                   "roles": {"actorTrain": {"gpusPerReplica": 2}, "rollout": {"gpusPerReplica": 2}}}}
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, rl, plural="rljobs")
        first = ["rl-ray-head-0", "rl-ray-worker-0", "rl-ray-worker-1"]
        wait_for(lambda: sorted(p.metadata.name for p in kube.pods(NS, "rl")) == first, what="the RL gang")
        kube.run_all_pods(NS, "rl")
        wait_for(lambda: kube.job_status(NS, "rl", "rljobs").get("phase") == "Running", what="rl Running")
        kubelet.hold(first)
        kube.create_job(NS, make_job("high", 60))
        wait_for(lambda: {n for n, _ in kubelet.deletes()} >= set(first), what="the RL gang stopped")
        rl_status = kube.job_status(NS, "rl", "rljobs")
        assert rl_status["decisions"][-1]["action"] == "replace"
        assert rl_status["decisions"][-1]["reason"].startswith(
            "preempted by team/high (priority 60) to place its gang: priority 10 is lower")
        wait_for(lambda: kube.has_event(NS, "rl", "Preempted"), what="the Preempted event")
        assert trainers(kube, "high") == []  # the GPUs are still held while the gang checkpoints
        kubelet.release(first)
        wait_for(lambda: trainers(kube, "high") == ["high-trainer-0"], what="high placed")
        # 2 GPUs are left, the RLJob needs 4: it waits, its budget untouched
        waiting = wait_for(lambda: (s := kube.job_status(NS, "rl", "rljobs")).get("message", "")
                           .startswith("waiting") and s, what="the RLJob waiting")
        assert waiting.get("restarts", 0) == 0 and waiting["phase"] == "Pending"
        assert [p.metadata.name for p in kube.pods(NS, "rl")] == []


def rl_job(name: str, priority: int, gpus: int = 4) -> dict:
    return builders.make_rl_job(name, "solo", priority=priority, gpus=gpus)


def rl_pods(kube: builders.Kube, name: str) -> list[str]:
    return sorted(p.metadata.name for p in kube.pods(NS, name))


def low_running_then_rl(kube: builders.Kube, kubelet: Kubelet) -> None:
    """low (priority 10) holds all 4 GPUs, its pod held by the kubelet while it checkpoints;
    an RLJob of priority 60 needing 4 arrives."""
    start(kube, "low", 10, gpus=4)
    kubelet.hold(["low-trainer-0"])
    kube.create_job(NS, rl_job("rl", 60), plural="rljobs")


def test_a_waiting_rl_job_of_higher_priority_preempts_a_training_job(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """Before, a waiting RLJob preempted nobody. Now it is in the line: it stops a TrainingJob of
    lower priority on its nodes (gracefully), gets the GPUs first, and the victim's next gang
    steps back for it instead of taking them back."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    solo_cluster(kube)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        low_running_then_rl(kube, kubelet)
        wait_for(lambda: ("low-trainer-0", {}) in kubelet.deletes(), what="low's pod deleted, gracefully")
        waiting = wait_for(lambda: (s := kube.job_status(NS, "rl", "rljobs")).get("message", "")
                           .startswith("waiting") and "preempting team/low" in s["message"] and s,
                           what="the RLJob says whom it preempts")
        assert waiting["phase"] == "Pending" and rl_pods(kube, "rl") == []  # GPUs held while low checkpoints
        low = kube.job_status(NS, "low")
        assert low["decisions"][-1]["action"] == "replace" and low["preemptReplacements"] == 1
        assert low["decisions"][-1]["reason"].startswith(
            "preempted by team/rl (priority 60) to place its gang: priority 10 is lower")
        wait_for(lambda: kube.has_event(NS, "rl", "Preempting"), what="the Preempting event")
        kubelet.release(["low-trainer-0"])
        wait_for(lambda: rl_pods(kube, "rl") == ["rl-ray-head-0", "rl-ray-worker-0", "rl-ray-worker-1"],
                 what="the RL gang placed")
        # low's new gang waits for room (4 GPUs, none free), its budget untouched
        wait_for(lambda: kube.condition(NS, "low", "Reconciling").get("reason") in ("Unplaceable", "Queued"),
                 what="low waiting")
        assert trainers(kube, "low") == []


def test_a_waiting_rl_job_keeps_its_place_in_line(kube: builders.Kube, operator) -> None:
    """An RLJob and a TrainingJob wait behind a full cluster that they may not preempt. The RLJob
    is first in line (higher priority) and needs all 4 GPUs; when they free, the smaller
    TrainingJob behind it must not take 2 first (before, the RLJob was not in the line at all)."""
    solo_cluster(kube)
    start(kube, "first", 70, gpus=4)
    kube.create_job(NS, rl_job("rl", 40), plural="rljobs")
    kube.create_job(NS, make_job("small", 20, gpus=2))
    wait_for(lambda: kube.condition(NS, "small", "Reconciling").get("reason") == "Unplaceable",
             what="small waiting")
    wait_for(lambda: kube.condition(NS, "rl", "Reconciling", "rljobs").get("reason") == "WaitingForGPUs",
             what="rl waiting")
    status = wait_for(lambda: (s := kube.get_vc("solo").get("status") or {}).get("waitingJobs") == 2
                      and s["waitingGPUs"] == 6 and s, what="2 jobs and 6 GPUs waiting in solo's status")
    assert [(e["job"], e["kind"]) for e in status["line"]] == [
        (f"{NS}/rl", "RLJob"), (f"{NS}/small", "TrainingJob")]
    kube.delete_job(NS, "first")
    wait_for(lambda: len(rl_pods(kube, "rl")) == 3, what="the RL gang placed")
    assert trainers(kube, "small") == []
    wait_for(lambda: (s := kube.get_vc("solo").get("status") or {}).get("waitingJobs") == 1
             and s["waitingGPUs"] == 2, what="small alone in line")


def test_a_restarted_operator_keeps_a_waiting_rl_job_in_line(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """The RLJob's place in line is rebuilt from its status (WaitingForGPUs, no worker pods): the
    new operator places it once its victim's pod is gone, and the victim's next gang, which would
    fit as well, does not take the GPUs back."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    solo_cluster(kube)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        low_running_then_rl(kube, kubelet)
        wait_for(lambda: kube.job_status(NS, "low").get("preemptReplacements") == 1, what="low preempted")
        wait_for(lambda: kube.condition(NS, "rl", "Reconciling", "rljobs").get("reason") == "WaitingForGPUs",
                 what="rl waiting")
    kubelet.release(["low-trainer-0"])  # no operator while low's pod checkpoints and exits
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        wait_for(lambda: len(rl_pods(kube, "rl")) == 3, what="the RL gang placed by the new operator")
        wait_for(lambda: kube.condition(NS, "low", "Reconciling").get("reason") in ("Unplaceable", "Queued"),
                 what="low waiting")
        assert trainers(kube, "low") == []
        assert kube.job_status(NS, "low")["preemptReplacements"] == 1  # stopped once, not twice


async def test_a_gang_whose_pods_the_watch_has_not_reported_preempts_no_one(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """The race behind a rare failure of the test above: a job's second reconcile that runs after
    its placement created its pods but before the watch reported them. Its GPUs are already
    reserved in the mirror, so the cluster looked full to it; it found its own gang missing and
    preempted `mid` for GPUs it already had. Reconciled by hand here, with no watch at all: the
    reservation counts as the job's pod."""
    solo_cluster(kube)
    ctx = await operator_mod.direct_context(cluster.api_client())
    kube.create_job(NS, make_job("mid", 30))
    kube.create_job(NS, make_job("high", 60))

    async def reconcile(name: str) -> str:
        body = await ctx.client.get_custom(training.PLURAL, NS, name)
        return await training.reconcile(ctx, body)

    await reconcile("mid")
    for pod in await ctx.client.list("Pod", NS, {}):  # mid's pods reported by the watch
        ctx.index.observe_pod(pod)
    assert await reconcile("high") == "Placing"  # placed: its pods created, not yet reported
    assert ctx.index.creating(NS, "high") == {"high-trainer-0"}
    assert await reconcile("high") == "Placing"
    assert ctx.preemptions == {}
    assert kube.job_status(NS, "mid").get("preemptReplacements") is None
    assert trainers(kube, "high") == ["high-trainer-0"]


async def report_pods(ctx: Context) -> None:
    """What the pod watch would say by now: every pod as the API has it, and the gone ones gone."""
    ctx.index.resync_pods(await ctx.client.list("Pod", NS, {}), ctx.index.observations)


async def test_a_gang_shrunk_for_a_job_is_not_stopped_as_well_while_its_replicas_checkpoint(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """high shrinks `elastic` by the 2 GPUs it needs. Its next reconcile, while the 2 replicas
    given up still checkpoint (deleting, their GPUs held), found the cluster as full as before and
    `elastic` without surplus, and stopped `elastic` whole as well: pods being deleted now count as
    gone when preemption plans, as a stopping gang's always did."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    solo_cluster(kube)
    ctx = await operator_mod.direct_context(cluster.api_client())

    async def reconcile(name: str) -> str:
        return await training.reconcile(ctx, await ctx.client.get_custom(training.PLURAL, NS, name))

    body = builders.make_training_job("elastic", "solo", replicas=3, max_replicas=4, gpus=1, priority=10)
    body["spec"]["elasticity"]["policy"] = "goodput"
    kube.create_job(NS, body)
    await reconcile("elastic")
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                               "elastic", {"spec": {"elasticity": {"minReplicas": 1}}})
    await reconcile("elastic")  # keeps its 3 replicas, 2 of them surplus now
    kube.create_job(NS, make_job("fixed", 10, gpus=1))
    await reconcile("fixed")
    for name in ("elastic", "fixed"):
        kube.run_all_pods(NS, name)
    await report_pods(ctx)
    kubelet.hold(trainers(kube, "elastic"))  # the replicas given up checkpoint for a while
    kube.create_job(NS, make_job("high", 60))
    assert await reconcile("high") == "Pending"
    assert await preempting.apply_planned(ctx, NS, "high") == ["team/elastic (shrunk by 2)"]
    # Before the watch reports the deletes: the same shrink is planned, and it finds nothing left to do.
    await reconcile("high")
    assert await preempting.apply_planned(ctx, NS, "high") == []
    await report_pods(ctx)  # the 2 replicas deleting, still holding their GPUs
    assert await reconcile("high") == "Pending"
    assert ctx.preemptions == {}
    assert "waiting for the pods of preempted jobs" in kube.condition(NS, "high", "Reconciling")["message"]
    status = kube.job_status(NS, "elastic")
    assert [d["action"] for d in status["decisions"]][-1] == "resize" and "preemptReplacements" not in status
    assert kube.job_status(NS, "fixed").get("preemptReplacements") is None
    kubelet.release(["elastic-trainer-1", "elastic-trainer-2"])
    await report_pods(ctx)  # gone
    assert await reconcile("high") == "Placing"
    assert trainers(kube, "high") == ["high-trainer-0"]
    assert trainers(kube, "elastic") == ["elastic-trainer-0"]
    assert trainers(kube, "fixed") == ["fixed-trainer-0"]


async def shrunk_by_a_reclaim(cluster: EmulatedCluster, kube: builders.Kube) -> tuple[Context, Kubelet]:
    """An elastic job of 3 running replicas (their pods held by the kubelet while they
    checkpoint) that a lender's reclaim has just shrunk by trainer-2, with its 120 s grace; the
    mirror has not seen that pod deleting. Reconciled by hand, with no watch."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    solo_cluster(kube)
    ctx = await operator_mod.direct_context(cluster.api_client())
    body = builders.make_training_job("elastic", "solo", replicas=3, max_replicas=4, gpus=1, priority=10)
    body["spec"]["elasticity"]["policy"] = "goodput"
    kube.create_job(NS, body)
    await training.reconcile(ctx, await ctx.client.get_custom(training.PLURAL, NS, "elastic"))
    kube.run_all_pods(NS, "elastic")
    await report_pods(ctx)
    kubelet.hold(trainers(kube, "elastic"))
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                               "elastic", {"spec": {"elasticity": {"minReplicas": 1}}})
    await training.reconcile(ctx, await ctx.client.get_custom(training.PLURAL, NS, "elastic"))
    assert await preempting.shrink_gang(ctx, NS, "elastic", ["trainer-2"], "reclaim: serve needs 1 GPU",
                                        grace=120)
    return ctx, kubelet


def delete_graces(kubelet: Kubelet) -> dict[str, set[str | None]]:
    """Pod → every gracePeriodSeconds its DELETEs asked (None: the pod's own)."""
    graces: dict[str, set[str | None]] = {}
    for pod, params in kubelet.deletes():
        graces.setdefault(pod, set()).add(params.get("gracePeriodSeconds"))
    return graces


async def test_a_gang_stopped_after_a_reclaim_shrink_keeps_the_reclaims_grace(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """A lender reclaims a replica with its 120 s grace; before the watch reports that pod
    deleting, a job of higher priority stops the gang. The stop deleted every trainer pod the
    mirror showed live, the reclaimed one again with the pods' own 30 s, and a second DELETE with a
    shorter grace cuts the first one short (its checkpoint time). It now deletes only the pods of
    the replicas it replaces; the reclaimed pod's delete stays the reclaim's (and a reconcile that
    repeats it uses the grace recorded with the decision)."""
    ctx, kubelet = await shrunk_by_a_reclaim(cluster, kube)
    assert await preempting.preempt_gang(ctx, NS, "elastic", "preempted by team/high (priority 60)")
    graces = delete_graces(kubelet)
    assert graces == {"elastic-trainer-2": {"120"}, "elastic-trainer-0": {None}, "elastic-trainer-1": {None}}
    assert kube.job_status(NS, "elastic")["preemptReplacements"] == 2


async def test_a_suspend_right_after_a_reclaim_shrink_keeps_the_reclaims_grace(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """The same window for spec.suspend: it deletes every pod of the job, and the reclaimed one,
    not yet seen deleting, went again with the pods' own 30 s; it now keeps the reclaim's 120 s."""
    ctx, kubelet = await shrunk_by_a_reclaim(cluster, kube)
    # its entry in line ranks it for the goodput allocator (allocation.rank_view), while it runs
    ranked = ctx.queue.jobs[(NS, "elastic")].ranked
    assert ranked is not None and (ranked.name, ranked.remaining_work) == (f"{NS}/elastic#ranked", 100 * 48)
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                               "elastic", {"spec": {"suspend": True}})
    assert await training.reconcile(ctx, await ctx.client.get_custom(training.PLURAL, NS, "elastic")) \
        == "Suspended"
    entry = ctx.queue.jobs.get((NS, "elastic"))  # suspended, it competes for nothing
    assert entry is None or entry.ranked is None
    graces = delete_graces(kubelet)
    assert graces == {"elastic-trainer-2": {"120"}, "elastic-trainer-0": {None}, "elastic-trainer-1": {None},
                      "elastic-rendezvous-0": {None}}


async def test_a_job_in_back_off_leaves_the_line_and_a_job_behind_it_takes_the_free_gpus(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """`gang` waits in line for a replica that does not fit; a pod's failure then puts it in
    back-off. It must leave the line for the back-off: before, its entry kept the previous
    reconcile's count of missing replicas, so `third`, behind it, stepped back for a job that was
    not going to place, and the GPUs the failure freed stayed idle for the whole back-off."""
    solo_cluster(kube)
    # a back-off far longer than the test, whatever the host's load
    ctx = await operator_mod.direct_context(cluster.api_client(), dataclasses.replace(
        operator_mod.FAST, replacement_backoff_seconds=300, replacement_backoff_max_seconds=360))

    async def reconcile(name: str) -> str:
        return await training.reconcile(ctx, await ctx.client.get_custom(training.PLURAL, NS, name))

    async def kubelet_reports(pod: str, phase: str | None) -> None:
        if phase is None:
            kube.core.delete_namespaced_pod(pod, NS, grace_period_seconds=0)
        else:
            kube.set_pod_phase(NS, pod, phase, exit_code=1 if phase == "Failed" else None)
        await report_pods(ctx)

    kube.create_job(NS, builders.make_training_job("gang", "solo", replicas=2, max_replicas=2, priority=30))
    await reconcile("gang")
    kube.run_all_pods(NS, "gang")
    await report_pods(ctx)
    assert await reconcile("gang") == "Running"
    await kubelet_reports("gang-trainer-0", "Failed")
    await reconcile("gang")  # a first failure is replaced at once; the next within 10 min waits
    assert trainers(kube, "gang") == ["gang-trainer-0-g1", "gang-trainer-1"]
    await kubelet_reports("gang-trainer-0-g1", "Running")
    await kubelet_reports("gang-trainer-0-g1", None)  # evicted and gone: no failure of the job's
    kube.create_job(NS, make_job("other", 30))  # equal priority: never preempted for `gang`
    assert await reconcile("other") == "Placing"  # onto the GPUs the eviction freed
    await report_pods(ctx)
    await reconcile("gang")
    assert kube.condition(NS, "gang", "Reconciling")["reason"] == "Unplaceable"
    assert ctx.queue.jobs[(NS, "gang")].missing == 1, "in line for its lost replica"
    await kubelet_reports("gang-trainer-1", "Failed")
    await reconcile("gang")  # the second failure within 10 minutes: back-off
    assert kube.condition(NS, "gang", "Reconciling")["reason"] == "BackOff"
    assert ctx.queue.jobs[(NS, "gang")].missing == 0, "out of line while it backs off"
    kube.create_job(NS, make_job("third", 30))
    assert await reconcile("third") == "Placing"  # behind `gang`, onto the GPUs the failure freed
    assert trainers(kube, "third") == ["third-trainer-0"]
