"""The API server's side of validation, reproduced from the generated CRDs for the api tests.

The tests must judge a manifest the way a kube-apiserver with crds/ installed would, without
one (no apiserver binary can be had on these machines, see notes/kubernetes-testing.md). The
pipeline is the server's, in its order, each step driven only by the CRD:

1. prune nulls of non-nullable fields;
2. apply the schema's defaults, top-down (a defaulted object gets its own fields' defaults);
3. validate the OpenAPI schema (jsonschema, Draft 4: OpenAPI 3.0's boolean exclusiveMinimum),
   with unknown fields refused as `kubectl apply`'s strict field validation does;
4. evaluate every x-kubernetes-validations rule with cel-python, `self` bound to the node,
   numbers typed by the schema (an integer 1 in a `number` field is a CEL double, as in
   Kubernetes).

Nothing here comes from the pydantic models; that is the point of comparing the two.
"""

from __future__ import annotations

import copy
import re
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[1]
CRD_DIR = ROOT / "crds"

_ANY_OF_INT_OR_STRING = "x-kubernetes-int-or-string"
_PRESERVE = "x-kubernetes-preserve-unknown-fields"


@cache
def load_crd(kind: str) -> dict[str, Any]:
    """The committed CRD of a kind (by its `kind` name)."""
    for path in sorted(CRD_DIR.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["kind"] == kind:
            return crd
    raise KeyError(f"no CRD for kind {kind} under {CRD_DIR}")


def openapi_schema(kind: str) -> dict[str, Any]:
    return load_crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def iter_schema_nodes(schema: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every schema node with its path (`.spec.elasticity`, `.spec.env[*]`)."""
    nodes = [(path, schema)]
    for name, child in schema.get("properties", {}).items():
        nodes.extend(iter_schema_nodes(child, f"{path}.{name}"))
    if isinstance(schema.get("items"), dict):
        nodes.extend(iter_schema_nodes(schema["items"], f"{path}[*]"))
    if isinstance(schema.get("additionalProperties"), dict):
        nodes.extend(iter_schema_nodes(schema["additionalProperties"], f"{path}[*]"))
    return nodes


def prune_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [prune_nulls(v) for v in value]
    return value


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural defaulting: fill absent properties from `default`, then descend."""
    if isinstance(value, dict):
        out = dict(value)
        for name, child in schema.get("properties", {}).items():
            if name not in out and "default" in child:
                out[name] = copy.deepcopy(child["default"])
            if name in out:
                out[name] = apply_defaults(child, out[name])
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], v) for v in value]
    return value


def _strict(schema: Any) -> Any:
    """Refuse unknown fields, as strict field validation does (pruning would drop them)."""
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) if k in ("items", "additionalProperties") else v for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: _strict(v) for k, v in schema["properties"].items()}
        if not schema.get(_PRESERVE):
            out["additionalProperties"] = False
    return out


