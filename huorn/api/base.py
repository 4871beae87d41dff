"""Shared building blocks of every Huorn custom resource.

Field names follow Kubernetes conventions (camelCase on the wire, snake_case in Python) so that
the same model reads a manifest, writes a status patch and generates the CRD schema. Unknown
fields are refused: a typo such as ``minReplica`` must fail loudly, not be silently dropped.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from huorn.api import rules

GROUP = "huorn.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes resource quantities (the subset Huorn accepts): "4", "500m", "16Gi", "1.5".
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
# Durations in Go/metav1.Duration style: "30s", "5m", "1h30m", "250ms".
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
# DNS-1123 label, used for names that become parts of Kubernetes object names.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# A label key (also a taint's and an annotation's): an optional DNS-subdomain prefix and '/', then
# a name of at most 63 characters; a label value (also a taint's). Empty is allowed for both here
# (a toleration's Exists has no key); the places that need a key say so.
LABEL_KEY_PATTERN = (r"^(([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")
LABEL_VALUE_PATTERN = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
LABEL_KEY_LIMIT = 317  # a 253-character prefix, '/', a 63-character name

_QUANTITY_SUFFIX = {
    "": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40,
}
_DURATION_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def shown(value: Any) -> str:
    """A bad value as an error quotes it: a long one (a label value of a megabyte) by its start and
    length, so the line still reads as one field's error."""
    text = repr(value)
    if isinstance(value, str) and len(text) > 80:
        return f"{text[:40]}… ({len(value)} characters)"
    return text


def parse_quantity(text: str) -> float:
    """Return a quantity in base units (cores for CPU, bytes for memory)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", text)
    if not match or match.group(2) not in _QUANTITY_SUFFIX:
        raise ValueError(f"{shown(text)} is not a resource quantity such as '4', '500m' or '16Gi'")
    return float(match.group(1)) * _QUANTITY_SUFFIX[match.group(2)]


def parse_duration(text: str) -> float:
    """Return a duration in seconds."""
    parts = re.findall(r"([0-9]+)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{shown(text)} is not a duration such as '30s', '5m' or '1h30m'")
    return sum(int(n) * _DURATION_UNIT[u] for n, u in parts)


def _coerce_quantity(value: object) -> object:
    """Accept ``cpu: 4`` as well as ``cpu: "4"``, as Kubernetes does (int-or-string).

    NB: bool is an int in Python, and YAML's ``true`` must stay an error in both places.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _check_quantity(text: str) -> str:
    parse_quantity(text)
    return text


def _check_duration(text: str) -> str:
    parse_duration(text)
    return text


def kubernetes_string(pattern: str, limit: int, what: str, allowed: str | None = None) -> Any:
    """A string type of Kubernetes' names and keys (RFC 1123 names, label keys and values): the
    pattern and length in the CRD, and in Python an error that says what the string is and what
    it may hold (`what` alone says it when `allowed` is None)."""

    def check(text: str) -> str:
        if len(text) > limit or not re.fullmatch(pattern, text):
            hint = "" if allowed is None else (f": use at most {limit} {allowed}, starting and ending "
                                               "with a letter or digit")
            raise ValueError(f"{shown(text)} is not {what}{hint}")
        return text

    return Annotated[str, AfterValidator(check),
                     WithJsonSchema({"type": "string", "pattern": pattern, "maxLength": limit})]


# The JSON schemas below are what the CRD gets; the validators give the clearer Python errors.
Quantity = Annotated[
    str,
    BeforeValidator(_coerce_quantity),
    AfterValidator(_check_quantity),
    WithJsonSchema({
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": QUANTITY_PATTERN,
        "minimum": 0,
    }),
]
Duration = Annotated[
    str, AfterValidator(_check_duration), WithJsonSchema({"type": "string", "pattern": DURATION_PATTERN})
]
DnsLabel = kubernetes_string(DNS_LABEL_PATTERN, 63, "a DNS label", "lowercase letters, digits and '-'")
# What Kubernetes names Secrets, ConfigMaps and ServiceAccounts by (RFC 1123 subdomain).
DnsSubdomain = kubernetes_string(
    DNS_SUBDOMAIN_PATTERN, 253, "a DNS subdomain (the name of a Secret, ConfigMap or ServiceAccount)",
    "lowercase letters, digits, '-' and '.'")


def _dump_default(annotation: Any, value: Any) -> Any:
    return TypeAdapter(annotation).dump_python(value, mode="json", by_alias=True, exclude_none=True)


def _extend_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """Add what pydantic leaves out of a model's JSON schema and the CRD needs.

    Defaults made by a factory (nested objects, lists) are written out, so the API server fills
    in the same values pydantic would and CEL rules see the same object. The class's
    cross-field rules become x-kubernetes-validations.
    """
    properties = schema.get("properties", {})
    for name, info in cls.model_fields.items():
        alias = info.alias or name
        if info.default_factory is not None and alias in properties:
            properties[alias]["default"] = _dump_default(info.annotation, info.default_factory())  # type: ignore[call-arg]
    found = rules.rules_for(cls)
    if found:
        schema["x-kubernetes-validations"] = [rule.to_crd() for rule in found]


class ApiModel(BaseModel):
    """Base of every spec and status fragment: camelCase aliases, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        json_schema_extra=_extend_schema,
    )

    @model_validator(mode="after")
    def _check_rules(self) -> ApiModel:
        rules.check_rules(self)
        return self

    def to_wire(self) -> dict:
        """The object as the API server stores it: camelCase, defaults included, no nulls."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class ObjectMeta(BaseModel):
    """The part of metadata Huorn reads; everything else passes through untouched."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: DnsLabel | None = None
    namespace: DnsLabel | None = None
    generation: int | None = None
    uid: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)
