"""End to end on a real cluster (kind or any other), skipped unless HUORN_E2E_KUBECONFIG is set.

    kind create cluster --name huorn
    kind get kubeconfig --name huorn > /tmp/huorn-e2e.kubeconfig
    kubectl --kubeconfig /tmp/huorn-e2e.kubeconfig apply -f crds/
    docker build -t ghcr.io/huorn-io/huorn:0.1.0 .
    kind load docker-image ghcr.io/huorn-io/huorn:0.1.0 --name huorn
    HUORN_E2E_KUBECONFIG=/tmp/huorn-e2e.kubeconfig .venv/bin/pytest -q tests/e2e

The operator runs in this process (a thread) against the cluster, exactly as `huorn operator
--kubeconfig` would. kind nodes have no GPUs, so the jobs ask for 0 GPUs: placement, pinning,
the rendezvous Service, status and cleanup are what is checked, with the real scheduler, kubelet
and garbage collector in the loop. HUORN_E2E_IMAGE overrides the image of the job pods.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

KUBECONFIG = os.environ.get("HUORN_E2E_KUBECONFIG")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not KUBECONFIG, reason="set HUORN_E2E_KUBECONFIG to a cluster's kubeconfig to run e2e"
    ),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kube import builders  # noqa: E402
from kube.cluster import wait_for  # noqa: E402
from kube.operator import OperatorThread  # noqa: E402

from huorn.backends.kubernetes import client as kube_client  # noqa: E402
from huorn.operator import context  # noqa: E402

TIMEOUT = 300.0


@pytest.fixture(scope="module")
def api():
    return kube_client.build_api_client(KUBECONFIG)


@pytest.fixture()
def namespace(api) -> Iterator[str]:
    k = builders.Kube(api)
    name = f"huorn-e2e-{uuid.uuid4().hex[:6]}"
    k.core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    yield name
    k.core.delete_namespace(name)


@pytest.fixture()
def virtual_cluster(api) -> Iterator[str]:
    k = builders.Kube(api)
    nodes = [n.metadata.name for n in k.core.list_node().items]
    name = f"e2e-{uuid.uuid4().hex[:6]}"
    k.create_vc(builders.make_virtual_cluster(name, nodes=nodes))
    yield name
    k.custom.delete_cluster_custom_object("huorn.io", "v1alpha1", "virtualclusters", name)


@pytest.fixture()
def operator(api) -> Iterator[OperatorThread]:
    with OperatorThread(api, context.OperatorSettings(resync_seconds=5, vc_status_seconds=5)) as op:
        yield op


def test_job_is_placed_pinned_scheduled_and_cleaned_up(api, namespace, virtual_cluster, operator) -> None:
    k = builders.Kube(api)
    body = builders.make_training_job("e2e", virtual_cluster, replicas=2, gpus=0)
    body["spec"].pop("checkpoint")
    if os.environ.get("HUORN_E2E_IMAGE"):
        body["spec"]["image"] = os.environ["HUORN_E2E_IMAGE"]
    k.create_job(namespace, body)
    pods = wait_for(
        lambda: len(k.pods(namespace, "e2e", "trainer")) == 2 and k.pods(namespace, "e2e", "trainer"),
        TIMEOUT,
        "2 trainer pods",
    )
    for pod in pods:
        pinned = pod.metadata.annotations["huorn.io/node"]
        scheduled = wait_for(
            lambda p=pod: k.core.read_namespaced_pod(p.metadata.name, namespace).spec.node_name,
            TIMEOUT,
            "the scheduler to bind the pod",
        )
        assert scheduled == pinned, "the real scheduler honours Huorn's node affinity"
    assert k.core.read_namespaced_service("e2e-rdzv", namespace).spec.cluster_ip == "None"
    vc = wait_for(lambda: (k.get_vc(virtual_cluster).get("status") or {}).get("nodes"), TIMEOUT, "VC status")
    assert vc >= 1
    k.delete_job(namespace, "e2e")
    wait_for(lambda: not k.job_exists(namespace, "e2e"), TIMEOUT, "the finalizer to finish")
    wait_for(
        lambda: k.children(namespace, "e2e") == {"pods": [], "services": [], "configmaps": []},
        TIMEOUT,
        "every child gone",
    )


def test_scale_subresource_works_with_kubectl_semantics(api, namespace, virtual_cluster, operator) -> None:
    k = builders.Kube(api)
    body = builders.make_training_job("scaled", virtual_cluster, replicas=1, gpus=0)
    body["spec"].pop("checkpoint")
    k.create_job(namespace, body)
    wait_for(lambda: len(k.pods(namespace, "scaled", "trainer")) == 1, TIMEOUT, "1 trainer pod")
    k.scale(namespace, "scaled", 3)  # what `kubectl scale trainingjob/scaled --replicas=3` sends
    wait_for(lambda: len(k.pods(namespace, "scaled", "trainer")) == 3, TIMEOUT, "3 trainer pods")
    status = wait_for(lambda: k.job_status(namespace, "scaled").get("decisions"), TIMEOUT, "a decision")
    assert status[-1]["action"] == "resize"