@cache
def _compile(rule: str) -> celpy.Runner:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """JSON value -> the JSON the CEL binding sees: integers in `number` fields become doubles."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        extra = extra if isinstance(extra, dict) else {}
        return {k: _typed(props.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(schema.get("items", {}), v) for v in value]
    return value


def evaluate_rule(rule: str, schema: dict[str, Any], value: Any) -> bool | str:
    """True or False, or the error text when the expression fails (the server refuses then)."""
    try:
        result = _compile(rule).evaluate({"self": celpy.json_to_cel(_typed(schema, value))})
    except celpy.CELEvalError as error:
        return f"error: {error}"
    if isinstance(result, celpy.CELEvalError):
        return f"error: {result}"
    return bool(result)


def run_cel(schema: dict[str, Any], value: Any, path: str = "") -> list[tuple[str, str, bool | str]]:
    """(node path, rule, outcome) for every rule at every node present in `value`."""
    outcomes = [(path, entry["rule"], evaluate_rule(entry["rule"], schema, value))
                for entry in schema.get("x-kubernetes-validations", [])]
    if isinstance(value, dict):
        for name, child in schema.get("properties", {}).items():
            if name in value:
                outcomes.extend(run_cel(child, value[name], f"{path}.{name}"))
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            outcomes.extend(run_cel(schema["items"], item, f"{path}[{i}]"))
    return outcomes


def crd_errors(kind: str, manifest: dict[str, Any]) -> list[str]:
    """Why the API server with our CRD would refuse the manifest; empty when it would accept it."""
    schema = openapi_schema(kind)
    obj = apply_defaults(schema, prune_nulls(manifest))
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}"
        for e in jsonschema.Draft4Validator(_strict(schema)).iter_errors(obj)
    ]
    if errors:
        return errors  # as on the server, CEL runs only on schema-valid objects
    outcomes = run_cel(schema, obj)
    return [f"{path}: {rule} -> {outcome}" for path, rule, outcome in outcomes if outcome is not True]


def failing_rule_paths(kind: str, manifest: dict[str, Any]) -> set[str]:
    """Wire paths (`spec.elasticity.minReplicas`) the CEL rules report, for a schema-valid manifest."""
    schema = openapi_schema(kind)
    obj = apply_defaults(schema, prune_nulls(manifest))
    fields = {}
    for path, node in iter_schema_nodes(schema):
        for entry in node.get("x-kubernetes-validations", []):
            fields[(path, entry["rule"])] = entry.get("fieldPath", "")
    paths = set()
    for path, rule, outcome in run_cel(schema, obj):
        if outcome is not True:
            node_path = re.sub(r"\[\d+\]", "[*]", path)
            paths.add((path + fields[(node_path, rule)]).lstrip("."))
    return paths


def admit(kind: str, manifest: dict[str, Any]) -> dict[str, Any]:
    """The object as the server would store it (pruned, defaulted); asserts it is accepted."""
    errors = crd_errors(kind, manifest)
    assert not errors, errors
    return apply_defaults(openapi_schema(kind), prune_nulls(manifest))


def normalise(schema: dict[str, Any], value: Any) -> Any:
    """Compare server and pydantic objects: int-or-string quantities as text, numbers as floats."""
    if schema.get(_ANY_OF_INT_OR_STRING) and isinstance(value, int):
        return str(value)
    if schema.get("type") == "number" and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return {k: normalise(props.get(k, {}), v) for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(schema.get("items", {}), v) for v in value]
    return value


def structural_violations(schema: dict[str, Any], path: str = "", root: bool = True) -> list[str]:
    """The apiextensions rules for a structural schema, checked node by node.

    A structural schema (required by apiextensions.k8s.io/v1) gives every node a type, except
    int-or-string and preserve-unknown-fields nodes; uses anyOf/allOf/oneOf/not only in the
    int-or-string form and never with type, default, description or nullable inside; never
    combines properties with additionalProperties; has no $ref; and constrains metadata at the
    root to name and generateName only.
    """
    problems = []
    where = path or "<root>"
    if "$ref" in schema or "definitions" in schema or "$defs" in schema:
        problems.append(f"{where}: references are not allowed")
    if "type" not in schema and not schema.get(_ANY_OF_INT_OR_STRING) and not schema.get(_PRESERVE):
        problems.append(f"{where}: no type")
    for key in ("anyOf", "allOf", "oneOf", "not"):
        if key not in schema:
            continue
        if key == "anyOf" and schema.get(_ANY_OF_INT_OR_STRING) and schema[key] == [
            {"type": "integer"}, {"type": "string"}
        ] and "type" not in schema:
            continue
        problems.append(f"{where}: {key} is only allowed in the int-or-string form")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{where}: properties and additionalProperties together")
    if schema.get("nullable") and "default" in schema and schema["default"] is None:
        problems.append(f"{where}: null default")
    if schema.get("type") == "array" and not isinstance(schema.get("items"), dict):
        problems.append(f"{where}: an array needs one items schema")
    if schema.get("type") == "object" and "items" in schema:
        problems.append(f"{where}: an object with items")
    for name, child in schema.get("properties", {}).items():
        if root and name == "metadata":
            extra = set(child.get("properties", {})) - {"name", "generateName"}
            if extra or set(child) - {"type", "properties"}:
                problems.append(".metadata: only name and generateName may be constrained")
            continue
        problems.extend(structural_violations(child, f"{path}.{name}", root=False))
    if isinstance(schema.get("items"), dict):
        problems.extend(structural_violations(schema["items"], f"{path}[*]", root=False))
    if isinstance(schema.get("additionalProperties"), dict):
        problems.extend(structural_violations(schema["additionalProperties"], f"{path}[*]", root=False))
    return problems


# Builders: the smallest valid spec of each kind, and a deep-merge patch on top of it.
BASE_SPECS: dict[str, dict[str, Any]] = {
    "TrainingJob": {
        "virtualCluster": "local",
        "optimization": {"globalBatch": 16, "microBatch": 4, "steps": 10},
    },
    "RLJob": {"virtualCluster": "local"},
    "InferenceJob": {"virtualCluster": "local", "model": {"checkpoint": "/checkpoints/quickstart"}},
    "VirtualCluster": {"members": {"nodes": ["node-0"]}},
}

DELETE = object()  # a patch value that removes the key


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is DELETE:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_manifest(kind: str, spec_patch: dict[str, Any] | None = None, name: str = "test") -> dict[str, Any]:
    """A manifest of `kind` whose spec is the base spec with `spec_patch` merged in."""
    return {
        "apiVersion": "huorn.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": merge(BASE_SPECS[kind], spec_patch or {}),
    }
