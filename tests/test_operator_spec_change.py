"""Editing a running TrainingJob's spec: real kopf against KMock.

A running process reads its spec once, at its start. So an edit the gang cannot follow live (an
image, env, data, optimization, resources...) restarts the whole gang from its checkpoint on the
new spec, an uncounted drain of every trainer pod; fields the scheduler and the monitor read
(priority, elasticity, remediation, suspend, deadlines) change nothing in the pods; and an edit of
spec.model is refused once the job has started, because its checkpoints hold the architecture the gang
started with. Before, every edit went into the ConfigMap at once and nothing else happened: the
gang ran the old spec until some restart mixed in the new one, and a new model failed the job then.
"""

from __future__ import annotations

from pathlib import Path

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.kubelet import Kubelet

from huorn.backends.kubernetes import manifests
from huorn.runtime import config as run_config

pytest_plugins = ["kube.fixtures"]

NS = "team"


def trainers(kube: builders.Kube) -> list[str]:
    return [p.metadata.name for p in kube.pods(NS, "llm", "trainer") if not p.metadata.deletion_timestamp]


def run_config_of(kube: builders.Kube, tmp_path: Path) -> run_config.RunConfig:
    ref = manifests.JobRef.from_body(kube.get_job(NS, "llm"))
    path = tmp_path / "config.json"
    path.write_text(kube.core.read_namespaced_config_map(manifests.config_map_name(ref), NS).data[
        manifests.CONFIG_FILE])
    return run_config.load_run_config(path)


def patch_spec(kube: builders.Kube, spec: dict) -> None:
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs", "llm",
                                               {"spec": spec})


def events(kube: builders.Kube, reason: str) -> list:
    return [e for e in kube.events(NS, "llm") if e.reason == reason]


def start_running(kube: builders.Kube) -> None:
    kube.create_job(NS, builders.make_training_job("llm", "train", replicas=2, max_replicas=2, gpus=2,
                                                   remediation={"maxRestarts": 1}))
    wait_for(lambda: len(trainers(kube)) == 2, what="2 trainer pods")
    kube.run_all_pods(NS, "llm")
    wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Running", what="Running")


def test_an_edit_the_gang_cannot_follow_live_restarts_it_on_the_new_spec_once(
        cluster: EmulatedCluster, kube: builders.Kube, tmp_path: Path) -> None:
    kubelet = Kubelet(kube, cluster.kmock, NS)  # type: ignore[arg-type]
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        start_running(kube)
        # a field the scheduler reads: nothing happens to the pods
        patch_spec(kube, {"priority": 70})
        wait_for(lambda: run_config_of(kube, tmp_path).spec.priority == 70, what="the priority in the config")
        assert kubelet.deletes() == [] and not events(kube, "SpecChanged")

        kubelet.hold(trainers(kube))
        patch_spec(kube, {"env": [{"name": "EXTRA", "value": "2"}], "optimization": {"learningRate": 1e-4}})
        wait_for(lambda: len(kubelet.deletes()) >= 2, what="both trainer pods deleted")
        assert sorted(n for n, _ in kubelet.deletes()) == ["llm-trainer-0", "llm-trainer-1"]
        assert all("gracePeriodSeconds" not in params for _, params in kubelet.deletes())  # their own 30 s
        (changed,) = events(kube, "SpecChanged")
        assert changed.message == ("spec changed (spec.env, spec.optimization): the gang restarts on the new "
                                   "spec from its checkpoint")
        kubelet.release(["llm-trainer-0", "llm-trainer-1"])
        wait_for(lambda: trainers(kube) == ["llm-trainer-0-g1", "llm-trainer-1-g1"], what="the successors")
        new = run_config_of(kube, tmp_path).spec  # what the successors start from
        assert new.optimization.learning_rate == 1e-4 and [e.value for e in new.env] == ["2"]
        kube.run_all_pods(NS, "llm")
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Running", what="Running again")
        status = kube.job_status(NS, "llm")
        assert [d["action"] for d in status["decisions"]].count("replace") == 2
        assert status.get("restartsUsed", 0) == 0  # the user's restart, not a failure
        assert len(events(kube, "SpecChanged")) == 1
        assert trainers(kube) == ["llm-trainer-0-g1", "llm-trainer-1-g1"]


