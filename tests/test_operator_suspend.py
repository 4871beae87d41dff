"""spec.suspend of a TrainingJob: real kopf against the KMock emulator, the test playing the kubelet.

Suspending stops every pod of the job gracefully (the trainers checkpoint on SIGTERM and hold their
GPUs until they are gone), frees the GPUs, and keeps the replica count; resuming waits for the
stopped pods, then starts successors under new names from the checkpoint. Neither spends the
replacement budget, and a restarted operator finishes a suspension it decided.
"""

from __future__ import annotations

from typing import Any

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.kubelet import Kubelet

from huorn.graph import managers, mutate, serialise
from huorn.operator import training

pytest_plugins = ["kube.fixtures"]

NS = "team"


def names(kube: builders.Kube, job: str, vertex: str | None = None) -> list[str]:
    return sorted(p.metadata.name for p in kube.pods(NS, job, vertex))


def set_suspend(kube: builders.Kube, job: str, value: bool) -> None:
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs", job,
                                               {"spec": {"suspend": value}})


def write_status(kube: builders.Kube, job: str, status: dict[str, Any]) -> None:
    kube.custom.patch_namespaced_custom_object_status(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                                      job, {"status": status})


def start_eval(kube: builders.Kube, job: str, step: int) -> None:
    """What the monitor writes when the trainers publish a checkpoint: the eval edge fires."""
    g = serialise.from_status(kube.job_status(NS, job)["graph"])
    fired = managers.build_default_managers().dispatch(
        g, managers.Event(managers.EDGE_FIRED, "trainer->eval:checkpoint",
                          {"step": step, "path": f"/checkpoints/step-{step}"}))
    assert [m.action for m in fired] == ["set-param", "activate"]
    write_status(kube, job, {"graph": serialise.to_status(g), "decisions": training.build_decisions(g),
                             "lastCheckpoint": {"step": step, "path": f"/checkpoints/step-{step}"}})


def vc_allocated(kube: builders.Kube) -> int:
    return int((kube.get_vc("train").get("status") or {}).get("allocated", -1))


