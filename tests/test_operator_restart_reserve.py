"""A restarted operator holds an inference cluster's reserve from its first placement.

Real kopf against KMock, two operators one after the other on the same API objects: a killed
operator must resume from them alone. Training's own cluster (a0, a1: 8 GPUs) is filled, so a
training job of 2 replicas × 2 GPUs can only borrow the serving cluster's b0 (8 GPUs), which may
lend them only where its demand leaves room.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import prometheus_api
import pytest
from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, hold_kopf_lists, wait_for

pytest_plugins = ["kube.fixtures"]

NS = "team"


@pytest.fixture()
def prometheus() -> Iterator[prometheus_api.PrometheusApi]:
    with prometheus_api.serve() as api:
        api.rate = lambda t: 50.0  # 6 GPUs at 10 requests/s each with 10 % headroom
        yield api


def serve_spec(**lending: Any) -> dict[str, Any]:
    return {"spec": {"purpose": "inference", "lending": {
        "lendable": True, "maxGPUsLent": 8, "reclaimPolicy": "Shrink", **lending}}}


def forecast_status(kube: builders.Kube) -> dict[str, Any]:
    return kube.get_vc("serve").get("status", {}).get("forecast") or {}


def placement_outcome(kube: builders.Kube, job: str) -> list[Any]:
    """The job's first placement attempt, whichever way it went: a borrower wrongly placed on
    reserved GPUs is reported as such, not as a timeout."""
    return [e for e in kube.events(NS, job) if e.reason in ("Placed", "Unplaceable")]


def fill_training_cluster(kube: builders.Kube) -> None:
    kube.create_job(NS, builders.make_training_job("fill", "train", replicas=2, max_replicas=2, gpus=4))
    wait_for(lambda: len(kube.pods(NS, "fill", "trainer")) == 2, what="the filler's pods on a0, a1")


def test_a_restarted_operator_keeps_the_last_forecast_while_prometheus_is_down(
    cluster: EmulatedCluster, kube: builders.Kube, prometheus: prometheus_api.PrometheusApi
) -> None:
    """Operator A reads 6 GPUs from Prometheus into status.forecast and is stopped. Prometheus
    fails, a borrower of 4 GPUs arrives, and operator B starts: it reserves the 6 GPUs from
    status.forecast (the borrower waits, 2 lendable), keeps the reading in status with the error,
    and replaces it with the fresh reading once Prometheus answers (idle: the borrower starts)."""
    forecast = {"prometheusURL": prometheus.url, "query": "sum(rate(requests_total[5m]))",
                "requestsPerGPU": 10, "headroom": 0.1, "history": "6h"}
    with operator_mod.OperatorThread(cluster.api_client()):
        kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "serve",
                                                serve_spec(forecast=forecast))
        fill_training_cluster(kube)
        wait_for(lambda: forecast_status(kube).get("gpus") == 6, what="operator A's reading in status")
    last = forecast_status(kube)

    prometheus.fail = (503, "storage unavailable")
    kube.create_job(NS, builders.make_training_job("late", "train", replicas=2, max_replicas=2, gpus=2))
    held = hold_kopf_lists(cluster, "virtualclusters")  # B's first board tick comes after late's placement
    with operator_mod.OperatorThread(cluster.api_client()) as operator:
        (outcome, *_) = wait_for(lambda: placement_outcome(kube, "late"), what="late's placement")
        assert outcome.reason == "Unplaceable", outcome.message
        assert "lendable by other virtual clusters 2" in outcome.message  # 8 − the 6 forecast
        assert operator.ctx.index.demand_of("serve") == 6
        wait_for(lambda: "storage unavailable" in forecast_status(kube).get("error", ""),
                 what="operator B's error in status")
        kept = forecast_status(kube)
        assert {k: v for k, v in kept.items() if k != "error"} == last
        assert "keeping the last forecast, 6 GPU(s)" in kept["error"]
        assert kube.pods(NS, "late", "trainer") == []

        # Prometheus answers again, idle: the fresh reading replaces the kept one, and b0 lends.
        prometheus.rate = lambda t: 0.0
        prometheus.fail = None
        wait_for(lambda: serving.nodes_of(kube, NS, "late") == ["b0", "b0"], what="late placed on b0")
        assert forecast_status(kube)["gpus"] == 0 and "error" not in forecast_status(kube)
    assert held


def test_a_restarted_operator_reserves_the_inference_demand_before_its_first_placement(
    cluster: EmulatedCluster, kube: builders.Kube
) -> None:
    """An InferenceJob needing 6 of b0's GPUs and a borrower of 4 both arrive while no operator
    runs. The new operator's watch of InferenceJobs answers late (its first list is held 3 s), as
    a busy API server may: the borrower's placement must still see the demand, so it waits and
    the InferenceJob's three replicas take b0."""
    with operator_mod.OperatorThread(cluster.api_client()):
        kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "serve",
                                                serve_spec())
        fill_training_cluster(kube)
    kube.create_job(NS, serving.make_inference_job("chat", "serve", gpus=2, min_replicas=3, max_replicas=3),
                    plural="inferencejobs")
    kube.create_job(NS, builders.make_training_job("late", "train", replicas=2, max_replicas=2, gpus=2))

    held = hold_kopf_lists(cluster, "inferencejobs")
    with operator_mod.OperatorThread(cluster.api_client()):
        (outcome, *_) = wait_for(lambda: placement_outcome(kube, "late"), what="late's placement")
        assert outcome.reason == "Unplaceable", outcome.message
        assert "lendable by other virtual clusters 2" in outcome.message
        wait_for(lambda: len(kube.pods(NS, "chat", "server")) == 3, what="chat's 3 replicas")
        assert {p.metadata.annotations["huorn.io/node"] for p in kube.pods(NS, "chat", "server")} == {"b0"}
        assert kube.pods(NS, "late", "trainer") == []
    assert held  # the watch's list was held indeed