def test_an_edit_of_the_model_is_refused_while_the_job_runs(
        cluster: EmulatedCluster, kube: builders.Kube, tmp_path: Path) -> None:
    kubelet = Kubelet(kube, cluster.kmock, NS)  # type: ignore[arg-type]
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        start_running(kube)
        width = run_config_of(kube, tmp_path).spec.model.width
        patch_spec(kube, {"model": {"width": width * 2}})
        (refused,) = wait_for(lambda: events(kube, "SpecChangeRefused"), what="the refusal")
        assert refused.type == "Warning"
        assert refused.message.startswith("spec.model changed after the job started")
        assert "revert spec.model" in refused.message and "task.initCheckpoint" in refused.message
        # the Event goes out during the reconcile, the status with its write at the end
        wait_for(lambda: kube.job_status(NS, "llm").get("specChangeRefused") == refused.message,
                 what="the refusal in status")
        assert kubelet.deletes() == [] and run_config_of(kube, tmp_path).spec.model.width == width
        # a member replaced meanwhile starts on the architecture the gang runs
        kube.set_pod_phase(NS, "llm-trainer-1", "Failed", exit_code=1)
        wait_for(lambda: "llm-trainer-1-g1" in trainers(kube), what="the replacement")
        assert run_config_of(kube, tmp_path).spec.model.width == width
        assert len(events(kube, "SpecChangeRefused")) == 1
        # reverted: the refusal leaves status, and nothing restarts for it
        patch_spec(kube, {"model": {"width": width}})
        wait_for(lambda: "specChangeRefused" not in kube.job_status(NS, "llm"), what="the refusal cleared")
        assert not events(kube, "SpecChanged")


def test_an_edit_of_the_model_of_a_suspended_job_with_checkpoints_is_refused_too(
        cluster: EmulatedCluster, kube: builders.Kube, tmp_path: Path) -> None:
    """No pod runs, but the checkpoints on the volume hold the old architecture, and the resumed
    gang would load them."""
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        start_running(kube)
        width = run_config_of(kube, tmp_path).spec.model.width
        kube.custom.patch_namespaced_custom_object_status(  # what the monitor recorded while it ran
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "llm",
            {"status": {"lastCheckpoint": {"step": 40, "path": "/checkpoints/llm/step-00000040"}}})
        patch_spec(kube, {"suspend": True})
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Suspended", what="Suspended")
        wait_for(lambda: not kube.pods(NS, "llm", "trainer"), what="no trainer pod")
        patch_spec(kube, {"model": {"width": width * 2}})
        wait_for(lambda: kube.job_status(NS, "llm").get("specChangeRefused"), what="the refusal")
        patch_spec(kube, {"suspend": False})
        wait_for(lambda: len(trainers(kube)) == 2, what="the resumed gang")
        assert run_config_of(kube, tmp_path).spec.model.width == width


def test_a_spec_written_by_an_older_operator_is_read_with_todays_defaults() -> None:
    """An operator upgrade whose API adds a defaulted field must restart no gang: the spec in force
    is read through today's model before it is compared."""
    from huorn.api import training as training_api
    from huorn.operator import training

    body = builders.make_training_job("llm", "train")["spec"]
    desired = training_api.TrainingJobSpec.model_validate(body).to_wire()
    older = {k: v for k, v in desired.items() if k != "parallelism"}  # as if written before it existed
    assert training.spec_changes(older, desired) == []
    assert training.spec_changes(desired, {**desired, "image": "other:1"}) == ["image"]
    assert training.spec_changes(desired, {**desired, "priority": 1}) == []  # live
    # where new replicas go: those placed before stay, and nothing restarts
    assert training.spec_changes(desired, {**desired, "nodeSelector": {"gpu": "h100"}}) == []
    assert training.spec_changes({"model": "not a model"}, desired) == []  # unreadable: nothing to roll
