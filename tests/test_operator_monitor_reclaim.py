"""Loan reclaim in the cluster: an inference VirtualCluster's demand shrinks the borrowing trainer.

Real kopf against KMock. Training's own cluster (a0, a1: 8 GPUs) is filled by a fixed job, so an
elastic job borrows 4 GPUs on the serving cluster's b0. An InferenceJob in the serving cluster
then needs 6 of b0's 8 GPUs: 2 must come back.
"""

from __future__ import annotations

from pathlib import Path

import prometheus_api
import yaml
from kube import builders, serving
from kube.cluster import wait_for

pytest_plugins = ["kube.fixtures"]

NS = "team"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "inference-job.yaml"


def make_inference_job(name: str, vc: str, replicas: int, gpus: int) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": name}
    body["spec"]["virtualCluster"] = vc
    body["spec"]["resources"]["gpus"] = gpus
    body["spec"]["autoscaling"] = {"minReplicas": replicas, "maxReplicas": replicas}
    return body


def nodes_of(kube: builders.Kube, job: str) -> list[str]:
    return serving.nodes_of(kube, NS, job)


def resize_decisions(kube: builders.Kube, job: str) -> list[dict]:
    return serving.resize_decisions(kube, NS, job)


def borrow_four_gpus_of_b0(kube: builders.Kube) -> None:
    serving.borrow_four_gpus_of_b0(kube, NS)


def lend_four_for_inference(kube: builders.Kube, reclaim_policy: str) -> None:
    """The serving cluster made an inference one that lends 4 GPUs, reclaimed within 45 s."""
    kube.custom.patch_cluster_custom_object(
        builders.GROUP, builders.VERSION, "virtualclusters", "serve",
        {"spec": {"purpose": "inference", "lending": {"lendable": True, "maxGPUsLent": 4,
                                                        "reclaimGraceSeconds": 45,
                                                        "reclaimPolicy": reclaim_policy}}})


def test_inference_demand_reclaims_lent_gpus_by_shrinking_the_borrower(kube: builders.Kube, operator) -> None:
    lend_four_for_inference(kube, "Shrink")
    borrow_four_gpus_of_b0(kube)

    # At minReplicas nothing can be given back gracefully, and this lender does not preempt:
    # it is told why.
    kube.custom.create_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, "inferencejobs", make_inference_job("chat", "serve", 3, 2))
    blocked = wait_for(lambda: [e for e in kube.events("default", "serve") + kube.events(NS, "serve")
                                if e.reason == "ReclaimBlocked"], what="ReclaimBlocked on serve")
    assert "team/elastic" in blocked[0].message and nodes_of(kube, "elastic") == ["b0", "b0"]

    # Room to shrink: one replica (2 GPUs) goes, the one with the least lost work.
    kube.custom.patch_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
        {"spec": {"elasticity": {"minReplicas": 1}}})
    wait_for(lambda: nodes_of(kube, "elastic") == ["b0"], what="the borrower shrunk to one replica")
    (shrink,) = resize_decisions(kube, "elastic")
    assert shrink["reason"].startswith("reclaim: serve reclaims 2 GPU(s)")
    assert "team/elastic gives back 2" in shrink["reason"]
    assert [p.metadata.name for p in kube.pods(NS, "elastic", "trainer")] == ["elastic-trainer-0"]
    wait_for(lambda: kube.has_event(NS, "elastic", "Reclaim"), what="the Reclaim event")
    wait_for(lambda: kube.get_vc("serve").get("status", {}).get("lent") == 2, what="serve lends 2")
    wait_for(lambda: kube.get_vc("train").get("status", {}).get("borrowed") == 2, what="train borrows 2")
    # Paid back: later VC ticks reclaim nothing more.
    wait_for(lambda: kube.job_status(NS, "elastic").get("phase") == "Running", what="Running at 1")
    assert len(resize_decisions(kube, "elastic")) == 1
    # The InferenceJob's third replica waited for those GPUs, and takes them.
    wait_for(lambda: len(kube.pods(NS, "chat", "server")) == 3, what="the third replica placed")
    assert {p.metadata.annotations["huorn.io/node"] for p in kube.pods(NS, "chat", "server")} == {"b0"}


