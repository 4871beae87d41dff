"""The operator's life cycle of a TrainingJob: real kopf against the KMock emulator.

Pod phases are driven by PATCHing pods, as a kubelet would report them; every wait polls the API
with a deadline, since the operator works in its own thread.
"""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

from huorn.runtime import config as runtime_config
from huorn.runtime import launcher

pytest_plugins = ["kube.fixtures"]

NS = "team"


def _running(kube: builders.Kube, name: str, trainers: int) -> dict:
    wait_for(lambda: len(kube.pods(NS, name, "trainer")) == trainers, what=f"{trainers} trainer pods")
    kube.run_all_pods(NS, name)
    return wait_for(
        lambda: (
            (s := kube.job_status(NS, name)).get("phase") == "Running" and s.get("replicas") == trainers and s
        ),
        what="phase Running",
    )


def test_create_makes_pinned_pods_service_and_config(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, builders.make_training_job("llm", "train", replicas=2, gpus=2))
    pods = wait_for(lambda: len(kube.pods(NS, "llm")) == 3 and kube.pods(NS, "llm"), what="3 pods")
    job = kube.get_job(NS, "llm")
    names = [p.metadata.name for p in pods]
    assert names == ["llm-rendezvous-0", "llm-trainer-0", "llm-trainer-1"]
    # The conditions come in the status write after the pods (the decision is written ahead of
    # them): read at once, a loaded host once fell between the two.
    wait_for(lambda: kube.condition(NS, "llm", "Reconciling").get("status") == "True",
             what="the Reconciling condition")

    trainer = pods[1]
    container = trainer.spec.containers[0]
    args = container.command
    assert args[:3] == ["python", "-m", "huorn.runtime.agent"] and args[-4:] == [
        "-m",
        "huorn.runtime.train",
        "--config",
        "/etc/huorn/config.json",
    ]
    # The same command the runtime's own launcher gives a local agent, with the pod's endpoint.
    reference = launcher.build_agent_command(
        "/etc/huorn/config.json",
        launcher.ElasticSettings(2, 4, "llm-rdzv.team.svc:29400", job["metadata"]["uid"], nproc_per_node=2),
        python="python",
    )
    assert args == reference
    assert "--nnodes=2:4" in args and "--rdzv-endpoint=llm-rdzv.team.svc:29400" in args
    env = {e.name: e.value for e in container.env}
    assert env["HUORN_REPLICA"] == "trainer-0" and env["EXTRA"] == "1"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert container.resources.limits["nvidia.com/gpu"] == "2"
    assert {m.mount_path for m in container.volume_mounts} == {"/etc/huorn", "/var/run/huorn", "/checkpoints"}
    assert any(
        v.persistent_volume_claim and v.persistent_volume_claim.claim_name == "ckpt"
        for v in trainer.spec.volumes
    )
    terms = trainer.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    nodes = {
        p.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution.node_selector_terms[
            0
        ]
        .match_expressions[0]
        .values[0]
        for p in pods[1:]
    }
    assert terms.node_selector_terms[0].match_expressions[0].key == "kubernetes.io/hostname"
    assert len(nodes) == 1 and nodes <= {"a0", "a1"}, "a 2×2-GPU gang fits one 4-GPU node of its own VC"
    for pod in pods:
        owner = pod.metadata.owner_references[0]
        assert (owner.kind, owner.name, owner.uid, owner.controller) == (
            "TrainingJob",
            "llm",
            job["metadata"]["uid"],
            True,
        )

    service = kube.core.read_namespaced_service("llm-rdzv", NS)
    assert service.spec.cluster_ip == "None" and service.spec.selector["huorn.io/vertex"] == "rendezvous"
    config = json.loads(kube.core.read_namespaced_config_map("llm-config", NS).data["config.json"])
    run = runtime_config.RunConfig.model_validate(config)  # the runtime reads it with its own model
    assert run.job_name == "llm" and run.spec.resources.gpus == 2

    status = _running(kube, "llm", 2)
    ready = kube.condition(NS, "llm", "Ready")
    assert ready["status"] == "True" and ready["observedGeneration"] == job["metadata"]["generation"]
    assert kube.condition(NS, "llm", "Reconciling")["status"] == "False"
    assert status["selector"] == "huorn.io/job=llm,huorn.io/vertex=trainer"
    assert wait_for(lambda: any(e.reason == "Placed" for e in kube.events(NS, "llm")), what="Placed event")
    vc = wait_for(
        lambda: (kube.get_vc("train").get("status") or {}).get("allocated") == 4 and kube.get_vc("train")
    )
    assert vc["status"]["capacity"] == 8 and vc["status"]["nodes"] == 2
    metrics = operator.ctx.metrics
    assert metrics.value("huorn_jobs", {"kind": "TrainingJob", "phase": "Running"}) == 1
    assert metrics.value("huorn_jobs", {"kind": "TrainingJob", "phase": "Placing"}) == 0
    assert metrics.value("huorn_virtualcluster_gpus", {"virtual_cluster": "train", "state": "allocated"}) == 4
    assert metrics.value("huorn_decisions_total", {"kind": "TrainingJob", "action": "place"}) == 1
    assert metrics.value("huorn_reconcile_total", {"kind": "TrainingJob", "result": "ok"}) >= 2
    assert metrics.value("huorn_reconcile_duration_seconds_count", {"kind": "TrainingJob"}) >= 2


