"""Secrets, private registries and service accounts in every pod a job's kind creates.

Users coming from Kubeflow Trainer or KubeRay keep their HF and W&B tokens in Secrets and their
images in private registries. spec.env took only name/value, and no pod could set
imagePullSecrets or serviceAccountName. Every job kind now has `env[].valueFrom`
(secretKeyRef, configMapKeyRef), `imagePullSecrets` and `serviceAccountName`, rendered into
each of its pods; a job that sets none of them renders the same pods as before, byte for byte,
so an operator upgrade rolls no serving replica and restarts no RL gang."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from api_support import build_manifest, crd_errors, openapi_schema
from typer.testing import CliRunner

from huorn import graph
from huorn.api import base, manifests
from huorn.backends.kubernetes import manifests as k8s
from huorn.backends.kubernetes import rl_manifests as rlm
from huorn.cli import main
from huorn.graph.model import Instance

KINDS = ("TrainingJob", "RLJob", "InferenceJob")
IMAGE = "mirror.example/huorn:1"  # resolved already (huorn.operator.images.pin)

SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
CONFIG_REF = {"name": "wandb.settings", "key": "project", "optional": True}
CONFIG_ENV = {"name": "WANDB_PROJECT", "valueFrom": {"configMapKeyRef": CONFIG_REF}}
SETTINGS = {
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, SECRET_ENV, CONFIG_ENV],
    "imagePullSecrets": [{"name": "registry-creds"}, {"name": "mirror.pull"}],
    "serviceAccountName": "trainer.workload-identity",
}
# What the pods get: optional is written out (false, Kubernetes' default) where it was left out.
RENDERED_ENV = [
    {"name": "NCCL_DEBUG", "value": "INFO"},
    {"name": "HF_TOKEN",
     "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": False}}},
    {"name": "WANDB_PROJECT", "valueFrom": {"configMapKeyRef": CONFIG_REF}},
]
# Pods whose container runs the job's own code, and so gets spec.env. The rendezvous store and
# the serving front (activator or router) run Huorn's code only, and never had spec.env.
RUNS_JOB_CODE = {"trainer", "eval", "ray-head", "ray-worker", "server"}


def render(kind: str, patch: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every pod `kind` creates, by role, for a job of `patch`, as the operator renders them
    from the validated spec in wire form (what the API server stores)."""
    body = build_manifest(kind, patch, name="job")
    body["metadata"].update(namespace="team", uid="u-1")
    job = manifests.load_manifest(body)
    spec = {**job.spec.to_wire(), "image": IMAGE}
    ref = k8s.JobRef.from_body(body)
    if kind == "TrainingJob":
        g = graph.compile(job)
        landed = {"vertex": "trainer", "step": 6, "path": "/checkpoints/step-6"}
        return {"trainer": k8s.build_trainer_pod(ref, g, Instance("trainer", 0), "node-1", spec, "vc"),
                "store": k8s.build_store_pod(ref, Instance("rendezvous", 0), spec),
                "eval": k8s.build_eval_pod(ref, Instance("eval", 0), spec, landed)}
    if kind == "RLJob":
        return {"ray-head": rlm.build_head_pod(ref, Instance(rlm.HEAD, 0), spec, "vc", worker_gpus=2),
                "ray-worker": rlm.build_worker_pod(ref, Instance(rlm.WORKER, 0), spec, 2, "node-1", "vc")}
    routed = {**spec, "routing": {"policy": "prefix"}}
    return {"server": k8s.build_serve_pod(ref, Instance("server", 0), "node-1", spec, "vc"),
            "activator": k8s.build_activator_pod(ref, spec),
            "router": k8s.build_activator_pod(ref, routed)}


def digests(kind: str, patch: dict[str, Any]) -> dict[str, str]:
    return {role: hashlib.sha256(json.dumps(pod, sort_keys=True).encode()).hexdigest()[:16]
            for role, pod in render(kind, patch).items()}