def test_an_inference_clusters_demand_is_not_lent_to_a_new_borrower(kube: builders.Kube, operator) -> None:
    """With an InferenceJob already needing 6 of b0's 8 GPUs, a training job that would have to
    borrow 4 of them waits instead of being placed and reclaimed at once; when the InferenceJob
    goes, its GPUs can be lent again and the job starts there."""
    kube.custom.patch_cluster_custom_object(
        builders.GROUP, builders.VERSION, "virtualclusters", "serve",
        {"spec": {"purpose": "inference", "lending": {"lendable": True, "maxGPUsLent": 8}}})
    kube.create_job(NS, builders.make_training_job("fill", "train", replicas=2, max_replicas=2, gpus=4))
    wait_for(lambda: len(kube.pods(NS, "fill", "trainer")) == 2, what="the filler's pods")
    kube.custom.create_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, "inferencejobs", make_inference_job("chat", "serve", 3, 2))
    wait_for(lambda: len(kube.pods(NS, "chat", "server")) == 3, what="the InferenceJob's 3 replicas on b0")
    kube.create_job(NS, builders.make_training_job("late", "train", replicas=2, max_replicas=2, gpus=2))
    # the reconcile tried to place it, knowing the demand, and found no room: an Unplaceable
    # Event, and no pod on the 6 GPUs the InferenceJob needs
    (refused, *_) = wait_for(lambda: [e for e in kube.events(NS, "late") if e.reason == "Unplaceable"],
                             what="late refused a placement")
    assert "lendable by other virtual clusters 2" in refused.message  # 8 − the 6 its replicas hold
    assert kube.job_status(NS, "late").get("phase") == "Pending"
    assert kube.pods(NS, "late", "trainer") == []
    assert kube.get_vc("serve").get("status", {}).get("lent", 0) == 0
    kube.custom.delete_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "inferencejobs", "chat")
    wait_for(lambda: nodes_of(kube, "late") == ["b0", "b0"], what="late placed on b0 once the demand is gone")



def test_a_borrower_that_cannot_shrink_is_preempted_and_requeued(kube: builders.Kube, operator) -> None:
    """reclaimPolicy Preempt (the default): a fixed gang borrowing b0 is stopped when the serving
    cluster needs its GPUs. Every trainer pod goes (a gang missing members would only wait at its
    rendezvous), the successors wait off the reserved GPUs, the restart budget is untouched, and
    the gang starts again once the demand is gone."""
    kube.custom.patch_cluster_custom_object(
        builders.GROUP, builders.VERSION, "virtualclusters", "serve",
        {"spec": {"purpose": "inference", "lending": {"lendable": True, "maxGPUsLent": 8,
                                                        "reclaimGraceSeconds": 45}}})
    kube.create_job(NS, builders.make_training_job("fill", "train", replicas=2, max_replicas=2, gpus=4))
    wait_for(lambda: len(kube.pods(NS, "fill", "trainer")) == 2, what="the filler's pods")
    kube.create_job(NS, builders.make_training_job("gang", "train", replicas=2, max_replicas=2, gpus=2))
    wait_for(lambda: nodes_of(kube, "gang") == ["b0", "b0"], what="the fixed gang borrowing b0")
    kube.run_all_pods(NS, "gang")
    first = sorted(p.metadata.name for p in kube.pods(NS, "gang", "trainer"))

    kube.custom.create_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, "inferencejobs", make_inference_job("chat", "serve", 3, 2))
    wait_for(lambda: [e for e in kube.events(NS, "gang") if e.reason == "Preempted"], what="gang preempted")
    wait_for(lambda: kube.pods(NS, "gang", "trainer") == [], what="every trainer pod of the gang gone")
    status = kube.job_status(NS, "gang")
    assert status.get("preemptReplacements") == 2
    replaced = [d for d in status.get("decisions") or [] if d["action"] == "replace"]
    assert len(replaced) == 2 and all(d["reason"].startswith("preempted: serve reclaims") for d in replaced)
    # its successors do not go back onto the 6 GPUs the InferenceJob needs
    wait_for(lambda: [e for e in kube.events(NS, "gang") if e.reason == "Unplaceable"], what="gang waits")
    assert kube.pods(NS, "gang", "trainer") == []
    # the lender's Event is written after the gang's, so it is waited for, not read once
    wait_for(lambda: any(e.reason == "Reclaimed" and "(preempted)" in e.message
                         for e in kube.events("default", "serve") + kube.events(NS, "serve")),
             what="the lender's Reclaimed event naming the preemption")

    kube.custom.delete_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "inferencejobs", "chat")
    wait_for(lambda: nodes_of(kube, "gang") == ["b0", "b0"], what="the gang placed again")
    second = sorted(p.metadata.name for p in kube.pods(NS, "gang", "trainer"))
    assert not set(first) & set(second)  # a new generation of pods
    kube.run_all_pods(NS, "gang")
    wait_for(lambda: kube.job_status(NS, "gang").get("phase") == "Running", what="gang Running again")