def test_scale_subresource_resizes_and_logs_mutations(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, builders.make_training_job("big", "train", replicas=2, gpus=2))
    _running(kube, "big", 2)
    scale = kube.scale(NS, "big", 4)
    assert scale["spec"]["replicas"] == 4
    _running(kube, "big", 4)
    kube.scale(NS, "big", 1)
    wait_for(lambda: len(kube.pods(NS, "big", "trainer")) == 1, what="scale down to 1 pod")
    status = wait_for(lambda: (s := kube.job_status(NS, "big")).get("replicas") == 1 and s, what="replicas 1")
    resizes = [d for d in status["decisions"] if d["action"] == "resize"]
    assert [d["reason"].split(":")[0] for d in resizes] == ["scale 2→4", "scale 4→1"]
    assert status["graph"]["summary"]["actions"]["resize"] == 2
    assert [p.metadata.name for p in kube.pods(NS, "big", "trainer")] == ["big-trainer-0"]
    assert (
        kube.custom.get_namespaced_custom_object_scale("huorn.io", "v1alpha1", NS, "trainingjobs", "big")[
            "status"
        ]["replicas"]
        == 1
    )
    assert (
        operator.ctx.metrics.value("huorn_decisions_total", {"kind": "TrainingJob", "action": "resize"}) == 2
    )
    assert wait_for(
        lambda: sum(e.reason == "Resize" for e in kube.events(NS, "big")) == 2, what="2 Resize events"
    )


def test_failed_pod_is_replaced_then_a_config_error_fails_the_job(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, builders.make_training_job("flaky", "train", replicas=2, gpus=1))
    _running(kube, "flaky", 2)
    kube.set_pod_phase(NS, "flaky-trainer-0", "Failed", exit_code=137)
    wait_for(
        lambda: (
            [p.metadata.name for p in kube.pods(NS, "flaky", "trainer")]
            == ["flaky-trainer-0-g1", "flaky-trainer-1"]
        ),
        what="the failed pod replaced by generation 1",
    )
    status = kube.job_status(NS, "flaky")
    assert [d["action"] for d in status["decisions"]] == ["replace"]
    assert "exit code 137" in status["decisions"][0]["reason"]

    kube.set_pod_phase(NS, "flaky-trainer-1", "Failed", exit_code=2)
    status = wait_for(
        lambda: (s := kube.job_status(NS, "flaky")).get("phase") == "Failed" and s, what="Failed"
    )
    assert kube.condition(NS, "flaky", "Stalled")["status"] == "True"
    assert "runtime refused its config" in status["message"]
    # A failed gang gives its GPUs back: every non-terminal pod and the store are deleted.
    wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "flaky")] == ["flaky-trainer-1"], what="cleanup")