# A job with plain env values and no new field, rendered by the operator before these fields
# existed (commit 82b0fb2): the same JSON, byte for byte, must come out now.
PLAIN = {"env": [{"name": "NCCL_DEBUG", "value": "INFO"}, {"name": "EMPTY"}]}
BEFORE = {
    "TrainingJob": {"trainer": "1a27ba11d373c224", "store": "1d20a9f00a934849", "eval": "58c10a867c374841"},
    "RLJob": {"ray-head": "fe07c9ae015b76a7", "ray-worker": "2c3d37e79f82f358"},
    "InferenceJob": {"server": "8cc78ac2d0dea7a0", "activator": "393ea1ce5092b478",
                     "router": "8bb40873c2919617"},
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_without_the_new_fields_renders_the_pods_it_rendered_before(kind: str) -> None:
    assert digests(kind, PLAIN) == BEFORE[kind]
    for role, pod in render(kind, PLAIN).items():
        assert "serviceAccountName" not in pod["spec"] and "imagePullSecrets" not in pod["spec"], role


def test_serving_template_hashes_do_not_change_for_a_job_without_the_new_fields() -> None:
    """A running InferenceJob's replicas and front pods are rolled when their hash changes."""
    spec = manifests.load_manifest(build_manifest("InferenceJob", PLAIN)).spec.to_wire()
    assert "imagePullSecrets" not in spec and "serviceAccountName" not in spec
    assert all("valueFrom" not in e for e in spec["env"])
    assert (k8s.serve_template_hash(spec), k8s.front_template_hash(spec)) == SERVING_HASHES_BEFORE
    assert rlm.template_hash(manifests.load_manifest(build_manifest("RLJob", PLAIN)).spec.to_wire()) == \
        RL_HASH_BEFORE


SERVING_HASHES_BEFORE = ("533a7104b7ad709d", "96c6fd53bf6ec670")
RL_HASH_BEFORE = "5caeef06c35eaffc"


@pytest.mark.parametrize("kind", KINDS)
def test_every_pod_of_the_kind_gets_the_settings(kind: str) -> None:
    for role, pod in render(kind, SETTINGS).items():
        spec = pod["spec"]
        assert spec["serviceAccountName"] == "trainer.workload-identity", role
        assert spec["imagePullSecrets"] == [{"name": "registry-creds"}, {"name": "mirror.pull"}], role
        env = spec["containers"][0].get("env", [])
        if role in RUNS_JOB_CODE:
            assert env[-3:] == RENDERED_ENV, role  # after Huorn's own: spec.env overrides them
        else:
            assert not any(e["name"] in {"HF_TOKEN", "WANDB_PROJECT"} for e in env), role


def test_changing_the_settings_rolls_serving_pods_and_restarts_an_rl_gang() -> None:
    """The new settings are read at a pod's start: a running pod with other ones is replaced."""
    plain = manifests.load_manifest(build_manifest("InferenceJob", PLAIN)).spec.to_wire()
    for field, value in SETTINGS.items():
        changed = manifests.load_manifest(build_manifest("InferenceJob", {field: value})).spec.to_wire()
        assert k8s.serve_template_hash(changed) != k8s.serve_template_hash(plain), field
        if field != "env":  # the front pods do not get spec.env
            assert k8s.front_template_hash(changed) != k8s.front_template_hash(plain), field
        rl = manifests.load_manifest(build_manifest("RLJob", {field: value})).spec.to_wire()
        assert rlm.template_hash(rl) not in rlm.template_hashes(
            manifests.load_manifest(build_manifest("RLJob")).spec.to_wire()), field


@pytest.mark.parametrize("kind", KINDS)
def test_the_settings_are_valid_for_every_kind(kind: str, tmp_path: Path) -> None:
    manifest = build_manifest(kind, SETTINGS, name="with-secrets")
    assert crd_errors(kind, manifest) == []
    result = CliRunner().invoke(main.app, ["validate", str(_write(tmp_path, manifest))])
    assert result.exit_code == 0, result.stderr


BOTH = {"secretKeyRef": {"name": "a", "key": "k"}, "configMapKeyRef": {"name": "b", "key": "k"}}
NOT_SUBDOMAIN = ("is not a DNS subdomain (the name of a Secret, ConfigMap or ServiceAccount): use at "
                 "most 253 lowercase letters, digits, '-' and '.', starting and ending with a letter or "
                 "digit")
ONE_REF = ("valueFrom needs exactly one of secretKeyRef and configMapKeyRef; keep one of them; a second "
           "variable can read the other")
ONE_REF_CEL = ".spec.env[0].valueFrom: has(self.secretKeyRef) != has(self.configMapKeyRef) -> False"
PATTERN = repr(base.DNS_SUBDOMAIN_PATTERN)
# (patch, huorn validate's path and message, the CRD's error as the API server's schema gives it)
REFUSED = [
    ({"env": [{"name": "TOKEN", "value": "x", "valueFrom": {"secretKeyRef": {"name": "a", "key": "k"}}}]},
     ("spec.env[0].valueFrom", "must not be set with a non-empty value: a variable takes its value from "
      "one place; remove value, or remove valueFrom"),
     ".spec.env[0]: !has(self.valueFrom) || self.value == '' -> False"),
    ({"env": [{"name": "TOKEN", "valueFrom": BOTH}]}, ("spec.env[0].valueFrom", ONE_REF), ONE_REF_CEL),
    ({"env": [{"name": "TOKEN", "valueFrom": {}}]}, ("spec.env[0].valueFrom", ONE_REF), ONE_REF_CEL),
    ({"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "Bad_Name", "key": "k"}}}]},
     ("spec.env[0].valueFrom.secretKeyRef.name", f"'Bad_Name' {NOT_SUBDOMAIN}"),
     f"spec.env.0.valueFrom.secretKeyRef.name: 'Bad_Name' does not match {PATTERN}"),
    ({"env": [{"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "a"}}}]},
     ("spec.env[0].valueFrom.secretKeyRef.key", "required field is missing"),
     "spec.env.0.valueFrom.secretKeyRef: 'key' is a required property"),
    ({"env": [{"name": "TOKEN", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]},
     ("spec.env[0].valueFrom.fieldRef", "unknown field; check its spelling and case against docs/api.md"),
     "spec.env.0.valueFrom: Additional properties are not allowed ('fieldRef' was unexpected)"),
    ({"imagePullSecrets": [{"name": "Registry"}]},
     ("spec.imagePullSecrets[0].name", f"'Registry' {NOT_SUBDOMAIN}"),
     f"spec.imagePullSecrets.0.name: 'Registry' does not match {PATTERN}"),
    ({"imagePullSecrets": ["registry-creds"]},
     ("spec.imagePullSecrets[0]", "Input should be an object (got 'registry-creds'); give an object with "
                                  "name, as {name: 'registry-creds'}"),
     "spec.imagePullSecrets.0: 'registry-creds' is not of type 'object'"),
    ({"serviceAccountName": "-runner"},
     ("spec.serviceAccountName", f"'-runner' {NOT_SUBDOMAIN}"),
     f"spec.serviceAccountName: '-runner' does not match {PATTERN}"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("patch", "validate", "crd"), REFUSED)
def test_huorn_validate_refuses_naming_the_field(kind: str, patch: dict[str, Any], validate: tuple[str, str],
                                                 crd: str) -> None:
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(build_manifest(kind, patch))
    assert [(e.path, e.message) for e in caught.value.errors] == [validate]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("patch", "validate", "crd"), REFUSED)
def test_the_crd_refuses_naming_the_field(kind: str, patch: dict[str, Any], validate: tuple[str, str],
                                          crd: str) -> None:
    assert crd_errors(kind, build_manifest(kind, patch)) == [crd]


def test_the_crd_reports_a_value_with_value_from_at_value_from() -> None:
    """The API server puts a rule's error at its fieldPath; api_support reports the node."""
    env = openapi_schema("RLJob")["properties"]["spec"]["properties"]["env"]["items"]
    assert {r["fieldPath"] for r in env["x-kubernetes-validations"]} == {".valueFrom"}


def _write(directory: Path, manifest: dict[str, Any]) -> Path:
    path = directory / f"{manifest['kind']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path