def test_the_forecast_request_rate_reclaims_without_any_inference_job(kube: builders.Kube, operator) -> None:
    """lending.forecast: the serving cluster's rate, read from Prometheus, is the demand. Idle, it
    lends; when the rate reaches 50 requests/s at 10 a GPU (6 GPUs with 10 % headroom), 2 of the 4
    lent GPUs come back from the elastic borrower, named as the forecast's, and the cluster's
    status carries the reading. No InferenceJob is involved: the serving stack is whatever feeds
    Prometheus."""
    with prometheus_api.serve() as prometheus:
        prometheus.rate = lambda t: 0.0
        kube.custom.patch_cluster_custom_object(
            builders.GROUP, builders.VERSION, "virtualclusters", "serve",
            {"spec": {"purpose": "inference", "lending": {
                "lendable": True, "maxGPUsLent": 8, "reclaimGraceSeconds": 45, "reclaimPolicy": "Shrink",
                "forecast": {"prometheusURL": prometheus.url, "query": "sum(rate(requests_total[5m]))",
                             "requestsPerGPU": 10, "headroom": 0.1}}}})
        wait_for(lambda: (kube.get_vc("serve").get("status", {}).get("forecast") or {}).get("gpus") == 0,
                 what="serve's board reads an idle rate")
        borrow_four_gpus_of_b0(kube)
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
            {"spec": {"elasticity": {"minReplicas": 1}}})  # room to shrink

        prometheus.rate = lambda t: 50.0
        wait_for(lambda: nodes_of(kube, "elastic") == ["b0"], what="the borrower shrunk for the forecast")
        (shrink,) = resize_decisions(kube, "elastic")
        assert "its forecast request rate needs 6 GPU(s) (spec.lending.forecast)" in shrink["reason"]
        def reading() -> dict:
            return kube.get_vc("serve").get("status", {}).get("forecast") or {}

        wait_for(lambda: reading().get("gpus") == 6, what="the reading in status")
        assert reading()["requestsPerSecond"] == 50.0 and "error" not in reading()
        gauge = {"virtual_cluster": "serve", "state": "forecast"}
        wait_for(lambda: operator.ctx.metrics.value("huorn_virtualcluster_gpus", gauge) == 6, what="gauge")
        wait_for(lambda: kube.get_vc("serve").get("status", {}).get("lent") == 2, what="serve lends 2")
        assert prometheus.queries and all(q["step"] == "300" for q in prometheus.queries)

        # Prometheus gone: the last forecast stays in force, and the cluster says why
        prometheus.fail = (503, "storage unavailable")
        warning = wait_for(lambda: [e for e in kube.events("default", "serve") + kube.events(NS, "serve")
                                    if e.reason == "ForecastUnavailable"], what="ForecastUnavailable")
        assert "storage unavailable" in warning[0].message
        assert "keeping the last forecast, 6 GPU(s)" in warning[0].message
        assert nodes_of(kube, "elastic") == ["b0"] and len(resize_decisions(kube, "elastic")) == 1
        wait_for(lambda: "storage unavailable" in reading().get("error", ""), what="the error in status")
        assert reading()["gpus"] == 6
        # and back: the error leaves status (written as null: a merge patch keeps a key left out)
        prometheus.fail = None
        wait_for(lambda: "error" not in reading(), what="the error cleared in status")
        assert reading()["gpus"] == 6


def test_a_borrower_whose_spec_no_longer_validates_is_still_reclaimed(kube: builders.Kube, operator) -> None:
    """Its spec broken after it started (here minReplicas above maxReplicas; in a cluster, a rule
    a newer operator added): the job is Stalled, its pods still hold the lender's GPUs. Before,
    the lender's reclaim raised on it at every tick, and no reclaim of that lender ever ran."""
    lend_four_for_inference(kube, "Preempt")
    borrow_four_gpus_of_b0(kube)
    kube.custom.patch_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
        {"spec": {"elasticity": {"minReplicas": 3}}})
    wait_for(lambda: kube.job_status(NS, "elastic").get("phase") == "Stalled", what="the borrower Stalled")
    assert nodes_of(kube, "elastic") == ["b0", "b0"]
    kube.custom.create_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, "inferencejobs", make_inference_job("chat", "serve", 3, 2))
    wait_for(lambda: len(kube.pods(NS, "chat", "server")) == 3, what="the third replica, on GPUs taken back")
    assert {p.metadata.annotations["huorn.io/node"] for p in kube.pods(NS, "chat", "server")} == {"b0"}
    assert nodes_of(kube, "elastic") == [], "reclaimed as a fixed gang: stopped whole"
