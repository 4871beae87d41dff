"""kopf's liveness endpoint, which the Helm chart's probes read: answered from the operator's own
event loop once its startup handlers are done (the metrics port, served by a thread of its own,
answered even while that loop was stuck)."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from kube.cluster import EmulatedCluster, wait_for
from kube.operator import OperatorThread

pytest_plugins = ["kube.fixtures"]


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return json.loads(answer.read()) if answer.status == 200 else None
    except (urllib.error.URLError, ConnectionError):
        return None


def test_the_health_endpoint_answers_while_the_operator_runs_and_not_after(cluster: EmulatedCluster) -> None:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with OperatorThread(cluster.api_client(), health_port=port):
        wait_for(lambda: _health(port) is not None, what="/healthz answered")
    assert _health(port) is None, "a stopped operator must fail its probe"
