"""Predictive scaling of an InferenceJob (`autoscaling.forecast`): real kopf against KMock, the
job's request rate read from Prometheus's HTTP API (tests/prometheus_api.py, real HTTP), and the
prediction board's forecast peak as a floor of the replicas.

No replica is serving here: the replicas are raised before any of them measures load, which is
the point of a forecast (a replica takes minutes to load a model).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import prometheus_api
import pydantic
import pytest
from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

from huorn.api.inference import InferenceJobSpec, ReplicaForecastReading

pytest_plugins = ["kube.fixtures"]

NS = "team"
IJ = "inferencejobs"


@pytest.fixture()
def prometheus() -> Iterator[prometheus_api.PrometheusApi]:
    with prometheus_api.serve() as api:
        api.rate = lambda t: 25.0
        yield api


def status(kube: builders.Kube) -> dict:
    return kube.job_status(NS, "chat", IJ)


def events(kube: builders.Kube, reason: str) -> list:
    return [e for e in kube.events(NS, "chat") if e.reason == reason]


def servers(kube: builders.Kube) -> list[str]:
    return sorted(p.metadata.labels["huorn.io/instance"] for p in kube.pods(NS, "chat", "server")
                  if not p.metadata.deletion_timestamp)


def test_the_forecast_raises_an_idle_job_and_reclaims_lent_gpus_before_the_load_comes(
    cluster: EmulatedCluster, kube: builders.Kube, prometheus: prometheus_api.PrometheusApi
) -> None:
    """25 requests/s forecast at 10 a replica: 3 replicas of 2 GPUs before any request. Their
    GPUs are on loan, so the serving cluster shrinks its borrower; when Prometheus fails the
    replicas stay and one Warning says why; without the field the floor and the status go."""
    settings = dataclasses.replace(operator_mod.FAST, autoscale_seconds=0.5)
    kube.custom.patch_cluster_custom_object(
        builders.GROUP, builders.VERSION, "virtualclusters", "serve",
        {"spec": {"purpose": "inference", "lending": {
            "lendable": True, "maxGPUsLent": 4, "reclaimGraceSeconds": 30, "reclaimPolicy": "Shrink"}}})
    forecast = {"prometheusURL": prometheus.url,
                "query": 'sum(rate(huorn_serve_requests_total{job="chat"}[5m]))',
                "requestsPerReplica": 10, "history": "6h"}
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        serving.borrow_four_gpus_of_b0(kube, NS)
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
            {"spec": {"elasticity": {"minReplicas": 1}}})  # room to shrink
        autoscaling = {"minReplicas": 1, "maxReplicas": 4, "forecast": forecast}
        kube.create_job(NS, serving.make_inference_job("chat", "serve", autoscaling=autoscaling), plural=IJ)

        (up,) = wait_for(lambda: events(kube, "ScaledUp"), what="chat scaled up on its forecast")
        assert up.message == ("autoscaler: forecast peak 25 requests/s over the next 10 minutes needs 3 "
                              "replica(s) at 10 each: 1 → 3 replica(s)")
        now = wait_for(lambda: (s := status(kube)).get("forecast") and s, what="the forecast in status")
        reading = ReplicaForecastReading.model_validate(now["forecast"])  # the CRD's status schema
        assert (reading.replicas, reading.model, reading.history_bins) == (3, "fitted", 73)  # 6 h of 5 min
        assert reading.requests_per_second == 25 and reading.error is None
        assert now["desiredReplicas"] == 3
        query = prometheus.queries[-1]
        assert query["query"] == forecast["query"] and query["step"] == "300"

        # 6 GPUs on b0 for chat: the borrower gives back one replica of 2 GPUs, and all three land.
        wait_for(lambda: serving.nodes_of(kube, NS, "elastic") == ["b0"], what="the borrower shrunk")
        (shrink,) = serving.resize_decisions(kube, NS, "elastic")
        assert "serve reclaims 2 GPU(s)" in shrink["reason"]
        wait_for(lambda: servers(kube) == ["server-0", "server-1", "server-2"], what="three replicas placed")

        # Prometheus fails: the replicas stay, one Warning names the field, status carries the error.
        prometheus.fail = (503, "query timed out")
        (warning,) = wait_for(lambda: events(kube, "ForecastUnavailable"), what="the warning")
        assert warning.type == "Warning"
        assert warning.message == ("Prometheus at spec.autoscaling.forecast.prometheusURL is unavailable "
                                   "(503: query timed out); reading it again at the next tick; keeping the "
                                   "last forecast, 3 replica(s)")
        wait_for(lambda: (status(kube).get("forecast") or {}).get("error") == warning.message,
                 what="the error in status")
        assert status(kube)["desiredReplicas"] == 3 and len(events(kube, "ForecastUnavailable")) == 1

        # It answers again: one Normal event, and the error leaves status (a merge patch deletes a
        # key only when it is written as null).
        prometheus.fail = None
        (back,) = wait_for(lambda: events(kube, "ForecastAvailable"), what="the forecast back")
        assert back.message == ("reading spec.autoscaling.forecast.query again: 3 replica(s) for 25 "
                                "requests/s")
        wait_for(lambda: "error" not in status(kube)["forecast"], what="the error cleared in status")

        # Without the field: no board, and its reading leaves status.
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, IJ, "chat", {"spec": {"autoscaling": {"forecast": None}}})
        wait_for(lambda: "forecast" not in status(kube), what="the forecast gone from status")
        assert len(events(kube, "ScaledUp")) == 1 and status(kube)["desiredReplicas"] == 3


@pytest.mark.parametrize(("field", "value", "words"), [
    ("requestsPerReplica", 0, "greater than 0"),
    ("prometheusURL", "prometheus:9090", "should match pattern"),
    ("quantile", 0.3, "greater than or equal to 0.5"),
])
def test_a_bad_forecast_is_refused_naming_its_field(field: str, value: object, words: str) -> None:
    forecast = {"prometheusURL": "http://prometheus.monitoring:9090", "query": "q", "requestsPerReplica": 10,
                field: value}
    spec = serving.make_inference_job("chat", "serve", autoscaling={"maxReplicas": 4, "forecast": forecast})
    with pytest.raises(pydantic.ValidationError) as err:
        InferenceJobSpec.model_validate(spec["spec"])
    (error,) = err.value.errors()
    assert error["loc"] == ("autoscaling", "forecast", field) and words in error["msg"], error


def test_a_restarted_operator_keeps_the_forecast_floor_while_prometheus_is_down(
    cluster: EmulatedCluster, kube: builders.Kube, prometheus: prometheus_api.PrometheusApi
) -> None:
    """The board's reading lives in the operator's memory and in status.forecast. A new operator
    that cannot read Prometheus starts from status: the floor of 3 replicas holds and the reading
    stays in status, with the error. Before, it started from nothing, wrote `forecast: null` on
    its first tick, and the floor was gone until Prometheus answered again."""
    settings = dataclasses.replace(operator_mod.FAST, autoscale_seconds=0.5)
    forecast = {"prometheusURL": prometheus.url, "requestsPerReplica": 10, "history": "6h",
                "query": 'sum(rate(huorn_serve_requests_total{job="chat"}[5m]))'}
    autoscaling = {"minReplicas": 1, "maxReplicas": 4, "forecast": forecast, "scaleDownDelaySeconds": 1}
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        kube.create_job(NS, serving.make_inference_job("chat", "serve", autoscaling=autoscaling), plural=IJ)
        wait_for(lambda: (status(kube).get("forecast") or {}).get("replicas") == 3, what="the forecast")
        assert status(kube)["desiredReplicas"] == 3
    prometheus.fail = (503, "storage unavailable")
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        asked = len(prometheus.queries)
        (warning,) = wait_for(lambda: events(kube, "ForecastUnavailable"), what="the warning")
        assert warning.message.endswith("; keeping the last forecast, 3 replica(s)"), warning.message
        wait_for(lambda: "storage unavailable" in (status(kube).get("forecast") or {}).get("error", ""),
                 what="the error beside the kept reading")
        # past the 1 s scale-down window: six more ticks, each asking Prometheus in vain
        wait_for(lambda: len(prometheus.queries) >= asked + 6, what="six ticks without Prometheus")
        kept = status(kube)
        assert kept["forecast"]["replicas"] == 3 and kept["desiredReplicas"] == 3
