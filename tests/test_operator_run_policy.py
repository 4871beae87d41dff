"""A TrainingJob's run policy, as Kubernetes Jobs and Kubeflow's runPolicy have it: status.startTime
and completionTime, spec.activeDeadlineSeconds and spec.ttlSecondsAfterFinished. Real kopf against
the KMock emulator, the test playing the kubelet.
"""

from __future__ import annotations

import dataclasses
import datetime

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

from huorn.operator import rljobs, training

pytest_plugins = ["kube.fixtures"]

NS = "team"


def seconds(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def set_suspend(kube: builders.Kube, job: str, value: bool) -> None:
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs", job,
                                               {"spec": {"suspend": value}})


def test_a_finished_job_records_when_and_goes_after_its_ttl(kube: builders.Kube, operator) -> None:
    body = builders.make_training_job("brief", "train", replicas=2, gpus=1)
    body["spec"]["ttlSecondsAfterFinished"] = 3
    kube.create_job(NS, body)
    wait_for(lambda: len(kube.pods(NS, "brief", "trainer")) == 2, what="2 trainer pods")
    started = wait_for(lambda: kube.job_status(NS, "brief").get("startTime"), what="status.startTime")
    kube.run_all_pods(NS, "brief")
    for pod in kube.pods(NS, "brief", "trainer"):
        kube.set_pod_phase(NS, pod.metadata.name, "Succeeded", exit_code=0)
    status = wait_for(lambda: (s := kube.job_status(NS, "brief")).get("phase") == "Succeeded" and s,
                      what="Succeeded")
    assert status["startTime"] == started  # written once, at the placement
    assert seconds(started) <= seconds(status["completionTime"])
    # Still there before its TTL: a `kubectl get` right after it finished finds it.
    assert kube.job_exists(NS, "brief")
    wait_for(lambda: not kube.job_exists(NS, "brief"), timeout=20, what="the job deleted after its TTL")
    gone = seconds(status["completionTime"]) + 3
    assert datetime.datetime.now(datetime.UTC).timestamp() >= gone - 1.0  # second-granular stamps
    wait_for(lambda: kube.pods(NS, "brief") == [], what="its pods deleted by the finalizer")


def test_the_deadline_fails_a_running_job_and_stops_its_pods(cluster: EmulatedCluster,
                                                             kube: builders.Kube) -> None:
    # A resync far away: the deadline must fire on its own timer, not at the next resync.
    settings = dataclasses.replace(operator_mod.FAST, resync_seconds=120.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        body = builders.make_training_job("bounded", "train", replicas=2, gpus=1)
        body["spec"]["activeDeadlineSeconds"] = 3
        kube.create_job(NS, body)
        wait_for(lambda: len(kube.pods(NS, "bounded", "trainer")) == 2, what="2 trainer pods")
        kube.run_all_pods(NS, "bounded")
        status = wait_for(lambda: (s := kube.job_status(NS, "bounded")).get("phase") == "Failed" and s,
                          timeout=15, what="Failed at its deadline")
        ran = seconds(status["completionTime"]) - seconds(status["startTime"])
        assert 2.0 <= ran <= 6.0, status
        assert status["message"].startswith("the job ran ")
        assert "past spec.activeDeadlineSeconds (3 s)" in status["message"]
        stalled = kube.condition(NS, "bounded", "Stalled")
        assert (stalled["status"], stalled["reason"]) == ("True", "DeadlineExceeded")
        wait_for(lambda: kube.pods(NS, "bounded", "trainer") == [], what="its pods stopped")


def test_a_suspension_stops_the_deadline_clock_and_a_resume_starts_it_again(
        kube: builders.Kube, operator) -> None:
    body = builders.make_training_job("paused", "train", replicas=1, gpus=1)
    body["spec"]["activeDeadlineSeconds"] = 4
    kube.create_job(NS, body)
    wait_for(lambda: len(kube.pods(NS, "paused", "trainer")) == 1, what="the trainer pod")
    first = wait_for(lambda: kube.job_status(NS, "paused").get("startTime"), what="status.startTime")
    set_suspend(kube, "paused", True)
    wait_for(lambda: kube.job_status(NS, "paused").get("phase") == "Suspended"
             and kube.pods(NS, "paused", "trainer") == [], what="suspended, no pods")
    assert "startTime" not in kube.job_status(NS, "paused")
    # Suspended past the deadline: nothing fails while nothing runs.
    wait_for(lambda: datetime.datetime.now(datetime.UTC).timestamp() > seconds(first) + 5, timeout=10,
             what="the deadline passed")
    assert kube.job_status(NS, "paused")["phase"] == "Suspended"
    set_suspend(kube, "paused", False)
    wait_for(lambda: len(kube.pods(NS, "paused", "trainer")) == 1, what="the resumed trainer pod")
    again = wait_for(lambda: kube.job_status(NS, "paused").get("startTime"), what="a new startTime")
    assert seconds(again) >= seconds(first) + 5
    kube.run_all_pods(NS, "paused")
    status = wait_for(lambda: (s := kube.job_status(NS, "paused")).get("phase") == "Failed" and s,
                      timeout=15, what="Failed 4 s after the resume")
    assert seconds(status["completionTime"]) - seconds(again) >= 3.0


async def test_a_finished_job_stays_finished_when_its_virtual_cluster_turns_its_namespace_away(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """Validation against the cluster came before the finished-job check: a VirtualCluster that
    stopped serving the job's namespace knocked a Succeeded job (and an RLJob) into Stalled, and
    had it run again once the VirtualCluster was reverted. Reconciled by hand, after the change."""
    patch = kube.custom.patch_namespaced_custom_object_status
    kube.create_job(NS, builders.make_training_job("done", "train"))
    patch(builders.GROUP, builders.VERSION, NS, "trainingjobs", "done", {"status": {"phase": "Succeeded"}})
    kube.create_job(NS, builders.make_rl_job("rl-done", "train"), plural="rljobs")
    patch(builders.GROUP, builders.VERSION, NS, "rljobs", "rl-done", {"status": {"phase": "Failed"}})
    kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "train",
                                            {"spec": {"namespaces": ["elsewhere"]}})
    ctx = await operator_mod.direct_context(cluster.api_client())
    assert "elsewhere" in ctx.index.vcs["train"]["namespaces"]
    got = await training.reconcile(ctx, await ctx.client.get_custom("trainingjobs", NS, "done"))
    assert got == "Succeeded" and kube.job_status(NS, "done")["phase"] == "Succeeded"
    got = await rljobs.reconcile(ctx, await ctx.client.get_custom("rljobs", NS, "rl-done"))
    assert got == "Failed" and kube.job_status(NS, "rl-done", "rljobs")["phase"] == "Failed"
    assert kube.pods(NS, "done") == [] and kube.pods(NS, "rl-done") == []
