"""Each job kind has only the spec fields something reads for it.

InferenceJob used to inherit priority, elasticity and remediation from every job's common
fields; nothing read them for it (it scales by `autoscaling` and waits in no line), so a
manifest that set them was called valid and then ignored. Both sides of validation now refuse
them as unknown fields, naming the field: the CRD (as the API server judges it, api_support)
and the pydantic models (`huorn validate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from api_support import build_manifest, crd_errors, openapi_schema
from typer.testing import CliRunner

from huorn.api import inference, manifests, rl, training
from huorn.api.base import ApiModel
from huorn.backends.kubernetes import rl_manifests as rlm
from huorn.cli import main
from huorn.operator import queue

BASIC = ["virtualCluster", "image", "resources", "checkpoint", "env", "imagePullSecrets",
         "serviceAccountName", "podMetadata"]
# The order the CRDs have always had: priority after image, and so on.
GANG = ["virtualCluster", "image", "priority", "resources", "elasticity", "checkpoint", "remediation", "env",
        "imagePullSecrets", "serviceAccountName", "podMetadata"]
# An RLJob's: a TrainingJob's without elasticity, in the same order.
RL_GANG = [f for f in GANG if f != "elasticity"]

SPECS: dict[str, type[ApiModel]] = {
    "TrainingJob": training.TrainingJobSpec,
    "RLJob": rl.RLJobSpec,
    "InferenceJob": inference.InferenceJobSpec,
}
SHARED = {"TrainingJob": GANG, "RLJob": RL_GANG, "InferenceJob": BASIC}

# Fields a kind does not have, with a value that would be valid where the field exists.
REFUSED = [
    ("InferenceJob", "priority", 100),
    ("InferenceJob", "elasticity", {"minReplicas": 1, "maxReplicas": 2}),
    ("InferenceJob", "remediation", {"maxRestarts": 5}),
    # Its Ray workers follow gpus and its roles; its entry in the line replaced what was read.
    ("RLJob", "elasticity", {"minReplicas": 1, "maxReplicas": 2}),
]


def _wire_fields(model: type[ApiModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _crd_fields(kind: str) -> list[str]:
    return list(openapi_schema(kind)["properties"]["spec"]["properties"])


@pytest.mark.parametrize("kind", list(SPECS))
def test_each_kind_starts_with_its_shared_fields_in_the_crds_order(kind: str) -> None:
    model = _wire_fields(SPECS[kind])
    shared = SHARED[kind]
    assert model[: len(shared)] == shared
    assert _crd_fields(kind) == model  # the committed CRD is the model's, field for field


def test_an_inference_job_has_no_priority_elasticity_or_remediation() -> None:
    spec = set(_crd_fields("InferenceJob"))
    assert spec.isdisjoint({"priority", "elasticity", "remediation"})
    assert {"autoscaling", "slo", "serving", "model"} <= spec


def test_only_a_training_job_has_elasticity() -> None:
    assert [kind for kind in SPECS if "elasticity" in _crd_fields(kind)] == ["TrainingJob"]


def test_a_queue_entry_needs_no_elasticity() -> None:
    """The line's entry builder read spec.elasticity of every kind; an RLJob has none now, and
    rljobs.queue_entry sets its own bounds over the builder's."""
    job = manifests.load_manifest(build_manifest("RLJob", {"priority": 70}))
    entry = queue.build_entry(job, {"namespace": "ns", "name": "rl"}, missing=2)
    assert (entry.priority, entry.min_replicas, entry.elastic, entry.missing) == (70, 1, False, 2)
    trained = manifests.load_manifest(build_manifest(
        "TrainingJob", {"elasticity": {"minReplicas": 2, "maxReplicas": 4, "policy": "goodput"}}))
    entry = queue.build_entry(trained, {"namespace": "ns", "name": "tj"})
    assert (entry.min_replicas, entry.elastic) == (2, True)


def test_a_running_rl_gang_keeps_its_pods_when_elasticity_is_pruned() -> None:
    """Every RLJob stored before held spec.elasticity (the CRD defaulted it) and its pods' hash
    covered it; the API server now reads it back without it. The gang is not restarted for that."""
    now = manifests.load_manifest(build_manifest("RLJob", {"gpus": 2})).spec.to_wire()
    assert "elasticity" not in now
    before = {**now, "elasticity": {"minReplicas": 1, "maxReplicas": 1, "policy": "goodput",
                                    "resize": "auto"}}
    assert rlm.template_hash(before) in rlm.template_hashes(now)
    assert rlm.template_hash(now) in rlm.template_hashes(now)
    # a spec changed otherwise still restarts it
    assert rlm.template_hash({**before, "steps": 7}) not in rlm.template_hashes(now)


@pytest.mark.parametrize("field", BASIC)
def test_a_field_every_kind_has_has_one_schema(field: str) -> None:
    """JobBasics and JobCommon declare the shared fields apart (to keep the CRDs' field order):
    their descriptions, defaults and bounds must not drift."""
    schemas = {kind: openapi_schema(kind)["properties"]["spec"]["properties"][field] for kind in SPECS}
    assert schemas["InferenceJob"] == schemas["TrainingJob"] == schemas["RLJob"]


@pytest.mark.parametrize(("kind", "field", "value"), REFUSED)
def test_the_crd_refuses_a_field_the_kind_does_not_have(kind: str, field: str, value: Any) -> None:
    errors = crd_errors(kind, build_manifest(kind, {field: value}))
    assert errors == [f"spec: Additional properties are not allowed ('{field}' was unexpected)"]


@pytest.mark.parametrize(("kind", "field", "value"), REFUSED)
def test_huorn_validate_refuses_a_field_the_kind_does_not_have(
    kind: str, field: str, value: Any, tmp_path: Path
) -> None:
    path = _write(tmp_path, build_manifest(kind, {field: value}, name="ignored-field"))
    result = CliRunner().invoke(main.app, ["validate", str(path)])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        f"{path}: {kind}/ignored-field: spec.{field}: unknown field; check its spelling and case "
        "against docs/api.md"
    )


@pytest.mark.parametrize(("kind", "field", "value"), REFUSED)
def test_the_kinds_that_read_the_field_still_accept_it(
    kind: str, field: str, value: Any, tmp_path: Path
) -> None:
    """The refusal is the kind's, not the value's: the kinds that have the field take the value."""
    readers = [k for k in SPECS if field in SHARED[k]]
    assert readers
    for reader in readers:
        manifest = build_manifest(reader, {field: value})
        assert crd_errors(reader, manifest) == []
        result = CliRunner().invoke(main.app, ["validate", str(_write(tmp_path, manifest))])
        assert result.exit_code == 0, result.stderr


def _write(directory: Path, manifest: dict[str, Any]) -> Path:
    path = directory / f"{manifest['kind']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path