def test_suspend_checkpoints_frees_the_gpus_and_resume_restarts_at_the_same_size(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        body = builders.make_training_job("s", "train", replicas=2, max_replicas=4, gpus=2)
        body["metadata"]["annotations"] = {"huorn.io/eval": "true"}
        body["spec"]["remediation"] = {"maxRestarts": 1}
        kube.create_job(NS, body)
        wait_for(lambda: len(names(kube, "s", "trainer")) == 2, what="2 trainer pods")
        kube.run_all_pods(NS, "s")
        wait_for(lambda: kube.job_status(NS, "s").get("phase") == "Running", what="Running")
        start_eval(kube, "s", 40)
        wait_for(lambda: names(kube, "s", "eval") != [], what="the eval pod of step 40")
        kube.run_all_pods(NS, "s")
        kubelet.hold(names(kube, "s", "trainer"))
        wait_for(lambda: vc_allocated(kube) == 4, what="4 GPUs allocated")

        set_suspend(kube, "s", True)
        # Every pod is deleted, gracefully: no grace override, the pod's own 30 s applies.
        wait_for(lambda: {n for n, _ in kubelet.deletes()} >= {"s-trainer-0", "s-trainer-1", "s-rendezvous-0"}
                 and names(kube, "s", "eval") == [], what="every pod deleted")
        assert all("gracePeriodSeconds" not in params for _, params in kubelet.deletes())
        status = wait_for(lambda: (s := kube.job_status(NS, "s")).get("phase") == "Suspended" and s,
                          what="Suspended")
        decision = status["decisions"][-1]
        assert decision["action"] == "suspend"
        assert decision["reason"].startswith("spec.suspend is true: stopping 2 trainer replicas; they "
                                             "checkpoint on SIGTERM")
        # The trainers are still checkpointing: they hold their GPUs, and the job says so.
        waiting = "suspended: waiting for 2 pods to checkpoint and exit"
        reconciling = wait_for(lambda: (c := kube.condition(NS, "s", "Reconciling"))["message"] == waiting
                               and c, what="Reconciling while the two trainers stop")
        assert (reconciling["status"], reconciling["reason"]) == ("True", "Suspending")
        assert kube.condition(NS, "s", "Suspended")["status"] == "True"
        assert kube.condition(NS, "s", "Ready")["status"] == "False"
        assert vc_allocated(kube) == 4
        wait_for(lambda: kube.has_event(NS, "s", "Suspended"), what="the Suspended event")

        kubelet.release(["s-trainer-0", "s-trainer-1"])
        wait_for(lambda: names(kube, "s") == [], what="every pod gone")
        status = wait_for(lambda: (s := kube.job_status(NS, "s")).get("replicas") == 0
                          and kube.condition(NS, "s", "Reconciling")["status"] == "False" and s,
                          what="suspended with nothing left")
        assert status["message"] == ("suspended: no pods run and no GPUs are held; set spec.suspend to false "
                                     "to resume from the checkpoint of step 40")
        assert "estimatedRemaining" not in status
        wait_for(lambda: vc_allocated(kube) == 0, what="the GPUs freed")
        # Nothing is started again while the job stays suspended, whatever reconciles it.
        kube.scale(NS, "s", 3)
        wait_for(lambda: kube.job_status(NS, "s").get("observedGeneration")
                 == kube.get_job(NS, "s")["metadata"]["generation"], what="the scale observed")
        assert names(kube, "s") == []

        set_suspend(kube, "s", False)
        # Successors under new names, at the size it had (raised to the new minReplicas, 3).
        wait_for(lambda: names(kube, "s", "trainer") == ["s-trainer-0-g1", "s-trainer-1-g1", "s-trainer-2"],
                 what="the gang back")
        assert names(kube, "s", "rendezvous") == ["s-rendezvous-0-g1"]
        assert names(kube, "s", "eval") == ["s-eval-0-g1-s40"], "the stopped eval runs again"
        status = kube.job_status(NS, "s")
        actions = [d["action"] for d in status["decisions"]]
        assert actions[-3:] == ["suspend", "resume", "resize"]
        assert status["decisions"][-2]["reason"] == ("spec.suspend is false: resuming at 2 trainer replicas "
                                                     "from the checkpoint of step 40")
        suspended = kube.condition(NS, "s", "Suspended")
        assert (suspended["status"], suspended["reason"]) == ("False", "Resumed")
        kube.run_all_pods(NS, "s")
        wait_for(lambda: kube.job_status(NS, "s").get("phase") == "Running", what="Running again")

        # Neither the suspension nor the resume spent the budget of one replacement.
        kube.set_pod_phase(NS, "s-trainer-1-g1", "Failed", exit_code=1)
        wait_for(lambda: "s-trainer-1-g2" in names(kube, "s", "trainer"), what="a failure still replaced")
        assert kube.job_status(NS, "s")["phase"] != "Failed"


def test_a_job_created_suspended_creates_nothing_until_resumed(kube: builders.Kube, operator) -> None:
    body = builders.make_training_job("later", "train", replicas=2, gpus=1)
    body["spec"]["suspend"] = True
    kube.create_job(NS, body)
    status = wait_for(lambda: (s := kube.job_status(NS, "later")).get("phase") == "Suspended"
                      and s.get("message") and s, what="Suspended, with its message")
    assert kube.children(NS, "later") == {"pods": [], "services": [], "configmaps": []}
    assert [(d["action"], d["reason"]) for d in status["decisions"]] == [
        ("suspend", "spec.suspend is true: the job waits without pods until spec.suspend is false")]
    assert status["message"] == ("suspended: no pods run and no GPUs are held; set spec.suspend to false "
                                 "to resume")
    assert kube.condition(NS, "later", "Suspended")["status"] == "True"
    assert kube.condition(NS, "later", "Reconciling")["status"] == "False"

    set_suspend(kube, "later", False)
    # No pod ever ran, so the first ones keep their first names.
    wait_for(lambda: names(kube, "later") == ["later-rendezvous-0", "later-trainer-0", "later-trainer-1"],
             what="the gang")
    kube.run_all_pods(NS, "later")
    wait_for(lambda: kube.job_status(NS, "later").get("phase") == "Running", what="Running")


def test_a_restarted_operator_finishes_a_suspension_decided_before_its_deletes(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """The crash window: the decision is in status, and no pod was deleted yet."""
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, builders.make_training_job("k", "train", replicas=2, gpus=1))
        wait_for(lambda: len(names(kube, "k", "trainer")) == 2, what="2 trainer pods")
        kube.run_all_pods(NS, "k")
        wait_for(lambda: kube.job_status(NS, "k").get("phase") == "Running", what="Running")
    # What the stopped operator had written: spec.suspend seen, the decision recorded, nothing deleted.
    set_suspend(kube, "k", True)
    g = serialise.from_status(kube.job_status(NS, "k")["graph"])
    assert mutate.suspend(g, training.suspendable_vertices(g), reason="spec.suspend is true: stopping 2",
                          renew=True) is not None
    write_status(kube, "k", {"phase": "Suspended", "graph": serialise.to_status(g),
                             "decisions": training.build_decisions(g)})
    assert names(kube, "k") == ["k-rendezvous-0", "k-trainer-0", "k-trainer-1"]

    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        wait_for(lambda: names(kube, "k") == [], what="the pods deleted by the new operator")
        status = wait_for(lambda: (s := kube.job_status(NS, "k")).get("replicas") == 0 and s,
                          what="suspended")
        assert [d["action"] for d in status["decisions"]] == ["suspend"], "decided once"
        set_suspend(kube, "k", False)
        wait_for(lambda: names(kube, "k") == ["k-rendezvous-0-g1", "k-trainer-0-g1", "k-trainer-1-g1"],
                 what="resumed under the renewed names")