def test_replacement_budget_and_mitigation_level_are_restart_rules(kube: builders.Kube, operator) -> None:
    body = builders.make_training_job(
        "strict", "train", replicas=1, gpus=1, remediation={"maxMitigation": "resplit"}
    )
    kube.create_job(NS, body)
    _running(kube, "strict", 1)
    kube.set_pod_phase(NS, "strict-trainer-0", "Failed", exit_code=1)
    status = wait_for(
        lambda: (s := kube.job_status(NS, "strict")).get("phase") == "Failed" and s, what="Failed"
    )
    assert "spec.remediation.maxMitigation" in status["message"]

    budget = builders.make_training_job("once", "train", replicas=1, gpus=1)
    budget["spec"]["remediation"] = {"maxRestarts": 1}
    kube.create_job(NS, budget)
    _running(kube, "once", 1)
    kube.set_pod_phase(NS, "once-trainer-0", "Failed", exit_code=1)
    wait_for(
        lambda: kube.pods(NS, "once", "trainer")[0].metadata.name == "once-trainer-0-g1", what="replaced"
    )
    kube.set_pod_phase(NS, "once-trainer-0-g1", "Failed", exit_code=1)
    status = wait_for(
        lambda: (s := kube.job_status(NS, "once")).get("phase") == "Failed" and s, what="Failed"
    )
    assert "budget of 1 used up" in status["message"]


def test_repeated_failures_back_off_before_their_replacement(cluster: EmulatedCluster,
                                                            kube: builders.Kube) -> None:
    """Kubernetes Job's back-off: the first failure is replaced at once, the next waits 2 s after
    that replacement, the one after 4 s; the wait is on its own timer (the resync is 120 s away)
    and the job says until when."""
    settings = dataclasses.replace(operator_mod.FAST, resync_seconds=120.0, replacement_backoff_seconds=2.0,
                                   replacement_backoff_max_seconds=8.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        body = builders.make_training_job("crashy", "train", replicas=1, gpus=1)
        body["spec"]["remediation"] = {"maxRestarts": 5}
        kube.create_job(NS, body)
        _running(kube, "crashy", 1)

        def fail_and_time(pod: str, successor: str) -> float:
            failed = time.monotonic()
            kube.set_pod_phase(NS, pod, "Failed", exit_code=1)
            wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "crashy", "trainer")] == [successor],
                     what=f"{pod} replaced by {successor}")
            return time.monotonic() - failed

        assert fail_and_time("crashy-trainer-0", "crashy-trainer-0-g1") < 1.5  # at once
        kube.set_pod_phase(NS, "crashy-trainer-0-g1", "Running")
        failed = time.monotonic()
        kube.set_pod_phase(NS, "crashy-trainer-0-g1", "Failed", exit_code=1)
        # The BackOff condition lasts only the back-off, which a poll on a loaded host missed once
        # in a full run; its Event carries the same message and stays.
        waiting = wait_for(lambda: next((e for e in kube.events(NS, "crashy") if e.reason == "BackOff"),
                                        None), what="the BackOff event")
        assert waiting.message.startswith("pod crashy-trainer-0-g1 failed with exit code 1; replacing at ")
        assert waiting.message.endswith(": back-off after 1 failure in the last 10 min")
        wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "crashy", "trainer")]
                 == ["crashy-trainer-0-g2"], what="the replacement after its back-off")
        # 2 s after the first replacement, which came a moment before the failure
        assert time.monotonic() - failed >= 1.0
        kube.set_pod_phase(NS, "crashy-trainer-0-g2", "Running")
        assert fail_and_time("crashy-trainer-0-g2", "crashy-trainer-0-g3") >= 3.0  # doubled: 4 s
        status = kube.job_status(NS, "crashy")
        assert status["restartsUsed"] == 3 and status["phase"] != "Failed"


def test_a_pod_failure_policy_ignores_evictions_and_fails_on_a_final_exit_code(
        kube: builders.Kube, operator) -> None:
    """Kubernetes Job's podFailurePolicy: with no restart budget at all, an evicted pod
    (DisruptionTarget, as a node drain or the kubelet sets it) is still replaced, and the
    trainer's own "do not retry" exit code fails the job at once."""
    body = builders.make_training_job("policy", "train", replicas=2, gpus=1)
    body["spec"]["remediation"] = {"maxRestarts": 0, "podFailurePolicy": {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
        {"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}},
    ]}}
    kube.create_job(NS, body)
    _running(kube, "policy", 2)
    evicted = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory.",
               "conditions": [{"type": "DisruptionTarget", "status": "True",
                               "reason": "TerminationByKubelet"}]}
    kube.core.patch_namespaced_pod_status("policy-trainer-0", NS, {"status": evicted})
    wait_for(lambda: sorted(p.metadata.name for p in kube.pods(NS, "policy", "trainer"))
             == ["policy-trainer-0-g1", "policy-trainer-1"], what="the evicted pod replaced")
    status = wait_for(lambda: (s := kube.job_status(NS, "policy")).get("ignoredFailures") == 1 and s,
                      what="the ignored failure in status")
    assert status["restartsUsed"] == 0 and status["phase"] != "Failed"
    assert status["decisions"][-1]["reason"] == (
        "pod policy-trainer-0 failed (Evicted: The node was low on resource: memory.); replacing it "
        "(spec.remediation.podFailurePolicy.rules[0] (pod condition DisruptionTarget): Ignore, not counted "
        "against spec.remediation.maxRestarts)")

    kube.set_pod_phase(NS, "policy-trainer-1", "Failed", exit_code=42)
    status = wait_for(lambda: (s := kube.job_status(NS, "policy")).get("phase") == "Failed" and s,
                      what="Failed on the final exit code")
    assert status["message"] == ("pod policy-trainer-1 failed with exit code 42; "
                                 "spec.remediation.podFailurePolicy.rules[1] (exit code 42 In [42]): FailJob")
    assert kube.condition(NS, "policy", "Stalled")["status"] == "True"


