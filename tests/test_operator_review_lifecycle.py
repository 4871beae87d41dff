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
        # while its own pod went, the job said so, not that its gang cannot fit
        said = "the successors are placed once the pods they replace are gone (now: needs 4 GPUs"
        wait_for(lambda: kube.has_event(NS, "llm", "Replacing", said), what="the Replacing event")
        _hold_pending(kube, "llm-trainer-0-g1")
        status = wait_for(lambda: (s := kube.job_status(NS, "llm")).get("phase") == "Failed" and s,
                          what="Failed once the budget is spent", timeout=30)
        why = status["message"]
        assert "llm-trainer-0-g1 did not start within 2 s (ErrImagePull: manifest unknown)" in why
        assert "replacement budget of 1 used up" in why
        assert status["restartsUsed"] == 1 and [d["action"] for d in status["decisions"]] == ["replace"]
        wait_for(lambda: kube.pods(NS, "llm", "trainer") == [], what="the GPUs given back")


def _conditions(kube: builders.Kube, name: str, plural: str) -> dict[str, dict]:
    return {c["type"]: c for c in kube.job_status(NS, name, plural).get("conditions") or []}


def _end_pod(kube: builders.Kube, pod: str, phase: str, exit_code: int) -> None:
    """What the kubelet reports when the container ends."""
    terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error"}
    kube.core.patch_namespaced_pod_status(pod, NS, {"status": {"phase": phase, "containerStatuses": [
        {"name": "c", "ready": False, "restartCount": 0, "image": "x", "imageID": "x",
         "state": {"terminated": terminated}}]}})


def _check_terminal(kube: builders.Kube, name: str, plural: str, ended: str, reason: str) -> None:
    """`kubectl wait --for=condition=<ended>` returns, the other terminal condition is absent, and
    a finished job is not Ready, with the same reason, whatever its kind."""
    conds = wait_for(lambda: (c := _conditions(kube, name, plural)).get(ended, {}).get("status") == "True"
                     and c, what=f"the {ended} condition of {plural}/{name}")
    other = "Failed" if ended == "Succeeded" else "Succeeded"
    assert other not in conds
    assert conds[ended]["reason"] == reason
    assert conds[ended]["observedGeneration"] == kube.get_job(NS, name, plural)["metadata"]["generation"]
    assert conds["Ready"]["status"] == "False" and conds["Ready"]["reason"] == reason
    assert kube.job_status(NS, name, plural)["phase"] == ended


def test_finished_jobs_of_either_kind_have_a_terminal_condition(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, builders.make_training_job("done", "train", replicas=1, max_replicas=1, gpus=1))
    kube.create_job(NS, builders.make_training_job("bad", "train", replicas=1, max_replicas=1, gpus=1))
    wait_for(lambda: len(kube.pods(NS, "done")) == 2 and len(kube.pods(NS, "bad")) == 2, what="the pods")
    kube.run_all_pods(NS, "done")
    kube.run_all_pods(NS, "bad")
    wait_for(lambda: all(kube.job_status(NS, n).get("phase") == "Running" for n in ("done", "bad")),
             what="both Running")
    assert "Succeeded" not in _conditions(kube, "done", "trainingjobs")  # not before the end
    kube.set_pod_phase(NS, "done-trainer-0", "Succeeded", exit_code=0)
    kube.set_pod_phase(NS, "bad-trainer-0", "Failed", exit_code=2)  # the runtime refused its config
    _check_terminal(kube, "done", "trainingjobs", "Succeeded", "Succeeded")
    _check_terminal(kube, "bad", "trainingjobs", "Failed", "Failed")

    for name in ("rl-done", "rl-bad"):
        kube.create_job(NS, builders.make_rl_job(name, "train", gpus=2,
                                                 roles={"actorTrain": {"replicas": 1, "gpusPerReplica": 1},
                                                        "rollout": {"replicas": 1, "gpusPerReplica": 1}}),
                        plural="rljobs")
    wait_for(lambda: all(kube.job_status(NS, n, "rljobs").get("phase") == "Pending"
                         and len(kube.pods(NS, n)) >= 2 for n in ("rl-done", "rl-bad")), what="the Ray gangs")
    for name in ("rl-done", "rl-bad"):
        kube.run_all_pods(NS, name)
    wait_for(lambda: all(kube.job_status(NS, n, "rljobs").get("phase") == "Running"
                         for n in ("rl-done", "rl-bad")), what="both RLJobs Running")
    _end_pod(kube, "rl-done-ray-head-0", "Succeeded", 0)
    _end_pod(kube, "rl-bad-ray-head-0", "Failed", 2)
    _check_terminal(kube, "rl-done", "rljobs", "Succeeded", "Succeeded")
    _check_terminal(kube, "rl-bad", "rljobs", "Failed", "Failed")


def test_a_job_ends_once_so_its_terminal_condition_is_kept() -> None:
    """A later write (a reconcile of the finished job, say) keeps the first end, its time too."""
    from huorn.operator import conditions

    first = conditions.build_conditions(None, 1, ready=(False, "Succeeded", "done"),
                                        terminal=(conditions.SUCCEEDED, "Succeeded", "done"))
    ended = next(c for c in first if c["type"] == "Succeeded")
    ended["lastTransitionTime"] = "2026-01-01T00:00:00Z"
    again = conditions.build_conditions(first, 2, ready=(False, "Failed", "x"),
                                        terminal=(conditions.FAILED, "Failed", "x"))
    kept = {c["type"]: c for c in again}
    assert "Failed" not in kept
    assert kept["Succeeded"] == {**ended, "observedGeneration": 2}
    assert "Succeeded" not in {c["type"] for c in conditions.build_conditions(None, 1, ready=(True, "R", ""))}
