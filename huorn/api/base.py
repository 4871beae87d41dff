"""Shared building blocks of every Huorn custom resource.

Field names follow Kubernetes conventions (camelCase on the wire, snake_case in Python) so that
the same model reads a manifest, writes a status patch and generates the CRD schema. Unknown
fields are refused: a typo such as ``minReplica`` must fail loudly, not be silently dropped.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP = "huorn.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

# Kubernetes resource quantities (the subset Huorn accepts): "4", "500m", "16Gi", "1.5".
QUANTITY_PATTERN = r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|Ki|Mi|Gi|Ti)?$"
# Durations in Go/metav1.Duration style: "30s", "5m", "1h30m", "250ms".
DURATION_PATTERN = r"^([0-9]+(ms|s|m|h))+$"
# DNS-1123 label, used for names that become parts of Kubernetes object names.
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, examples=["4", "500m", "16Gi"])]
Duration = Annotated[str, Field(pattern=DURATION_PATTERN, examples=["30s", "10m"])]
DnsLabel = Annotated[str, Field(pattern=DNS_LABEL_PATTERN, max_length=63)]

_QUANTITY_SUFFIX = {
    "": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40,
}
_DURATION_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_quantity(text: str) -> float:
    """Return a quantity in base units (cores for CPU, bytes for memory)."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", text)
    if not match or match.group(2) not in _QUANTITY_SUFFIX:
        raise ValueError(f"{text!r} is not a resource quantity such as '4', '500m' or '16Gi'")
    return float(match.group(1)) * _QUANTITY_SUFFIX[match.group(2)]


def parse_duration(text: str) -> float:
    """Return a duration in seconds."""
    parts = re.findall(r"([0-9]+)(ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"{text!r} is not a duration such as '30s', '5m' or '1h30m'")
    return sum(int(n) * _DURATION_UNIT[u] for n, u in parts)


class ApiModel(BaseModel):
    """Base of every spec and status fragment: camelCase aliases, unknown fields refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
    )

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