def _hold_pending(kube: builders.Kube, pod: str, reason: str, message: str) -> None:
    """What the kubelet reports of a container that cannot start."""
    waiting = {"phase": "Pending", "containerStatuses": [
        {"name": "trainer", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
         "state": {"waiting": {"reason": reason, "message": message}}}]}
    kube.core.patch_namespaced_pod_status(pod, NS, {"status": waiting})


def test_a_pod_that_never_starts_is_replaced_then_fails_the_job_naming_why(
        cluster: EmulatedCluster, kube: builders.Kube) -> None:
    settings = dataclasses.replace(operator_mod.FAST, trainer_start_seconds=4.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        body = builders.make_training_job("stuck", "train", replicas=2, gpus=1)
        body["spec"]["remediation"] = {"maxRestarts": 1}
        kube.create_job(NS, body)
        wait_for(lambda: len(kube.pods(NS, "stuck")) == 3, what="the store pod and 2 trainer pods")
        kube.set_pod_phase(NS, "stuck-rendezvous-0", "Running")
        kube.set_pod_phase(NS, "stuck-trainer-0", "Running")
        _hold_pending(kube, "stuck-trainer-1", "ImagePullBackOff", "Back-off pulling image \"x\"")
        # While it waits, the job says which pod waits and why.
        ready = wait_for(
            lambda: (c := kube.condition(NS, "stuck", "Ready")) and "Back-off" in c["message"] and c,
            what="the waiting reason in the Ready condition")
        assert ready["status"] == "False"
        assert ready["message"].startswith("1/2 trainer pods running; stuck-trainer-1: ImagePullBackOff")
        wait_for(lambda: sorted(p.metadata.name for p in kube.pods(NS, "stuck", "trainer"))
                 == ["stuck-trainer-0", "stuck-trainer-1-g1"], what="the stuck pod replaced")
        decision = kube.job_status(NS, "stuck")["decisions"][-1]
        assert decision["action"] == "replace"
        assert ("pod stuck-trainer-1 did not start within 4 s (ImagePullBackOff: Back-off pulling image"
                in decision["reason"]), decision
        _hold_pending(kube, "stuck-trainer-1-g1", "ErrImagePull", "not found")
        status = wait_for(lambda: (s := kube.job_status(NS, "stuck")).get("phase") == "Failed" and s,
                          what="Failed once the budget is spent")
        assert "stuck-trainer-1-g1 did not start within 4 s (ErrImagePull: not found)" in status["message"]
        assert "replacement budget of 1 used up" in status["message"]
        # A failed gang gives its GPUs back, the running pod's too.
        wait_for(lambda: kube.pods(NS, "stuck", "trainer") == [], what="cleanup")


def test_an_evicted_store_pod_is_replaced_behind_the_same_service(kube: builders.Kube, operator) -> None:
    """The kubelet restarts a crashed store container in place (restartPolicy Always), but an
    evicted store pod stays Failed, and without its store the gang can never rendezvous again."""
    kube.create_job(NS, builders.make_training_job("rdzv", "train", replicas=2, gpus=1))
    _running(kube, "rdzv", 2)
    evicted = {"phase": "Failed", "reason": "Evicted",
               "message": "The node was low on resource: memory."}
    kube.core.patch_namespaced_pod_status("rdzv-rendezvous-0", NS, {"status": evicted})
    wait_for(lambda: sorted(p.metadata.name for p in kube.pods(NS, "rdzv"))
             == ["rdzv-rendezvous-0-g1", "rdzv-trainer-0", "rdzv-trainer-1"], what="the store pod replaced")
    store = kube.core.read_namespaced_pod("rdzv-rendezvous-0-g1", NS)
    service = kube.core.read_namespaced_service("rdzv-rdzv", NS)
    assert all(store.metadata.labels.get(k) == v for k, v in service.spec.selector.items())
    status = wait_for(lambda: (s := kube.job_status(NS, "rdzv")).get("phase") == "Running" and s,
                      what="the job still Running")
    assert [d["action"] for d in status["decisions"]] == ["replace"]
    assert (status["decisions"][0]["reason"]
            == "pod rdzv-rendezvous-0 failed (Evicted: The node was low on resource: memory.); replacing it")


def test_delete_removes_every_child(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, builders.make_training_job("gone", "train", replicas=2, gpus=1))
    _running(kube, "gone", 2)
    assert kube.children(NS, "gone") == {
        "pods": ["gone-rendezvous-0", "gone-trainer-0", "gone-trainer-1"],
        "services": ["gone-rdzv"],
        "configmaps": ["gone-config"],
    }
    kube.delete_job(NS, "gone")
    wait_for(lambda: not kube.job_exists(NS, "gone"), what="finalizer released")
    assert kube.children(NS, "gone") == {"pods": [], "services": [], "configmaps": []}


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        (
            {"optimization": {"steps": 10, "globalBatch": 10, "microBatch": 4}},
            "spec.optimization.globalBatch",
        ),
        ({"elasticity": {"minReplicas": 5, "maxReplicas": 2}}, "spec.elasticity.minReplicas"),
        ({"task": {"kind": "distill"}}, "spec.task.teacher"),
        ({"remediation": {"maxRestarts": -1}}, "spec.remediation.maxRestarts"),
        # the model alone judges a map's keys (the CRD cannot): the operator Stalls it before any pod
        ({"podMetadata": {"labels": {"huorn.io/job": "other"}}}, "spec.podMetadata.labels"),
        # a local run takes it (a process per stage); pods of 3 GPUs cannot hold 2-stage pipelines
        ({"gpus": 3, "parallelism": {"pipelineStages": 2}, "model": {"layers": 4}}, "spec.resources.gpus"),
    ],
)
def test_invalid_spec_stalls_naming_the_field_and_creates_nothing(
    kube: builders.Kube,
    operator,
    patch: dict,
    field: str,
) -> None:
    kube.create_job(NS, builders.make_training_job("bad", "train", **patch))
    status = wait_for(
        lambda: (s := kube.job_status(NS, "bad")).get("phase") == "Stalled" and s, what="Stalled"
    )
    stalled = kube.condition(NS, "bad", "Stalled")
    assert stalled["status"] == "True" and stalled["reason"] == "InvalidSpec"
    assert field in stalled["message"] and field in status["message"]
    assert kube.children(NS, "bad") == {"pods": [], "services": [], "configmaps": []}
    assert wait_for(
        lambda: any(e.reason == "InvalidSpec" for e in kube.events(NS, "bad")), what="Warning event"
    )


