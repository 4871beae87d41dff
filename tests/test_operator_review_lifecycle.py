"""Review findings on a TrainingJob's and an RLJob's life cycle: real kopf against the KMock emulator.

A pod that never starts in a gang that fills its virtual cluster, and the terminal conditions
(Succeeded, Failed) that `kubectl wait` reads. Pod phases are driven by PATCHing pods, as a kubelet
would report them; waits poll the API with a deadline, since the operator works in its own thread.
"""

from __future__ import annotations

import dataclasses

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

pytest_plugins = ["kube.fixtures"]

NS = "team"


def _hold_pending(kube: builders.Kube, pod: str) -> None:
    """What the kubelet reports of a container whose image cannot be pulled."""
    waiting = {"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
         "state": {"waiting": {"reason": "ErrImagePull", "message": "manifest unknown"}}}]}
    kube.core.patch_namespaced_pod_status(pod, NS, {"status": waiting})


def test_a_never_started_pod_of_a_gang_that_fills_its_cluster_is_replaced_then_fails_the_job(
        cluster: EmulatedCluster) -> None:
    """Its own GPUs are the only ones its successor can have: before, the successor's placement
    counted them as taken, nothing was recorded, and the job waited Unplaceable forever."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(builders.make_node("a0", 4, pool="a"))
    kube.create_vc(builders.make_virtual_cluster("solo", pool="a"))
    settings = dataclasses.replace(operator_mod.FAST, trainer_start_seconds=2.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        body = builders.make_training_job("llm", "solo", replicas=1, max_replicas=1, gpus=4)
        body["spec"]["remediation"] = {"maxRestarts": 1}
        kube.create_job(NS, body)
        wait_for(lambda: len(kube.pods(NS, "llm")) == 2, what="the store pod and the trainer pod")
        kube.set_pod_phase(NS, "llm-rendezvous-0", "Running")
        _hold_pending(kube, "llm-trainer-0")
        wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "llm", "trainer")] == ["llm-trainer-0-g1"],
                 what="the stuck pod replaced by its successor", timeout=30)
        status = kube.job_status(NS, "llm")
        assert [d["action"] for d in status["decisions"]] == ["replace"]
        assert "pod llm-trainer-0 did not start within 2 s (ErrImagePull: manifest unknown)" in (
            status["decisions"][0]["reason"])
        assert status["restartsUsed"] == 1
        _hold_pending(kube, "llm-trainer-0-g1")
        status = wait_for(lambda: (s := kube.job_status(NS, "llm")).get("phase") == "Failed" and s,
                          what="Failed once the budget is spent", timeout=30)
        why = status["message"]
        assert "llm-trainer-0-g1 did not start within 2 s (ErrImagePull: manifest unknown)" in why
        assert "replacement budget of 1 used up" in why
        assert status["restartsUsed"] == 1 and [d["action"] for d in status["decisions"]] == ["replace"]
        wait_for(lambda: kube.pods(NS, "llm", "trainer") == [], what="the GPUs given back")
