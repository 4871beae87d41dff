"""Secrets, private registries and service accounts in every pod a job's kind creates.

Users coming from Kubeflow Trainer or KubeRay keep their HF and W&B tokens in Secrets and their
images in private registries. spec.env took only name/value, and no pod could set
imagePullSecrets or serviceAccountName. Every job kind now has `env[].valueFrom`
(secretKeyRef, configMapKeyRef), `imagePullSecrets` and `serviceAccountName`, rendered into
each of its pods; a job that sets none of them renders the same pods as before, byte for byte,
so an operator upgrade rolls no serving replica and restarts no RL gang.

`podMetadata` (labels and annotations) came after, for what platform teams put on pods: a
mesh's sidecar switch, cost labels, what NetworkPolicies select. Huorn's own keys are refused
by the model (the CRD cannot check a map's keys within the API server's CEL cost budget) and
win over a job's in every pod whatever a stored spec holds."""

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
from huorn.operator import training as training_op

KINDS = ("TrainingJob", "RLJob", "InferenceJob")
IMAGE = "mirror.example/huorn:1"  # resolved already (huorn.operator.images.pin)

SECRET_ENV = {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
CONFIG_REF = {"name": "wandb.settings", "key": "project", "optional": True}
CONFIG_ENV = {"name": "WANDB_PROJECT", "valueFrom": {"configMapKeyRef": CONFIG_REF}}
SETTINGS = {
    "env": [{"name": "NCCL_DEBUG", "value": "INFO"}, SECRET_ENV, CONFIG_ENV],
    "imagePullSecrets": [{"name": "registry-creds"}, {"name": "mirror.pull"}],
    "serviceAccountName": "trainer.workload-identity",
    "podMetadata": {"labels": {"team": "nlp", "example.com/cost-centre": "r-42", "empty": ""},
                    "annotations": {"sidecar.istio.io/inject": "false", "example.com/note": "a b: c"}},
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


# An RLJob as the API server stored it before 2026-12-07: the CRD wrote the algorithm fields'
# defaults of then into it (they have none now, so that `name` picks its preset). A stored RLJob
# keeps them, and so its gang's hash.
STORED_RL = {**PLAIN, "algorithm": {"name": "grpo", "groupSize": 8, "clipLow": 0.2, "clipHigh": 0.2,
                                    "klCoefficient": 0.0, "advantageMean": "group", "advantageStd": "group",
                                    "lossAggregation": "sequence", "dynamicSampling": False}}
BEFORE_FIELDS = {"TrainingJob": PLAIN, "RLJob": STORED_RL, "InferenceJob": PLAIN}


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_without_the_new_fields_renders_the_pods_it_rendered_before(kind: str) -> None:
    assert digests(kind, BEFORE_FIELDS[kind]) == BEFORE[kind]
    for role, pod in render(kind, PLAIN).items():
        assert "serviceAccountName" not in pod["spec"] and "imagePullSecrets" not in pod["spec"], role


def test_serving_template_hashes_do_not_change_for_a_job_without_the_new_fields() -> None:
    """A running InferenceJob's replicas and front pods are rolled when their hash changes."""
    spec = manifests.load_manifest(build_manifest("InferenceJob", PLAIN)).spec.to_wire()
    assert "imagePullSecrets" not in spec and "serviceAccountName" not in spec
    assert all("valueFrom" not in e for e in spec["env"])
    assert (k8s.serve_template_hash(spec), k8s.front_template_hash(spec)) == SERVING_HASHES_BEFORE
    assert rlm.template_hash(manifests.load_manifest(build_manifest("RLJob", STORED_RL)).spec.to_wire()) == \
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


@pytest.mark.parametrize("kind", KINDS)
def test_every_pod_of_the_kind_carries_the_pod_metadata_under_huorns_own(kind: str) -> None:
    plain = render(kind, PLAIN)
    for role, pod in render(kind, SETTINGS).items():
        meta, before = pod["metadata"], plain[role]["metadata"]
        assert meta["labels"] == {**SETTINGS["podMetadata"]["labels"], **before["labels"]}, role
        # the spec's hash is Huorn's annotation too, and differs with the spec
        own = {k: v for k, v in before["annotations"].items() if k != k8s.ANNOTATION_TEMPLATE}
        assert {k: v for k, v in meta["annotations"].items() if k != k8s.ANNOTATION_TEMPLATE} == \
            {**SETTINGS["podMetadata"]["annotations"], **own}, role
        template = k8s.ANNOTATION_TEMPLATE
        assert (template in meta["annotations"]) == (template in before["annotations"]), role
        assert meta["labels"][k8s.LABEL_JOB] == "job", role
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "huorn", role


def test_huorns_own_keys_win_over_a_stored_spec_that_holds_them() -> None:
    """The model refuses them, but a spec may reach the operator another way (a CRD applied
    without the operator's validation in front): the pods stay findable by their selectors."""
    body = build_manifest("TrainingJob", {}, name="job")
    body["metadata"].update(namespace="team", uid="u-1")
    spec = {**manifests.load_manifest(body).spec.to_wire(), "image": IMAGE,
            "podMetadata": {
                "labels": {k8s.LABEL_JOB: "other", "app.kubernetes.io/managed-by": "me", "a": "b"},
                "annotations": {k8s.ANNOTATION_NODE: "node-9", "c": "d"}}}
    pod = k8s.build_trainer_pod(k8s.JobRef.from_body(body), graph.compile(manifests.load_manifest(body)),
                                Instance("trainer", 0), "node-1", spec, "vc")
    assert pod["metadata"]["labels"][k8s.LABEL_JOB] == "job"
    assert pod["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "huorn"
    assert pod["metadata"]["annotations"][k8s.ANNOTATION_NODE] == "node-1"
    assert pod["metadata"]["labels"]["a"] == "b" and pod["metadata"]["annotations"]["c"] == "d"


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
    ({"podMetadata": {"labels": {"team": "-nlp"}}},
     ("spec.podMetadata.labels.team", "'-nlp' is not a label value: at most 63 letters, digits, '-', '_' and "
                                      "'.', starting and ending with a letter or digit, or empty"),
     f"spec.podMetadata.labels.team: '-nlp' does not match {base.LABEL_VALUE_PATTERN!r}"),
    ({"podMetadata": {"labels": {f"l{i}": "x" for i in range(33)}}},
     ("spec.podMetadata.labels", "33 labels: at most 32; remove some"),
     f"spec.podMetadata.labels: { {f'l{i}': 'x' for i in range(33)}!r} has too many properties"),
    ({"podMetadata": {"annotations": {"note": "x" * 7681}}},
     ("spec.podMetadata.annotations.note", "String should have at most 7680 characters (got "
                                           f"{repr('x' * 7681)[:40]}… (7681 characters))"),
     f"spec.podMetadata.annotations.note: {'x' * 7681!r} is too long"),
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


NOT_A_KEY = ("key: use a name of at most 63 letters, digits, '-', '_' and '.' (starting and ending with a "
             "letter or digit), with an optional DNS prefix and '/', as in example.com/team")
HUORNS = "whose keys Huorn sets on its pods; use a key of your own domain"
LONG_PREFIX = f"{'a' * 254}/x"
# Refused by the model alone: the CRD cannot check a map's keys (docs/api.md, "Known differences")
KEYS_REFUSED = [
    ({"labels": {"Bad Key": "x"}}, "labels", f"key 'Bad Key' is not a label {NOT_A_KEY}"),
    ({"labels": {"a/b/c": "x"}}, "labels", f"key 'a/b/c' is not a label {NOT_A_KEY}"),
    # a label's prefix is lowercase; an annotation's is judged lowercased, as Kubernetes does
    ({"labels": {"Example.com/x": "x"}}, "labels", f"key 'Example.com/x' is not a label {NOT_A_KEY}"),
    ({"annotations": {"x" * 64: "x"}}, "annotations", f"key '{'x' * 64}' is not an annotation {NOT_A_KEY}"),
    ({"annotations": {LONG_PREFIX: "x"}}, "annotations",
     f"key {repr(LONG_PREFIX)[:40]}… (256 characters): its prefix (before '/') has 254 characters; a DNS "
     "prefix has at most 253"),
    ({"labels": {"huorn.io/job": "mine"}}, "labels", f"key 'huorn.io/job' is in huorn.io, {HUORNS}"),
    ({"annotations": {"team.huorn.io/x": "y"}}, "annotations",
     f"key 'team.huorn.io/x' is in huorn.io, {HUORNS}"),
    ({"annotations": {"Huorn.IO/x": "y"}}, "annotations", f"key 'Huorn.IO/x' is in huorn.io, {HUORNS}"),
    ({"labels": {"app.kubernetes.io/managed-by": "argo"}}, "labels",
     "key 'app.kubernetes.io/managed-by' is a label Huorn sets on its pods and finds them by; use a key of "
     "your own"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("metadata", "field", "message"), KEYS_REFUSED)
def test_a_bad_or_reserved_key_is_refused_by_the_model_naming_the_map(kind: str, metadata: dict[str, Any],
                                                                       field: str, message: str) -> None:
    manifest = build_manifest(kind, {"podMetadata": metadata})
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(manifest)
    assert [(e.path, e.message) for e in caught.value.errors] == [(f"spec.podMetadata.{field}", message)]
    assert crd_errors(kind, manifest) == []  # the known difference: the operator Stalls it as InvalidSpec


def test_keys_huorn_does_not_own_pass() -> None:
    good = {"labels": {"a": "", "example.com/team": "nlp", "app.kubernetes.io/part-of": "x", "x" * 63: "y"},
            "annotations": {"app.kubernetes.io/managed-by": "argo", f"{'a' * 253}/x": "z",
                            "huorn.iox/y": "1", "Example.com/Note": "kept as written"}}
    job = manifests.load_manifest(build_manifest("TrainingJob", {"podMetadata": good}))
    assert job.spec.to_wire()["podMetadata"] == good


@pytest.mark.parametrize("empty", [{}, {"labels": {}}, {"labels": {}, "annotations": {}}])
def test_an_empty_pod_metadata_rolls_no_pod_and_restarts_no_gang(empty: dict[str, Any]) -> None:
    """A wrapper chart's empty default renders the pods no podMetadata does: it had changed the
    serving, front and RL hashes, so an upgrade that added it rolled every replica."""
    def wire(kind: str, patch: dict[str, Any]) -> dict[str, Any]:
        return manifests.load_manifest(build_manifest(kind, patch)).spec.to_wire()

    plain, with_empty = wire("InferenceJob", {}), wire("InferenceJob", {"podMetadata": empty})
    assert k8s.serve_template_hash(with_empty) == k8s.serve_template_hash(plain)
    assert k8s.front_template_hash(with_empty) == k8s.front_template_hash(plain)
    assert rlm.template_hash(wire("RLJob", {"podMetadata": empty})) in rlm.template_hashes(wire("RLJob", {}))
    trained = wire("TrainingJob", {})
    assert training_op.spec_changes(trained, wire("TrainingJob", {"podMetadata": empty})) == []
    labelled = wire("TrainingJob", {"podMetadata": {**empty, "labels": {"team": "nlp"}}})
    assert training_op.spec_changes(trained, labelled) == ["podMetadata"]
    for role, pod in render("InferenceJob", {"podMetadata": empty}).items():
        assert pod == render("InferenceJob", {})[role], role


def test_annotations_over_a_pods_room_are_refused_in_bytes() -> None:
    """Within the CRD's counts and lengths, values in another script can still exceed the 256 KiB
    Kubernetes allows a pod's annotations: the model counts bytes."""
    wide = {f"k{i}": "é" * 7680 for i in range(32)}
    with pytest.raises(manifests.ManifestError) as caught:
        manifests.load_manifest(build_manifest("InferenceJob", {"podMetadata": {"annotations": wide}}))
    (error,) = caught.value.errors
    assert error.path == "spec.podMetadata" and "bytes of keys and values, over the 256000" in error.message


def test_the_crd_reports_a_value_with_value_from_at_value_from() -> None:
    """The API server puts a rule's error at its fieldPath; api_support reports the node."""
    env = openapi_schema("RLJob")["properties"]["spec"]["properties"]["env"]["items"]
    assert {r["fieldPath"] for r in env["x-kubernetes-validations"]} == {".valueFrom"}


def _write(directory: Path, manifest: dict[str, Any]) -> Path:
    path = directory / f"{manifest['kind']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path