def test_unplaceable_gang_creates_nothing_and_says_why(kube: builders.Kube, operator) -> None:
    # 4 replicas × 4 GPUs = 16: the VC has 8 and may borrow 4, so no part of the gang may start.
    kube.create_job(NS, builders.make_training_job("huge", "train", replicas=4, gpus=4))
    cond = wait_for(
        lambda: (c := kube.condition(NS, "huge", "Reconciling")).get("reason") == "Unplaceable" and c
    )
    assert cond["status"] == "True" and "needs 16 GPUs" in cond["message"]
    assert kube.pods(NS, "huge") == []
    # Lowering the gang to what fits (8 own + 4 borrowed) places all of it at once.
    kube.scale(NS, "huge", 3)
    _running(kube, "huge", 3)
    wait_for(lambda: (kube.get_vc("train").get("status") or {}).get("borrowed") == 4, what="borrowed 4")
    wait_for(lambda: (kube.get_vc("serve").get("status") or {}).get("lent") == 4, what="lent 4")


def test_a_node_selector_places_the_gang_on_its_nodes_and_waits_naming_it(
        kube: builders.Kube, operator) -> None:
    """Pool a's a0 and a1 have 4 GPUs each: a gang that selects a1 goes there whole, though
    a0 packs as well; a second one that selects a1 waits while a0 stays free, and its message
    says the count is of the selected nodes."""
    kube.create_job(NS, builders.make_training_job("on-a1", "train", replicas=2, gpus=2,
                                                   nodeSelector={"kubernetes.io/hostname": "a1"}))
    _running(kube, "on-a1", 2)
    assert {p.spec.node_name or p.metadata.annotations["huorn.io/node"]
            for p in kube.pods(NS, "on-a1", "trainer")} == {"a1"}
    kube.create_job(NS, builders.make_training_job("also-a1", "train", replicas=1, gpus=2,
                                                   nodeSelector={"kubernetes.io/hostname": "a1"}))
    cond = wait_for(
        lambda: (c := kube.condition(NS, "also-a1", "Reconciling")).get("reason") == "Unplaceable" and c
    )
    assert ("in virtual cluster train on nodes labelled kubernetes.io/hostname=a1 (spec.nodeSelector), "
            "0 free") in cond["message"]
    assert kube.pods(NS, "also-a1") == []
    # without it the same gang starts at once, on a0
    kube.create_job(NS, builders.make_training_job("anywhere", "train", replicas=1, gpus=2))
    _running(kube, "anywhere", 1)
    assert kube.pods(NS, "also-a1") == []


