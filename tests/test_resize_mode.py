"""spec.elasticity.resize from the manifest to the replica's command line: `auto` decided by the
replica's shape, the rule that refuses inPlace for a multi-process replica (in the model and in
the CRD's CEL), the trainer vertex's `resize` parameter, and the command a local replica and a
trainer pod then run (the trainer itself in place, a torchrun agent otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from api_support import build_manifest, crd_errors

from huorn import graph
from huorn.api import manifests, training
from huorn.api.common import ResizeMode
from huorn.backends.kubernetes import manifests as k8s
from huorn.backends.local import commands
from huorn.graph import jobs, model
from huorn.graph.model import Instance
from huorn.runtime import launcher

# The replica shapes that matter: (patch of the spec, what `auto` must become).
SHAPES = {
    "one GPU, DDP": ({"resources": {"gpus": 1}}, ResizeMode.IN_PLACE),
    "CPU only": ({"resources": {"gpus": 0}}, ResizeMode.IN_PLACE),
    "two pipeline stages": ({"resources": {"gpus": 1}, "parallelism": {"pipelineStages": 2}},
                            ResizeMode.RESTART),
    "two GPUs per replica": ({"resources": {"gpus": 2}}, ResizeMode.RESTART),
    "two pipeline stages on CPU": ({"resources": {"gpus": 0}, "parallelism": {"pipelineStages": 2}},
                                   ResizeMode.RESTART),
}


def _spec(patch: dict[str, Any]) -> training.TrainingJobSpec:
    job = manifests.load_manifest(build_manifest("TrainingJob", patch))
    assert isinstance(job.spec, training.TrainingJobSpec)
    return job.spec


def _patch(base: dict[str, Any], resize: str | None) -> dict[str, Any]:
    elasticity = {"minReplicas": 1, "maxReplicas": 3, **({"resize": resize} if resize else {})}
    return {**base, "elasticity": elasticity}


def _trainer(shape: str, resize: str | None = None) -> model.Vertex:
    """The trainer vertex compiled from a job of that replica shape."""
    manifest = build_manifest("TrainingJob", _patch(SHAPES[shape][0], resize))
    return graph.compile(manifests.load_manifest(manifest)).vertex("trainer")


def test_the_default_is_auto() -> None:
    spec = _spec({})
    assert spec.elasticity.resize is ResizeMode.AUTO
    assert spec.to_wire()["elasticity"]["resize"] == "auto"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_auto_resizes_in_place_exactly_when_a_replica_is_one_process(shape: str) -> None:
    patch, expected = SHAPES[shape]
    assert training.resolve_resize(_spec(_patch(patch, None))) is expected
    trainer = _trainer(shape)
    assert trainer.params["resize"] == expected.value
    assert jobs.resizes_in_place(trainer) is (expected is ResizeMode.IN_PLACE)


def test_an_explicit_mode_is_kept() -> None:
    one_gpu = SHAPES["one GPU, DDP"][0]
    assert training.resolve_resize(_spec(_patch(one_gpu, "restart"))) is ResizeMode.RESTART
    assert training.resolve_resize(_spec(_patch(one_gpu, "inPlace"))) is ResizeMode.IN_PLACE
    pipeline = SHAPES["two pipeline stages"][0]
    assert training.resolve_resize(_spec(_patch(pipeline, "restart"))) is ResizeMode.RESTART


@pytest.mark.parametrize("shape", ["two pipeline stages", "two GPUs per replica"])
def test_in_place_for_a_multi_process_replica_is_refused_naming_the_field_and_the_fix(shape: str) -> None:
    manifest = build_manifest("TrainingJob", _patch(SHAPES[shape][0], "inPlace"))
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(manifest)
    assert [error.path for error in caught.value.errors] == ["spec.elasticity.resize"]
    text = str(caught.value)
    assert "can be inPlace only when a replica is one trainer process" in text
    assert "use resize: restart" in text
    refused = crd_errors("TrainingJob", manifest)  # the API server refuses it too
    assert len(refused) == 1 and "self.elasticity.resize != 'inPlace'" in refused[0]


def test_a_graph_from_before_the_parameter_keeps_torchrun() -> None:
    vertex = _trainer("CPU only")
    del vertex.params["resize"]
    assert not jobs.resizes_in_place(vertex)


def test_local_replica_in_place_is_the_trainer_with_the_agents_rendezvous_settings(tmp_path: Path) -> None:
    vertex = _trainer("CPU only")
    config = tmp_path / "config.json"
    argv = commands.build_agent_command(config, vertex, "127.0.0.1:29400", "job", "127.0.0.3",
                                        {"keep_alive_interval": 2}, python="py")
    settings = launcher.ElasticSettings(min_nodes=1, max_nodes=3, rdzv_endpoint="127.0.0.1:29400",
                                        rdzv_id="job", local_addr="127.0.0.3", keep_alive_interval=2)
    assert argv == launcher.build_in_place_command(config, settings, python="py")
    assert "huorn.runtime.agent" not in argv and "--in-place" in argv


@pytest.mark.parametrize(("shape", "resize", "nproc"), [
    ("CPU only", "restart", 1),
    ("two pipeline stages", None, 2),
])
def test_local_replica_under_restart_is_a_torchrun_agent(tmp_path: Path, shape: str, resize: str | None,
                                                          nproc: int) -> None:
    vertex = _trainer(shape, resize)
    config = tmp_path / "config.json"
    argv = commands.build_agent_command(config, vertex, "127.0.0.1:29400", "job", "127.0.0.3", python="py")
    settings = launcher.ElasticSettings(min_nodes=1, max_nodes=3, rdzv_endpoint="127.0.0.1:29400",
                                        rdzv_id="job", local_addr="127.0.0.3", nproc_per_node=nproc)
    assert argv == launcher.build_agent_command(config, settings, python="py")


def _pod_command(shape: str, resize: str | None = None) -> list[str]:
    body = build_manifest("TrainingJob", _patch(SHAPES[shape][0], resize), name="llm")
    body["metadata"].update(namespace="team", uid="u-1")
    ref = k8s.JobRef.from_body(body)
    g = graph.compile(manifests.load_manifest(body))
    spec = {**body["spec"], "image": "mirror.example/huorn:1"}  # resolved already (operator.images.pin)
    pod = k8s.build_trainer_pod(ref, g, Instance("trainer", 0), "node-1", spec, "vc")
    return pod["spec"]["containers"][0]["command"]


CONFIG_IN_POD = "/etc/huorn/config.json"


def _pod_settings(nproc: int) -> launcher.ElasticSettings:
    return launcher.ElasticSettings(min_nodes=1, max_nodes=3, rdzv_endpoint="llm-rdzv.team.svc:29400",
                                    rdzv_id="u-1", nproc_per_node=nproc)


def test_trainer_pod_in_place_runs_the_trainer_itself() -> None:
    expected = launcher.build_in_place_command(CONFIG_IN_POD, _pod_settings(1), python="python")
    assert _pod_command("one GPU, DDP") == expected


@pytest.mark.parametrize(("shape", "resize", "nproc"), [
    ("one GPU, DDP", "restart", 1),
    ("two GPUs per replica", None, 2),
    # a pod without GPUs runs a process per stage, as a local replica does: it had run one, half
    # a pipeline per pod, and a gang of an odd number of pods could not form its pipelines
    ("two pipeline stages on CPU", None, 2),
])
def test_trainer_pod_under_restart_runs_a_torchrun_agent(shape: str, resize: str | None, nproc: int) -> None:
    expected = launcher.build_agent_command(CONFIG_IN_POD, _pod_settings(nproc), python="python")
    assert _pod_command(shape, resize) == expected
