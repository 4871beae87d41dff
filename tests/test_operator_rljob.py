"""RLJobs run by the operator (real kopf against KMock): one Ray cluster per job, placed as a gang
on the job's virtual cluster, restarted as a gang, judged by its controller's exit code.

The test plays the kubelet (pod phases and exit codes); what the pods run is checked by command
line here and for real in tests/test_runtime_rl_node.py.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import kubernetes
from kube import builders
from kube import operator as operator_mod
from kube.cluster import wait_for

from huorn.api import training as training_api
from huorn.backends.kubernetes import rl_manifests
from huorn.runtime import launcher

pytest_plugins = ["kube.fixtures"]

NS = "team"
RL = "rljobs"


def rl_job(name: str, **spec: Any) -> dict[str, Any]:
    """Four GPUs on the "train" cluster (nodes a0, a1 of 4 each), in Ray workers of two."""
    return builders.make_rl_job(name, "train", **spec)


def status(kube: builders.Kube, name: str) -> dict:
    return kube.job_status(NS, name, RL)


def live_pods(kube: builders.Kube, name: str) -> dict[str, Any]:
    return {p.metadata.name: p for p in kube.pods(NS, name) if not p.metadata.deletion_timestamp}


def end_pod(kube: builders.Kube, pod: str, phase: str, exit_code: int, message: str = "") -> None:
    """What the kubelet reports when the container ends (its termination message, if any)."""
    terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error",
                  "message": message}
    body = {"status": {"phase": phase, "containerStatuses": [
        {"name": "c", "ready": False, "restartCount": 0, "image": "x", "imageID": "x",
         "state": {"terminated": terminated}}]}}
    kube.core.patch_namespaced_pod_status(pod, NS, body)


def run_all(kube: builders.Kube, name: str) -> None:
    for pod in live_pods(kube, name):
        kube.set_pod_phase(NS, pod, "Running")


def test_an_rl_job_is_one_ray_cluster_whose_controller_ends_the_job(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, rl_job("dapo"), plural=RL)
    pods = wait_for(lambda: len(live_pods(kube, "dapo")) == 3 and live_pods(kube, "dapo"), what="the gang")
    assert sorted(pods) == ["dapo-ray-head-0", "dapo-ray-worker-0", "dapo-ray-worker-1"]

    # The head: Ray's head node and the controller, no GPU, left to the default scheduler.
    head = pods["dapo-ray-head-0"].spec
    assert head.containers[0].command == launcher.build_rl_head_command("/etc/huorn/config.json", 6,
                                                                        python="python")
    assert "nvidia.com/gpu" not in head.containers[0].resources.limits and head.affinity is None
    assert head.restart_policy == "Never"
    # its controller waits for the GPUs of the gang's two workers (an environment variable, which
    # a controller of an older image ignores; a config field it would refuse)
    head_env = {e.name: e.value for e in head.containers[0].env}
    assert head_env[rl_manifests.WAIT_GPUS_ENV] == "4"
    # The workers: two GPUs each, pinned to the nodes Huorn chose, joining the head's Service.
    workers = [pods[f"dapo-ray-worker-{i}"] for i in (0, 1)]
    for worker in workers:
        assert worker.spec.containers[0].command == launcher.build_rl_worker_command(
            "dapo-ray.team.svc:6379", 2, 6, python="python")
        assert worker.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"
        assert rl_manifests.WAIT_GPUS_ENV not in {e.name for e in worker.spec.containers[0].env}
        node = worker.metadata.annotations["huorn.io/node"]
        term = worker.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
        assert term.node_selector_terms[0].match_expressions[0].values == [node]
        mounts = {m.mount_path: m.read_only for m in worker.spec.containers[0].volume_mounts}
        assert mounts["/checkpoints"] is None  # read-write: the training actor saves there
    # best fit: the second worker goes where the first left room (a0 has 4 GPUs)
    assert [w.metadata.annotations["huorn.io/node"] for w in workers] == ["a0", "a0"]
    service = kube.core.read_namespaced_service("dapo-ray", NS)
    assert service.spec.cluster_ip == "None" and service.spec.ports[0].port == 6379
    assert service.spec.selector == {"huorn.io/job": "dapo", "huorn.io/vertex": "ray-head"}
    # the run config is what the controller loads (its own model validates it)
    from huorn.runtime.rl import controller

    data = kube.core.read_namespaced_config_map("dapo-config", NS).data["config.json"]
    config = controller.RLRunConfig.model_validate(json.loads(data))
    assert config.spec.steps == 20 and config.checkpoint_root.as_posix() == "/checkpoints"
    assert config.ray_cpus is None  # the head's Ray cluster is sized by its pods, not the controller
    # the pods are created before the status that reports them is written: wait for it
    wait_for(lambda: status(kube, "dapo").get("phase") == "Pending", what="status Pending")

    run_all(kube, "dapo")
    now = wait_for(lambda: (s := status(kube, "dapo")).get("phase") == "Running" and s, what="Running")
    assert now["replicas"] == 3 and now["startTime"]
    assert kube.condition(NS, "dapo", "Ready", RL)["status"] == "True"
    assert [d["action"] for d in now["decisions"]] == ["insert"]
    assert "one Ray cluster" in now["decisions"][0]["reason"]
    wait_for(lambda: (kube.get_vc("train").get("status") or {}).get("allocated") == 4,
             what="the VirtualCluster counting the workers' GPUs")

    end_pod(kube, "dapo-ray-head-0", "Succeeded", 0)
    done = wait_for(lambda: (s := status(kube, "dapo")).get("phase") == "Succeeded" and s, what="Succeeded")
    assert done["completionTime"] and done["replicas"] == 0
    ready = kube.condition(NS, "dapo", "Ready", RL)
    assert (ready["status"], ready["reason"]) == ("False", "Succeeded")  # as a TrainingJob's
    assert kube.condition(NS, "dapo", "Succeeded", RL)["status"] == "True"
    wait_for(lambda: list(live_pods(kube, "dapo")) == ["dapo-ray-head-0"], what="the workers stopped")
    wait_for(lambda: kube.has_event(NS, "dapo", "Completed"), what="the Completed event")
    assert [e.reason for e in kube.events(NS, "dapo")].count("Completed") == 1


def test_a_lost_worker_restarts_the_gang_and_a_refused_config_fails_the_job(
    kube: builders.Kube, operator
) -> None:
    kube.create_job(NS, rl_job("grpo", remediation={"maxRestarts": 3}), plural=RL)
    wait_for(lambda: len(live_pods(kube, "grpo")) == 3, what="the gang")
    run_all(kube, "grpo")
    wait_for(lambda: status(kube, "grpo").get("phase") == "Running", what="Running")

    # A node lost under a worker: Ray's actors on it are gone, so the whole gang starts again.
    end_pod(kube, "grpo-ray-worker-1", "Failed", 137)
    second = ["grpo-ray-head-0-g1", "grpo-ray-worker-0-g1", "grpo-ray-worker-1-g1"]
    wait_for(lambda: sorted(live_pods(kube, "grpo")) == second, what="a new generation of the gang")
    now = status(kube, "grpo")
    assert now["restarts"] == 1
    replaced = [d["reason"] for d in now["decisions"] if d["action"] == "replace"]
    assert len(replaced) == 3 and all("grpo-ray-worker-1 failed with exit code 137" in r for r in replaced)
    assert "restarting the whole gang" in replaced[0]
    (event,) = [e for e in kube.events(NS, "grpo") if e.reason == "GangRestarted"]
    assert "exit code 137" in event.message

    # The controller of the new gang refuses its config: final, whatever budget is left.
    run_all(kube, "grpo")
    refusal = ("Traceback is not printed\nerror: spec.algorithm.name: ppo needs a critic, which Huorn's "
               "RL runtime does not train")
    end_pod(kube, "grpo-ray-head-0-g1", "Failed", 2, refusal)
    failed = wait_for(lambda: (s := status(kube, "grpo")).get("phase") == "Failed" and s, what="Failed")
    assert "exit code 2" in failed["message"] and "the runtime refused its config" in failed["message"]
    assert "spec.algorithm.name: ppo needs a critic" in failed["message"]
    assert failed["restarts"] == 1
    assert kube.condition(NS, "grpo", "Stalled", RL)["status"] == "True"
    wait_for(lambda: list(live_pods(kube, "grpo")) == ["grpo-ray-head-0-g1"], what="the workers stopped")


def test_the_restart_budget_is_spent_once_per_gang_failure(kube: builders.Kube, operator) -> None:
    kube.create_job(NS, rl_job("ppo", remediation={"maxRestarts": 0}), plural=RL)
    wait_for(lambda: len(live_pods(kube, "ppo")) == 3, what="the gang")
    run_all(kube, "ppo")
    end_pod(kube, "ppo-ray-head-0", "Failed", 1)
    failed = wait_for(lambda: (s := status(kube, "ppo")).get("phase") == "Failed" and s, what="Failed")
    assert "restart budget of 0 used up (spec.remediation.maxRestarts)" in failed["message"]
    assert failed["restarts"] == 0
    wait_for(lambda: list(live_pods(kube, "ppo")) == ["ppo-ray-head-0"], what="the workers stopped")


def test_an_rl_job_waits_for_all_its_gpus_and_a_bad_layout_is_refused(kube: builders.Kube, operator) -> None:
    # 12 GPUs of workers of 2 on a cluster of 8: none is placed, and the job says why.
    kube.create_job(NS, rl_job("big", gpus=12), plural=RL)
    waiting = wait_for(lambda: (s := status(kube, "big")).get("message", "").startswith("waiting") and s,
                       what="WaitingForGPUs")
    assert waiting["phase"] == "Pending" and "6 Ray worker(s) of 2 GPU(s)" in waiting["message"]
    assert kube.condition(NS, "big", "Ready", RL)["reason"] == "WaitingForGPUs"
    assert kube.pods(NS, "big") == []
    # Room for it: the same job at 8 GPUs is placed whole.
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, RL, "big",
                                               {"spec": {"gpus": 8}})
    wait_for(lambda: len(live_pods(kube, "big")) == 5, what="the gang of four workers")

    # (an explicit spec.gpus that is no multiple is the API's rule rl-gpus-fill-worker-pods; what
    # the roles need when spec.gpus is unset, only the operator can tell)
    odd = rl_job("odd", roles={"actorTrain": {"replicas": 1, "gpusPerReplica": 2},
                               "rollout": {"replicas": 1, "gpusPerReplica": 1}})
    del odd["spec"]["gpus"]
    kube.create_job(NS, odd, plural=RL)
    cond = wait_for(lambda: (c := kube.condition(NS, "odd", "Stalled", RL)).get("status") == "True" and c,
                    what="Stalled")
    assert cond["reason"] == "InvalidSpec"
    assert "spec.gpus: unset, so the roles' 3 is not a multiple of spec.resources.gpus (2)" in cond["message"]
    wide = rl_job("wide", gpus=6, roles={"actorTrain": {"replicas": 1, "gpusPerReplica": 4}})
    kube.create_job(NS, wide, plural=RL)
    cond = wait_for(lambda: (c := kube.condition(NS, "wide", "Stalled", RL)).get("status") == "True" and c,
                    what="Stalled")
    assert "spec.roles.actorTrain.gpusPerReplica: 4 exceeds spec.resources.gpus (2)" in cond["message"]
    assert kube.pods(NS, "odd") == [] and kube.pods(NS, "wide") == []
    try:
        kube.core.read_namespaced_config_map("odd-config", NS)
        raise AssertionError("a refused job got a ConfigMap")
    except kubernetes.client.ApiException as error:
        assert error.status == 404


def test_ray_workers_go_on_the_selected_nodes_and_an_edit_of_the_selector_restarts_nothing(
        kube: builders.Kube, operator) -> None:
    """The gang's two workers of 2 GPUs go on a1, which it selects; a second such gang waits for
    a1 while a0 is free, and says so. A new selector moves no running worker."""
    kube.create_job(NS, rl_job("on-a1", nodeSelector={"kubernetes.io/hostname": "a1"}), plural=RL)
    wait_for(lambda: len(live_pods(kube, "on-a1")) == 3, what="the gang")
    workers = [p for p in live_pods(kube, "on-a1").values()
               if p.metadata.labels["huorn.io/vertex"] == "ray-worker"]
    assert {p.metadata.annotations["huorn.io/node"] for p in workers} == {"a1"}
    run_all(kube, "on-a1")
    wait_for(lambda: status(kube, "on-a1").get("phase") == "Running", what="Running")
    kube.create_job(NS, rl_job("also-a1", nodeSelector={"kubernetes.io/hostname": "a1"}), plural=RL)
    waiting = wait_for(lambda: (m := status(kube, "also-a1").get("message", "")).startswith("waiting") and m,
                       what="WaitingForGPUs")
    assert ("(0 GPU(s) free on its nodes labelled kubernetes.io/hostname=a1 (spec.nodeSelector), none "
            "borrowed)") in waiting
    assert kube.pods(NS, "also-a1") == []
    # growth waits on the selected nodes too, and says so (a0's 4 GPUs are free, but not its)
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, RL, "on-a1",
                                               {"spec": {"gpus": 6}})
    grows = wait_for(lambda: "more Ray worker" in (m := kube.condition(NS, "on-a1", "Ready", RL)
                                                   .get("message", "")) and m, what="the growth waiting")
    assert "on its nodes labelled kubernetes.io/hostname=a1 (spec.nodeSelector)" in grows
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, RL, "on-a1",
                                               {"spec": {"gpus": 4}})
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, RL, "on-a1",
                                               {"spec": {"nodeSelector": {"kubernetes.io/hostname": "a0"}}})
    wait_for(lambda: status(kube, "on-a1").get("observedGeneration") == 4, what="the edit seen")
    assert sorted(live_pods(kube, "on-a1")) == ["on-a1-ray-head-0", "on-a1-ray-worker-0",
                                               "on-a1-ray-worker-1"]


def test_a_changed_spec_restarts_the_gang_on_it_and_a_priority_change_does_not(
    kube: builders.Kube, operator
) -> None:
    kube.create_job(NS, rl_job("cpt"), plural=RL)
    wait_for(lambda: len(live_pods(kube, "cpt")) == 3, what="the gang")
    run_all(kube, "cpt")
    wait_for(lambda: status(kube, "cpt").get("phase") == "Running", what="Running")
    patch = kube.custom.patch_namespaced_custom_object
    patch(builders.GROUP, builders.VERSION, NS, RL, "cpt", {"spec": {"priority": 70}})
    wait_for(lambda: status(kube, "cpt").get("observedGeneration") == 2, what="the priority seen")
    assert sorted(live_pods(kube, "cpt")) == ["cpt-ray-head-0", "cpt-ray-worker-0", "cpt-ray-worker-1"]

    patch(builders.GROUP, builders.VERSION, NS, RL, "cpt", {"spec": {"steps": 40}})
    second = ["cpt-ray-head-0-g1", "cpt-ray-worker-0-g1", "cpt-ray-worker-1-g1"]
    wait_for(lambda: sorted(live_pods(kube, "cpt")) == second, what="the gang on the new spec")
    now = status(kube, "cpt")
    assert now["restarts"] == 0  # the job did not fail: nothing spent from maxRestarts
    assert any("spec changed" in d["reason"] for d in now["decisions"] if d["action"] == "replace")
    data = json.loads(kube.core.read_namespaced_config_map("cpt-config", NS).data["config.json"])
    assert data["spec"]["steps"] == 40  # what the new controller reads


def test_an_edit_of_the_model_is_refused_once_the_job_has_started(kube: builders.Kube, operator) -> None:
    """Its checkpoints hold the architecture it started with: a gang restarted on another could
    not resume from them. The gang, its config and its pods keep the model; reverted, the refusal
    leaves status. Before, the edit restarted the gang on the new model."""
    kube.create_job(NS, rl_job("cpt"), plural=RL)
    wait_for(lambda: len(live_pods(kube, "cpt")) == 3, what="the gang")
    run_all(kube, "cpt")
    wait_for(lambda: status(kube, "cpt").get("phase") == "Running", what="Running")
    first = sorted(live_pods(kube, "cpt"))
    width = json.loads(kube.core.read_namespaced_config_map("cpt-config", NS).data["config.json"])[
        "spec"]["model"]["width"]
    patch = kube.custom.patch_namespaced_custom_object
    patch(builders.GROUP, builders.VERSION, NS, RL, "cpt", {"spec": {"model": {"width": width * 2}}})
    refused = wait_for(lambda: status(kube, "cpt").get("specChangeRefused"), what="the refusal")
    assert refused.startswith("spec.model changed after the job started") and "revert spec.model" in refused
    wait_for(lambda: kube.has_event(NS, "cpt", "SpecChangeRefused"), what="the SpecChangeRefused event")
    assert [e.reason for e in kube.events(NS, "cpt")].count("SpecChangeRefused") == 1
    assert sorted(live_pods(kube, "cpt")) == first  # nothing restarted
    data = json.loads(kube.core.read_namespaced_config_map("cpt-config", NS).data["config.json"])
    assert data["spec"]["model"]["width"] == width
    patch(builders.GROUP, builders.VERSION, NS, RL, "cpt", {"spec": {"model": {"width": width}}})
    wait_for(lambda: "specChangeRefused" not in status(kube, "cpt"), what="the refusal cleared")
    assert sorted(live_pods(kube, "cpt")) == first


def test_a_model_edited_before_the_start_is_the_one_the_job_keeps(kube: builders.Kube, operator) -> None:
    """The graph in status keeps the model a started job runs. One edited while the job waited
    for GPUs is what its gang starts on, and what it keeps: before, the graph still held the
    model of the first reconcile, so once the gang ran the edit was refused after the fact and
    the gang restarted on a model it had never run."""
    width = training_api.ModelSpec().width
    kube.create_job(NS, rl_job("late", gpus=12), plural=RL)  # more than the cluster has: it waits
    wait_for(lambda: status(kube, "late").get("graph"), what="waiting, its graph in status")
    patch = kube.custom.patch_namespaced_custom_object
    edit = {"spec": {"model": {"width": width * 2}, "gpus": 8}}
    patch(builders.GROUP, builders.VERSION, NS, RL, "late", edit)
    wait_for(lambda: len(live_pods(kube, "late")) == 5, what="the gang, placed on the edited spec")
    run_all(kube, "late")
    wait_for(lambda: status(kube, "late").get("phase") == "Running", what="Running")
    first = sorted(live_pods(kube, "late"))
    patch(builders.GROUP, builders.VERSION, NS, RL, "late", {"spec": {"priority": 70}})  # a reconcile more
    wait_for(lambda: status(kube, "late").get("observedGeneration") == 3, what="the priority seen")
    assert "specChangeRefused" not in status(kube, "late")
    assert sorted(live_pods(kube, "late")) == first, "the gang was restarted"
    data = json.loads(kube.core.read_namespaced_config_map("late-config", NS).data["config.json"])
    assert data["spec"]["model"]["width"] == width * 2


def test_a_restarted_operator_restarts_a_failed_gang_once(cluster, kube: builders.Kube) -> None:
    from kube import operator as operator_mod

    with operator_mod.OperatorThread(cluster.api_client()):
        kube.create_job(NS, rl_job("once"), plural=RL)
        wait_for(lambda: len(live_pods(kube, "once")) == 3, what="the gang")
        run_all(kube, "once")
        wait_for(lambda: status(kube, "once").get("phase") == "Running", what="Running")
    end_pod(kube, "once-ray-worker-0", "Failed", 137)  # while no operator runs
    second = ["once-ray-head-0-g1", "once-ray-worker-0-g1", "once-ray-worker-1-g1"]
    with operator_mod.OperatorThread(cluster.api_client()):
        wait_for(lambda: sorted(live_pods(kube, "once")) == second, what="one new generation")
    # Another operator finds the restart in status: a reconcile (made certain by a spec change
    # no pod reads) leaves the new generation alone.
    with operator_mod.OperatorThread(cluster.api_client()):
        kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, RL, "once",
                                                   {"spec": {"priority": 60}})
        wait_for(lambda: status(kube, "once").get("observedGeneration") == 2, what="a reconcile")
        assert sorted(live_pods(kube, "once")) == second
    assert status(kube, "once")["restarts"] == 1
    wait_for(lambda: kube.has_event(NS, "once", "GangRestarted"), what="the GangRestarted event")
    assert len([e for e in kube.events(NS, "once") if e.reason == "GangRestarted"]) == 1


def test_the_controllers_progress_reaches_status_and_kubectl_get(cluster, kube: builders.Kube) -> None:
    """The head's controller serves /progress (a real ProgressServer at the loopback address the
    test reports as the head pod's IP); the operator's poll writes it into status."""
    import dataclasses

    from kube import operator as operator_mod

    from huorn.runtime.rl import progress

    state = progress.Progress("prog", 20)
    server = progress.ProgressServer(state, "127.0.0.6", 0)
    settings = dataclasses.replace(operator_mod.FAST, telemetry_port=server.port, monitor_seconds=0.2,
                                   progress_seconds=60.0)
    try:
        with operator_mod.OperatorThread(cluster.api_client(), settings):
            kube.create_job(NS, rl_job("prog"), plural=RL)
            wait_for(lambda: len(live_pods(kube, "prog")) == 3, what="the gang")
            for record in ({"event": "start", "resumed_from": 0}, {"event": "eval", "accuracy": 0.25},
                           {"event": "rl", "step": 0, "reward_mean": 0.5},
                           {"event": "rl", "step": 1, "reward_mean": 0.625,
                            "role_replicas": {"actorTrain": 2, "rollout": 1, "reference": 0, "reward": 0}}):
                state.record(record)  # before the job runs: no poll sees half of them
            run_all(kube, "prog")
            kube.core.patch_namespaced_pod_status("prog-ray-head-0", NS, {"status": {"podIP": "127.0.0.6"}})
            wait_for(lambda: status(kube, "prog").get("phase") == "Running", what="Running")
            first = wait_for(lambda: (s := status(kube, "prog")).get("step") == 2 and s, what="step 2")
            assert (first["progressPercent"], first["meanReward"], first["evalAccuracy"]) == (10, 0.625, 0.25)
            assert first["roleReplicas"] == {"actorTrain": 2, "rollout": 1, "reference": 0, "reward": 0}
            # More steps within progress_seconds wait; a new checkpoint is written at once, with them.
            state.record({"event": "rl", "step": 2, "reward_mean": 0.75})
            state.record({"event": "rl", "step": 3, "reward_mean": 0.75})
            assert status(kube, "prog")["step"] == 2
            state.record({"event": "checkpoint", "step": 4, "path": "/checkpoints/prog/step-4"})
            saved = wait_for(lambda: (s := status(kube, "prog")).get("lastCheckpoint") and s,
                             what="the checkpoint in status")
            assert saved["lastCheckpoint"] == {"step": 4, "path": "/checkpoints/prog/step-4"}
            assert saved["step"] == 4 and saved["progressPercent"] == 20
            assert saved["controllerRestarts"] == 0
            # the head ran its controller again on the same Ray cluster: in status at once, an Event
            state.record({"event": "start", "resumed_from": 4, "attempt": 2})
            again = wait_for(lambda: (s := status(kube, "prog")).get("controllerRestarts") == 1 and s,
                             what="the controller's restart in status")
            assert again["phase"] == "Running" and again.get("restarts", 0) == 0  # not a gang restart
            wait_for(lambda: any(e.reason == "ControllerRestarted" for e in kube.events(NS, "prog")),
                     what="a ControllerRestarted event")
            # what `kubectl get rlj` prints: the kind's printer columns read these fields
            from huorn.api import kinds

            columns = {c.name: c.json_path for c in kinds.RL_JOB.columns}
            assert columns["Step"] == ".status.step" and columns["Reward"] == ".status.meanReward"
            end_pod(kube, "prog-ray-head-0", "Succeeded", 0)
            done = wait_for(lambda: (s := status(kube, "prog")).get("phase") == "Succeeded" and s,
                            what="Succeeded")
            assert (done["step"], done["progressPercent"]) == (20, 100)
    finally:
        server.close()


def test_gpus_freed_by_a_finished_job_wake_a_waiting_one(cluster, kube: builders.Kube) -> None:
    """No resync in the test's time: only the freed GPUs' wake can place the waiting job."""
    import dataclasses

    from kube import operator as operator_mod

    settings = dataclasses.replace(operator_mod.FAST, resync_seconds=600.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        kube.create_job(NS, rl_job("first", gpus=8), plural=RL)  # all of "train"
        wait_for(lambda: len(live_pods(kube, "first")) == 5, what="the first gang")
        run_all(kube, "first")
        kube.create_job(NS, rl_job("second"), plural=RL)
        wait_for(lambda: status(kube, "second").get("message", "").startswith("waiting"), what="waiting")
        end_pod(kube, "first-ray-head-0", "Succeeded", 0)  # its workers are stopped, their GPUs freed
        placed = wait_for(lambda: len(names := sorted(live_pods(kube, "second"))) == 3 and names,
                          timeout=20, what="the second gang placed")
        assert placed == ["second-ray-head-0", "second-ray-worker-0", "second-ray-worker-1"]


def test_suspend_stops_the_head_before_its_workers_and_resume_starts_a_new_gang(
    kube: builders.Kube, operator
) -> None:
    kube.create_job(NS, rl_job("paused", suspend=True), plural=RL)
    waiting = wait_for(lambda: (s := status(kube, "paused")).get("phase") == "Suspended" and s,
                       what="Suspended")
    assert "waits without pods" in waiting["decisions"][-1]["reason"] and kube.pods(NS, "paused") == []
    # The phase comes first, in the decision's write-ahead; the conditions in the write after it.
    wait_for(lambda: kube.condition(NS, "paused", "Suspended", RL).get("status") == "True",
             what="the Suspended condition")
    patch = kube.custom.patch_namespaced_custom_object
    patch(builders.GROUP, builders.VERSION, NS, RL, "paused", {"spec": {"suspend": False}})
    first = ["paused-ray-head-0", "paused-ray-worker-0", "paused-ray-worker-1"]
    wait_for(lambda: sorted(live_pods(kube, "paused")) == first, what="the gang")
    run_all(kube, "paused")
    wait_for(lambda: status(kube, "paused").get("phase") == "Running", what="Running")

    patch(builders.GROUP, builders.VERSION, NS, RL, "paused", {"spec": {"suspend": True}})
    # The head goes first: the controller checkpoints through the training actor on a worker.
    wait_for(lambda: "paused-ray-head-0" not in live_pods(kube, "paused"), what="the head stopped")
    gone = wait_for(lambda: (s := status(kube, "paused")).get("message", "").startswith("suspended: no pods")
                    and s, what="every pod stopped")
    assert gone["replicas"] == 0 and live_pods(kube, "paused") == {}
    wait_for(lambda: [e.reason for e in kube.events(NS, "paused")].count("Suspended") >= 2,
             what="2 Suspended events")
    assert [e.reason for e in kube.events(NS, "paused")].count("Suspended") == 2
    wait_for(lambda: (kube.get_vc("train").get("status") or {}).get("allocated") == 0, what="GPUs freed")

    patch(builders.GROUP, builders.VERSION, NS, RL, "paused", {"spec": {"suspend": False}})
    second = ["paused-ray-head-0-g1", "paused-ray-worker-0-g1", "paused-ray-worker-1-g1"]
    wait_for(lambda: sorted(live_pods(kube, "paused")) == second, what="a new gang")
    now = status(kube, "paused")
    assert now["restarts"] == 0 and kube.condition(NS, "paused", "Suspended", RL)["status"] == "False"
    actions = [d["action"] for d in now["decisions"]]
    assert actions == ["insert", "suspend", "resume", "suspend", "resume"], actions


def test_a_suspended_gang_keeps_its_workers_until_the_head_has_checkpointed(cluster, kube: builders.Kube,
                                                                            operator) -> None:
    """The kubelet holds the head (a finalizer, as while its controller checkpoints through the
    training actor on a worker): the workers are not touched until the head is gone."""
    from kube.kubelet import Kubelet

    kubelet = Kubelet(kube, cluster.kmock, NS)
    kube.create_job(NS, rl_job("order"), plural=RL)
    wait_for(lambda: len(live_pods(kube, "order")) == 3, what="the gang")
    run_all(kube, "order")
    wait_for(lambda: status(kube, "order").get("phase") == "Running", what="Running")
    kubelet.hold(["order-ray-head-0"])
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, RL, "order",
                                               {"spec": {"suspend": True}})
    wait_for(lambda: ("order-ray-head-0", {}) in kubelet.deletes(), what="the head stopped")
    wait_for(lambda: "waiting for the controller" in status(kube, "order").get("message", ""),
             what="the suspension waiting for the head")
    assert not [n for n, _ in kubelet.deletes() if "worker" in n]
    kubelet.release(["order-ray-head-0"])
    wait_for(lambda: {n for n, _ in kubelet.deletes() if "worker" in n} ==
             {"order-ray-worker-0", "order-ray-worker-1"}, what="the workers stopped after the head")
    wait_for(lambda: status(kube, "order").get("message", "").startswith("suspended: no pods"), what="done")


def _running_gang(kube: builders.Kube, name: str) -> list[str]:
    """A four-GPU RLJob created and Running: its head and two workers, by pod name."""
    kube.create_job(NS, rl_job(name), plural=RL)
    first = [f"{name}-ray-head-0", f"{name}-ray-worker-0", f"{name}-ray-worker-1"]
    wait_for(lambda: sorted(live_pods(kube, name)) == first, what="the gang")
    run_all(kube, name)
    wait_for(lambda: status(kube, name).get("phase") == "Running", what="Running")
    return first


def test_more_gpus_join_the_running_ray_cluster_and_roles_scale_without_a_restart(
    kube: builders.Kube, operator
) -> None:
    """Roles that scale on their own: raising spec.gpus with roles.*.replicas adds Ray workers to
    the running cluster (the gang keeps running, nothing restarts) and writes the new replicas
    into the ConfigMap, which the running controller re-reads at every step
    (tests/test_runtime_rl.py runs that half). Lowering spec.gpus restarts the gang on fewer
    workers: a Ray node cannot leave under running actors."""
    first = _running_gang(kube, "grow")
    patch = kube.custom.patch_namespaced_custom_object
    patch(builders.GROUP, builders.VERSION, NS, RL, "grow",
          {"spec": {"gpus": 8, "roles": {"actorTrain": {"replicas": 2}, "rollout": {"replicas": 2}}}})
    more = ["grow-ray-worker-2", "grow-ray-worker-3"]
    wait_for(lambda: sorted(live_pods(kube, "grow")) == [*first, *more], what="two more workers")
    joining = wait_for(lambda: (s := status(kube, "grow")).get("observedGeneration") == 2 and s,
                       what="the change seen")
    assert joining["phase"] == "Running" and "2 more Ray worker(s) joining" in joining["message"]
    resize = joining["decisions"][-1]
    assert resize["action"] == "resize" and "adding 2 to the running Ray cluster" in resize["reason"]
    assert not any(d["action"] == "replace" for d in joining["decisions"])
    data = json.loads(kube.core.read_namespaced_config_map("grow-config", NS).data["config.json"])
    roles = data["spec"]["roles"]
    assert (roles["actorTrain"]["replicas"], roles["rollout"]["replicas"], data["spec"]["gpus"]) == (2, 2, 8)
    run_all(kube, "grow")
    wait_for(lambda: "4 GPU worker(s)" in status(kube, "grow").get("message", ""),
             what="four workers running")
    assert sorted(live_pods(kube, "grow")) == [*first, *more]  # none restarted

    patch(builders.GROUP, builders.VERSION, NS, RL, "grow",
          {"spec": {"gpus": 4, "roles": {"actorTrain": {"replicas": 1}, "rollout": {"replicas": 1}}}})
    second = ["grow-ray-head-0-g1", "grow-ray-worker-0-g1", "grow-ray-worker-1-g1"]
    wait_for(lambda: sorted(live_pods(kube, "grow")) == second, what="the gang restarted on two workers")
    after = status(kube, "grow")
    assert after["restarts"] == 0
    restarted = [d["reason"] for d in after["decisions"] if d["action"] == "replace"]
    assert any("fewer than the 4 running" in reason for reason in restarted), restarted


def test_taking_back_a_growth_that_never_started_restarts_nothing(kube: builders.Kube, operator) -> None:
    """More spec.gpus than the cluster has free: the growth's workers wait. Lowering spec.gpus
    back counted them as running and restarted the whole gang from its checkpoint ("fewer than
    the 6 running" with 2 running); they never started, so they go alone."""
    first = _running_gang(kube, "grow")
    patch = kube.custom.patch_namespaced_custom_object
    # 12 GPUs: four more workers of two on a cluster of 8 (borrowing 4), 4 of them taken: they wait
    patch(builders.GROUP, builders.VERSION, NS, RL, "grow",
          {"spec": {"gpus": 12, "roles": {"rollout": {"replicas": 5}}}})
    wait_for(lambda: status(kube, "grow").get("observedGeneration") == 2, what="the growth seen")
    assert sorted(live_pods(kube, "grow")) == first  # no growth worker placed
    patch(builders.GROUP, builders.VERSION, NS, RL, "grow",
          {"spec": {"gpus": 4, "roles": {"rollout": {"replicas": 1}}}})
    taken_back = wait_for(lambda: (s := status(kube, "grow")).get("observedGeneration") == 3
                          and s["decisions"][-1]["action"] == "resize" and s, what="the growth taken back")
    assert "never started" in taken_back["decisions"][-1]["reason"]
    assert not any(d["action"] == "replace" for d in taken_back["decisions"])
    assert sorted(live_pods(kube, "grow")) == first and taken_back["phase"] == "Running"


def test_a_worker_that_never_starts_is_replaced_alone(cluster, kube: builders.Kube) -> None:
    """A Ray worker added to a running gang that stays Pending past trainer_start_seconds never
    held an actor: it alone is replaced, and the controller, the head and the other workers go
    on (before, any pod that ended or never started restarted the whole gang)."""
    settings = dataclasses.replace(operator_mod.FAST, trainer_start_seconds=3.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        kube.create_job(NS, rl_job("slow"), plural=RL)
        first = ["slow-ray-head-0", "slow-ray-worker-0", "slow-ray-worker-1"]
        wait_for(lambda: sorted(live_pods(kube, "slow")) == first, what="the gang")
        run_all(kube, "slow")
        wait_for(lambda: status(kube, "slow").get("phase") == "Running", what="Running")
        grow = {"spec": {"gpus": 6, "roles": {"rollout": {"replicas": 2}}}}
        kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, RL, "slow", grow)
        wait_for(lambda: "slow-ray-worker-2" in live_pods(kube, "slow"), what="a third worker")
        # the kubelet never starts it
        wait_for(lambda: sorted(live_pods(kube, "slow")) == [*first, "slow-ray-worker-2-g1"],
                 what="the third worker replaced alone", timeout=30)
        now = status(kube, "slow")
        assert now["phase"] == "Running"
        replaced = [d for d in now["decisions"] if d["action"] == "replace"]
        assert len(replaced) == 1 and "only that Ray worker is replaced" in replaced[0]["reason"]
        assert "did not start within 3 s" in replaced[0]["reason"]


def test_a_progress_poll_from_before_the_end_does_not_overwrite_succeeded(cluster,
                                                                           kube: builders.Kube) -> None:
    """The progress poll reads the job Running, then waits on the head's /progress; the reconcile
    may mark it Succeeded (step and progress at their end) meanwhile. Written after that, the older
    reading stayed for good: nothing rewrites a finished RLJob. The head here is a real HTTP server
    that, asked for its progress, lets the job finish first (the write the reconcile makes), then
    answers with step 19 of 20."""
    import http.server
    import threading

    from huorn.api import rl as rl_api
    from huorn.backends.kubernetes import client as kube_client
    from huorn.backends.kubernetes import manifests
    from huorn.graph import compiler, serialise
    from huorn.operator import context, index, rljobs, validation

    kube.create_job(NS, rl_job("race"), plural=RL)
    body = kube.get_job(NS, "race", RL)
    job = validation.load_job(body)
    graph = rljobs.restore_graph(body, compiler.compile(job), rl_api.ray_layout(job.spec))
    running = {"phase": "Running", "graph": serialise.to_status(graph), "step": 10, "progressPercent": 50}
    kube.custom.patch_namespaced_custom_object_status(builders.GROUP, builders.VERSION, NS, RL, "race",
                                                      {"status": running})

    class Head(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            done = {"phase": "Succeeded", "step": 20, "progressPercent": 100}
            kube.custom.patch_namespaced_custom_object_status(builders.GROUP, builders.VERSION, NS, RL,
                                                              "race", {"status": done})
            answer = json.dumps({"step": 19, "steps": 20}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.7", 0), Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        settings = dataclasses.replace(operator_mod.FAST, telemetry_port=server.server_address[1])
        ctx = context.Context(client=kube_client.KubeClient(cluster.api_client()), post_event=lambda *_: None,
                              settings=settings)
        ref = manifests.JobRef.from_body(body)
        head = manifests.pod_name(ref, graph.vertex(rl_manifests.HEAD).instances[0])
        ctx.index.pods[(NS, head)] = index.PodRecord(NS, head, "race", rl_manifests.HEAD, "ray-head-0", "a0",
                                                     0, 0, "train", phase="Running", ip="127.0.0.7")
        assert cluster.call(rljobs.tick(ctx, NS, "race")) is None  # nothing written
    finally:
        server.shutdown()
        server.server_close()
    done = status(kube, "race")
    assert (done["phase"], done["step"], done["progressPercent"]) == ("Succeeded", 20, 100)
