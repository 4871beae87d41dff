"""An inference cluster whose service runs on a stack Huorn does not manage (vLLM pods) and whose
`lending.forecast` counts that service's load: the GPUs those pods hold already serve the
forecast. Counted only as taken, they were reserved a second time: with vLLM on 4 of 8 GPUs
and a forecast of 4, the other 4 were never lent (found by a review; real kopf against KMock)."""

from __future__ import annotations

import prometheus_api
from kube import builders
from kube.cluster import wait_for
from test_operator_monitor_reclaim import NS, nodes_of

pytest_plugins = ["kube.fixtures"]


def vllm_pod(name: str, node: str, gpus: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"namespace": NS, "name": name, "labels": {"app": "vllm"}},
            "spec": {"nodeName": node, "containers": [{"name": "vllm", "image": "vllm/vllm-openai",
                     "resources": {"requests": {"nvidia.com/gpu": str(gpus)},
                                   "limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": "Running"}}


def test_gpus_another_serving_stack_holds_meet_the_forecast(kube: builders.Kube, operator) -> None:
    with prometheus_api.serve() as prometheus:
        prometheus.rate = lambda t: 40.0  # 40 requests/s at 10 a GPU: the 4 GPUs vLLM holds
        kube.core.create_namespaced_pod(NS, vllm_pod("vllm-0", "b0", 4))
        kube.custom.patch_cluster_custom_object(
            builders.GROUP, builders.VERSION, "virtualclusters", "serve",
            {"spec": {"purpose": "inference", "lending": {
                "lendable": True, "maxGPUsLent": 8,
                "forecast": {"prometheusURL": prometheus.url, "query": "sum(rate(requests_total[5m]))",
                             "requestsPerGPU": 10, "headroom": 0.0}}}})
        wait_for(lambda: (kube.get_vc("serve").get("status", {}).get("forecast") or {}).get("gpus") == 4,
                 what="the board's reading: 4 GPUs")
        kube.create_job(NS, builders.make_training_job("fill", "train", replicas=2, max_replicas=2, gpus=4))
        wait_for(lambda: len(kube.pods(NS, "fill", "trainer")) == 2, what="the filler's pods")
        kube.create_job(NS, builders.make_training_job("late", "train", replicas=2, max_replicas=2, gpus=2))
        wait_for(lambda: nodes_of(kube, "late") == ["b0", "b0"], what="the late job on b0's 4 idle GPUs")
        # and the forecast, met by vLLM, takes none of them back: ticks after the lender counts
        # them lent, the late job's pods are still there and none is being deleted
        wait_for(lambda: (kube.get_vc("serve").get("status") or {}).get("lent") == 4, what="4 GPUs lent")
        queries = len(prometheus.queries)
        wait_for(lambda: len(prometheus.queries) >= queries + 2, what="two more board readings")
        pods = kube.pods(NS, "late", "trainer")
        assert len(pods) == 2 and not any(p.metadata.deletion_timestamp for p in pods)