def test_pod_metadata_reaches_every_pod_of_the_job_under_huorns_own(kube: builders.Kube, operator) -> None:
    metadata = {"labels": {"team": "nlp", "app.kubernetes.io/part-of": "llm"},
                "annotations": {"sidecar.istio.io/inject": "false"}}
    kube.create_job(NS, builders.make_training_job("labelled", "train", podMetadata=metadata))
    _running(kube, "labelled", 2)
    pods = kube.pods(NS, "labelled")
    assert {p.metadata.labels["huorn.io/vertex"] for p in pods} == {"trainer", "rendezvous"}
    for pod in pods:
        labels = pod.metadata.labels
        assert labels["team"] == "nlp" and labels["app.kubernetes.io/part-of"] == "llm"
        assert labels["huorn.io/job"] == "labelled"
        assert pod.metadata.annotations["sidecar.istio.io/inject"] == "false"
    assert all(p.metadata.annotations["huorn.io/node"] for p in kube.pods(NS, "labelled", "trainer"))


def test_an_invalid_inference_job_is_stalled_and_nothing_is_created(kube: builders.Kube, operator) -> None:
    kube.create_job(
        NS,
        {
            "apiVersion": "huorn.io/v1alpha1",
            "kind": "InferenceJob",
            "metadata": {"name": "inf"},
            "spec": {"virtualCluster": "serve", "model": {"checkpoint": ""}},
        },
        plural="inferencejobs",
    )
    cond = wait_for(
        lambda: (
            kube.condition(NS, "inf", "Stalled", "inferencejobs").get("status") == "True"
            and kube.condition(NS, "inf", "Stalled", "inferencejobs")
        ),
        what="InferenceJob Stalled",
    )
    assert cond["reason"] == "InvalidSpec" and "spec.model.checkpoint" in cond["message"]
    assert kube.pods(NS, "inf") == []


def test_finished_gang_succeeds_and_frees_its_store(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, builders.make_training_job("done", "train", replicas=2, gpus=1))
    _running(kube, "done", 2)
    for pod in kube.pods(NS, "done", "trainer"):
        kube.set_pod_phase(NS, pod.metadata.name, "Succeeded", exit_code=0)
    status = wait_for(lambda: (s := kube.job_status(NS, "done")).get("phase") == "Succeeded" and s)
    assert kube.condition(NS, "done", "Ready")["reason"] == "Succeeded" and status["replicas"] == 0
    assert (status["progressPercent"], status["estimatedRemaining"]) == (100, "0s")
    wait_for(lambda: kube.pods(NS, "done", "rendezvous") == [], what="the store pod deleted")
    assert [p.metadata.name for p in kube.pods(NS, "done")] == ["done-trainer-0", "done-trainer-1"]
    wait_for(lambda: (kube.get_vc("train").get("status") or {}).get("allocated") == 0, what="GPUs freed")
