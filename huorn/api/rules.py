"""Cross-field rules, written once as data and enforced in two places.

A rule is a CEL expression for the API server (emitted into the CRD as an
``x-kubernetes-validations`` entry) paired with a Python predicate for the pydantic models, the
local runner and ``huorn validate``. Keeping both halves in one record, next to the message
that names the field and the fix, is what lets a test prove that the two places agree: the
property test in tests/test_api_agreement.py feeds the same generated specs to both.

Rules attach to the model class whose fields they read (``@rules.attach(...)``), so a rule on
``ModelSpec`` is enforced wherever a model architecture appears (TrainingJob, RLJob,
InferenceJob) and is emitted at every matching node of every CRD.

NOTE: CEL here stays within what the Kubernetes API server accepts *and* what cel-python
evaluates: standard macros (has, all, exists, exists_one, size) and arithmetic only, no
Kubernetes-only library functions, so the test harness evaluates the very strings the CRD holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic_core import PydanticCustomError

RULE_ERROR_TYPE = "huorn_rule"


@dataclass(frozen=True)
class Rule:
    """One cross-field invariant.

    ``field`` is the wire path (camelCase, dotted) relative to the object the rule is attached
    to; errors are reported there, both by the API server (``fieldPath``) and by pydantic.
    ``detail`` renders the offending values, e.g. ``3 > 2``, for the Python message only: CEL
    messages are static strings.
    """

    name: str
    field: str
    cel: str
    holds: Callable[[Any], bool]
    message: str
    fix: str
    detail: Callable[[Any], str] | None = None

    def explain(self, obj: Any) -> str:
        """The Python-side message: what is wrong, the values, and what would be valid."""
        values = f" ({self.detail(obj)})" if self.detail is not None else ""
        return f"{self.message}{values}; {self.fix}"

    def to_crd(self) -> dict[str, str]:
        """The x-kubernetes-validations entry for the CRD."""
        entry = {"rule": self.cel, "message": f"{self.message}; {self.fix}"}
        if self.field:
            entry["fieldPath"] = "." + self.field
        return entry


_REGISTRY: dict[type, tuple[Rule, ...]] = {}


def attach(*rules: Rule) -> Callable[[type], type]:
    """Class decorator: declare the rules that instances of the class must satisfy."""
    names = [r.name for r in rules]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate rule names in {names}")

    def decorate(cls: type) -> type:
        _REGISTRY[cls] = rules
        return cls

    return decorate


def rules_for(cls: type) -> tuple[Rule, ...]:
    """Rules of a class and of its bases (a job spec inherits JobCommon's rules)."""
    found: list[Rule] = []
    for base in reversed(cls.__mro__):
        found.extend(_REGISTRY.get(base, ()))
    return tuple(found)


def registered() -> list[tuple[type, Rule]]:
    """Every rule with the class it sits on, complete once huorn.api.kinds is imported."""
    return [(cls, rule) for cls, rules in _REGISTRY.items() for rule in rules]


def check_rules(obj: Any) -> None:
    """Raise a pydantic error for the first rule ``obj`` breaks.

    The error's context carries the rule's field, so huorn.api.manifests can report the full
    path (``spec.elasticity.minReplicas``) even though pydantic locates model-level errors at
    the object (``spec.elasticity``).
    """
    for rule in rules_for(type(obj)):
        if not rule.holds(obj):
            text = rule.explain(obj)
            prefix = f"{rule.field}: " if rule.field else ""
            raise PydanticCustomError(
                RULE_ERROR_TYPE,
                "{text}",
                {"text": prefix + text, "field": rule.field, "rule": rule.name, "explanation": text},
            )


def filesystem_path(name: str, field: str, attribute: str) -> Rule:
    """`field` (wire name; `attribute` its Python name), a checkpoint that workers load, is a path
    on disk rather than an object-store URI: Huorn's runtimes read checkpoints from the job's
    checkpoint volume and download nothing."""
    return Rule(
        name=name,
        field=field,
        cel=f"!has(self.{field}) || !self.{field}.contains('://')",
        holds=lambda o: getattr(o, attribute) is None or "://" not in getattr(o, attribute),
        message="must be a filesystem path: workers read checkpoints from disk, not from object storage",
        detail=lambda o: str(getattr(o, attribute)),
        fix="copy the checkpoint onto the job's checkpoint volume and give its path there (under "
        "spec.checkpoint.path)",
    )
