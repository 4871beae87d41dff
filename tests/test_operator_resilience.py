"""The operator converges through API errors and through being killed at random moments.

Errors are injected with KMock's own reactions. NB: KMock applies a write to its store before it
answers with an injected error, which is what a real server does when it commits and then times
out; so a retried create meets 409 AlreadyExists and must patch instead, which is the idempotency
this file checks. The kill test runs the operator as `huorn operator` in a child process and
SIGKILLs it, so nothing survives in memory: every decision must come back from the API objects.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import kmock
import pytest
from kube import builders
from kube.cluster import EmulatedCluster, wait_for
from kube.operator import OperatorProcess

pytest_plugins = ["kube.fixtures"]

NS = "team"
TRAINING = kmock.resource("huorn.io", "v1alpha1", "trainingjobs")
PODS = kmock.resource("", "v1", "pods")


def _running(kube: builders.Kube, name: str, trainers: int, timeout: float = 60) -> dict:
    wait_for(lambda: len(kube.pods(NS, name, "trainer")) == trainers, timeout, f"{trainers} trainer pods")
    kube.run_all_pods(NS, name)
    return wait_for(
        lambda: (
            (s := kube.job_status(NS, name)).get("phase") == "Running" and s.get("replicas") == trainers and s
        ),
        timeout,
        "phase Running",
    )


async def _slow() -> None:
    await asyncio.sleep(1.0)
    raise NotImplementedError  # KMock: no answer here, fall through to the emulator's own


def test_injected_409_429_500_and_slow_answers_converge(
    cluster: EmulatedCluster, kube: builders.Kube, operator
):
    km = cluster.kmock
    km["post", PODS][:2].override << 500
    km["patch", PODS][:2].override << 409
    km["patch", TRAINING][:3].override << 429
    km["post", kmock.resource("", "v1", "configmaps")][:1].override << 503
    km["get", TRAINING][:4].override << _slow
    kube.create_job(NS, builders.make_training_job("tough", "train", replicas=2, gpus=2))
    status = _running(kube, "tough", 2)
    assert [p.metadata.name for p in kube.pods(NS, "tough")] == [
        "tough-rendezvous-0",
        "tough-trainer-0",
        "tough-trainer-1",
    ], "no duplicate pods after retried creates"
    assert status["decisions"] == []
    # Only Huorn's client creates pods and ConfigMaps, so it met those three injected errors
    # itself; kopf's own patches may take some of the 409s and 429s, depending on timing.
    assert operator.ctx.client.retries >= 3, "the injected errors were answered and retried"
    kube.scale(NS, "tough", 3)
    _running(kube, "tough", 3)
    assert [d["action"] for d in kube.job_status(NS, "tough")["decisions"]] == ["resize"]


def _state(kube: builders.Kube, name: str) -> dict:
    """What must come out the same however often the operator died: children, placement, log."""
    status = kube.job_status(NS, name)
    return {
        "pods": [
            (p.metadata.name, (p.metadata.annotations or {}).get("huorn.io/node"))
            for p in kube.pods(NS, name)
        ],
        "children": kube.children(NS, name),
        "phase": status.get("phase"),
        "replicas": status.get("replicas"),
        "decisions": [(d["action"], d["reason"]) for d in status.get("decisions", [])],
        "graphVersion": status["graph"]["version"],
    }


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_operator_killed_at_random_points_reaches_the_same_end_state(
    cluster: EmulatedCluster,
    kube: builders.Kube,
    tmp_path: Path,
    seed: int,
) -> None:
    rng = random.Random(seed)
    assert cluster.kubeconfig is not None
    proc = OperatorProcess(cluster.kubeconfig, tmp_path / "operator.log")

    def bounce() -> None:
        """Kill the operator after a random moment of work and start a fresh one."""
        time.sleep(rng.uniform(0.0, 1.5))
        proc.kill()
        proc.start()

    proc.start()
    try:
        kube.create_job(NS, builders.make_training_job("steady", "train", replicas=2, gpus=1))
        bounce()
        _running(kube, "steady", 2, timeout=120)
        kube.scale(NS, "steady", 3)
        bounce()
        _running(kube, "steady", 3, timeout=120)
        kube.set_pod_phase(NS, "steady-trainer-1", "Failed", exit_code=1)
        bounce()
        wait_for(lambda: any(p.metadata.name == "steady-trainer-1-g1" for p in kube.pods(NS, "steady")), 120)
        _running(kube, "steady", 3, timeout=120)
        bounce()
        time.sleep(3)  # a fresh operator resumes every job: it must find nothing left to do
        end = _state(kube, "steady")
    finally:
        proc.kill()
    assert end["pods"] == [
        ("steady-rendezvous-0", None),
        ("steady-trainer-0", end["pods"][1][1]),
        ("steady-trainer-1-g1", end["pods"][2][1]),
        ("steady-trainer-2", end["pods"][3][1]),
    ]
    assert {node for _, node in end["pods"][1:]} <= {"a0", "a1"}
    assert end["children"]["services"] == ["steady-rdzv"] and end["children"]["configmaps"] == [
        "steady-config"
    ]
    assert (end["phase"], end["replicas"]) == ("Running", 3)
    assert [a for a, _ in end["decisions"]] == ["resize", "replace"], "each decision exactly once"
    assert end["decisions"][0][1].startswith("scale 2→3")
    assert end["graphVersion"] == 3
