"""The activator of a scaled-to-zero InferenceJob, as real processes: it holds a request while no
replica answers, says so on /metrics (what the autoscaler scales on), and answers it from the
first replica that comes up; past activationTimeoutSeconds it answers 503 naming the field."""

from __future__ import annotations

import concurrent.futures
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from kube import serving
from kube.cluster import wait_for

from huorn.backends import replica_metrics

REPLICA_IP, ACTIVATOR_IP = "127.0.0.2", "127.0.0.6"


@pytest.fixture()
def replicas(tmp_path: Path) -> Iterator[serving.Replicas]:
    r = serving.Replicas(serving.save_tiny_model(tmp_path / "ckpt"), tmp_path / "run")
    yield r
    r.close()


def held(url: str) -> float | None:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        return replica_metrics.parse_held(answer.read().decode())


def test_a_request_is_held_until_a_replica_serves_it(tmp_path: Path, replicas: serving.Replicas) -> None:
    activator = serving.Activator(tmp_path / "activator", ACTIVATOR_IP, f"http://{REPLICA_IP}:{replicas.port}")
    try:
        assert held(activator.url) == 0
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(serving.complete, activator.url)
            wait_for(lambda: held(activator.url) == 1, what="the request held")
            assert not answer.done()  # nothing serves yet: no replica at the upstream
            replicas.start(REPLICA_IP)  # a replica loads its model, as after a scale-up from zero
            status, body = answer.result(timeout=120)
        assert status == 200 and body["tokens"] > 0 and isinstance(body["text"], str)
        assert held(activator.url) == 0
        # with a replica up the activator forwards at once
        assert serving.complete(activator.url, timeout=30)[0] == 200
    finally:
        activator.close()


def test_a_request_held_past_the_timeout_gets_503_naming_the_field(tmp_path: Path) -> None:
    nowhere = "http://127.0.0.7:9"  # nothing listens: no replica will ever answer
    activator = serving.Activator(tmp_path / "activator", ACTIVATOR_IP, nowhere, timeout_seconds=2.0)
    try:
        status, body = serving.complete(activator.url, timeout=30)
        assert status == 503 and "spec.autoscaling.activationTimeoutSeconds" in body["error"]
        with urllib.request.urlopen(f"{activator.url}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        assert 'huorn_activator_requests_total{outcome="timeout"} 1.0' in text
    finally:
        activator.close()
