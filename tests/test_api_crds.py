"""The generated CRDs: committed == generated, accepted by the apiextensions.k8s.io/v1 schema,
structural, and wired (scale, status, printer columns, names) the way kubectl and an HPA need."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from api_support import CRD_DIR, iter_schema_nodes, load_crd, openapi_schema, structural_violations
from typer.testing import CliRunner

from huorn.api import crdgen, kinds
from huorn.cli import main

KIND_NAMES = list(kinds.KINDS)


def test_committed_crds_equal_the_generated_ones() -> None:
    assert crdgen.list_stale_crds(CRD_DIR) == [], "run `huorn crds` and commit crds/"
    assert sorted(p.name for p in CRD_DIR.glob("*.yaml")) == sorted(crdgen.render_crds())


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_crd_is_a_valid_custom_resource_definition(kind: str, version: str) -> None:
    """fieldPath on CEL rules needs 1.28+; 1.30 is the oldest Kubernetes with it GA.
    kubernetes-validate raises ValidationError on any schema violation (see the next test)."""
    crd = load_crd(kind)
    kubernetes_validate.validate(crd, version, strict=True)
    assert crd["spec"]["names"]["kind"] == kind


def test_kubernetes_validate_catches_a_broken_crd() -> None:
    """The check above has teeth: an unknown key deep inside the schema is refused."""
    crd = yaml.safe_load(yaml.safe_dump(load_crd("TrainingJob")))
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["image"]["x"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(crd, "1.37.0", strict=True)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_crd_schema_is_structural(kind: str) -> None:
    assert structural_violations(openapi_schema(kind)) == []


@pytest.mark.parametrize(
    ("broken", "problem"),
    [
        ({"type": "object", "properties": {"a": {"description": "untyped"}}}, "no type"),
        ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}},
         "anyOf"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}, "references"),
        ({"type": "object", "properties": {"a": {"type": "string"}},
          "additionalProperties": {"type": "string"}}, "additionalProperties"),
        ({"type": "object", "properties": {"a": {"type": "array"}}}, "items"),
    ],
)
def test_structural_check_refuses_non_structural_schemas(broken: dict, problem: str) -> None:
    violations = structural_violations(broken)
    assert any(problem in violation for violation in violations), violations


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_crd_has_no_pydantic_leftovers(kind: str) -> None:
    for path, node in iter_schema_nodes(openapi_schema(kind)):
        assert not {"title", "examples", "const", "$defs"} & set(node), path
        assert node.get("additionalProperties") is not False, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            assert node.get(bound, True) is True, f"{path}: OpenAPI 3.0 wants a boolean {bound}"


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_cel_rules_stay_within_the_cost_budget(kind: str) -> None:
    """The server estimates a rule's cost from list and string bounds: every list is bounded, and
    every rule's fieldPath names a property of its node."""
    for path, node in iter_schema_nodes(openapi_schema(kind)):
        if node.get("type") == "array":
            assert "maxItems" in node, f"{path}: unbounded list"
        for rule in node.get("x-kubernetes-validations", []):
            if "fieldPath" in rule:
                target = node
                for part in rule["fieldPath"].lstrip(".").split("."):
                    target = target["properties"][part]
            assert len(rule["rule"]) < 10_000 and rule["message"]


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_crd_names_scope_and_subresources(kind: str) -> None:
    info = kinds.KINDS[kind]
    crd = load_crd(kind)
    names = crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{info.plural}.huorn.io"
    assert names["categories"] == ["huorn"] and names["shortNames"] == list(info.short_names)
    assert crd["spec"]["scope"] == ("Cluster" if kind == "VirtualCluster" else "Namespaced")
    version = crd["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        field = column["jsonPath"].split("[")[0].lstrip(".").split(".")
        node = schema
        for part in field:
            if part in ("metadata",):
                break
            # a key of a map (status.roleReplicas.actorTrain) is any key its values allow
            node = node["properties"][part] if "properties" in node else node["additionalProperties"]
        if field[0] != "metadata" and "[" not in column["jsonPath"]:  # a plain path: its type shown
            assert node["type"] == column["type"], column


@pytest.mark.parametrize("kind", [k for k in KIND_NAMES if kinds.KINDS[k].scale_spec_path])
def test_scale_subresource_points_at_integer_replica_fields(kind: str) -> None:
    """`kubectl scale` and an HPA write specReplicasPath and read the other two."""
    scale = load_crd(kind)["spec"]["versions"][0]["subresources"]["scale"]
    schema = openapi_schema(kind)
    for key in ("specReplicasPath", "statusReplicasPath"):
        node = schema
        for part in scale[key].lstrip(".").split("."):
            node = node["properties"][part]
        assert node["type"] == "integer"
    assert scale["labelSelectorPath"] == ".status.selector"
    assert schema["properties"]["status"]["properties"]["selector"]["type"] == "string"


def test_status_graph_is_free_form_and_spec_is_not() -> None:
    status = openapi_schema("TrainingJob")["properties"]["status"]
    assert status["properties"]["graph"]["x-kubernetes-preserve-unknown-fields"] is True
    assert "x-kubernetes-preserve-unknown-fields" not in openapi_schema("TrainingJob")["properties"]["spec"]


def test_defaults_from_factories_reach_the_crd() -> None:
    """A nested object the user leaves out is defaulted by the server as by pydantic."""
    spec = openapi_schema("TrainingJob")["properties"]["spec"]["properties"]
    assert spec["elasticity"]["default"] == {"minReplicas": 1, "maxReplicas": 1, "policy": "goodput",
                                             "resize": "auto"}
    assert spec["optimization"]["default"]["steps"] == 100
    assert openapi_schema("InferenceJob")["properties"]["spec"]["properties"]["slo"]["default"] == {
        "p99TimeToFirstTokenMs": 1000.0
    }


def test_huorn_crds_writes_and_checks(tmp_path: Path) -> None:
    runner = CliRunner()
    stale = runner.invoke(main.app, ["crds", "--check", "--output-dir", str(tmp_path)])
    assert stale.exit_code == 1 and "out of date" in stale.output
    wrote = runner.invoke(main.app, ["crds", "--output-dir", str(tmp_path)])
    assert wrote.exit_code == 0, wrote.output
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == crdgen.render_crds()
    fresh = runner.invoke(main.app, ["crds", "--check", "--output-dir", str(tmp_path)])
    assert fresh.exit_code == 0 and "up to date" in fresh.output
    (tmp_path / "rljobs.huorn.io.yaml").write_text("edited by hand\n")
    assert runner.invoke(main.app, ["crds", "--check", "-d", str(tmp_path)]).exit_code == 1


def test_unsupported_union_is_refused_with_a_clear_error() -> None:
    from pydantic import BaseModel

    class Bad(BaseModel):
        value: int | str

    with pytest.raises(ValueError, match="union"):
        crdgen.build_schema(Bad)
