"""Load manifests into typed resources, with errors that name the field and the fix.

The local runner, the operator and ``huorn validate`` all come through here, so a manifest is
judged the same way everywhere, and the same way the API server judges it: nulls are pruned
first (the server drops a null on a non-nullable field before defaulting), then the schema
and the cross-field rules of huorn.api.rules apply.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
import yaml

from huorn.api import base, kinds, rules

_KIND_NAMES = ", ".join(kinds.RESOURCE_MODELS)


@dataclass(frozen=True)
class FieldError:
    """One problem: the wire path of the field (``spec.elasticity.minReplicas``) and what to do."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


def subject(kind: str, name: str) -> str:
    """``Kind/name`` as kubectl prints it, with placeholders when either is unknown."""
    return f"{kind or '<unknown kind>'}/{name or '<unnamed>'}"


def heading(source: str, kind: str, name: str) -> str:
    """``source: Kind/name``, what each message about a manifest starts with. A file that cannot
    be read or parsed has no kind or name: `<unknown kind>/<unnamed>` would only be noise there."""
    return ": ".join([*([source] if source else []), *([subject(kind, name)] if kind or name else [])])


class ManifestError(ValueError):
    """A manifest that Huorn refuses. ``errors`` lists every field at fault."""

    def __init__(self, errors: list[FieldError], kind: str = "", name: str = "", source: str = "") -> None:
        self.errors = errors
        self.kind = kind
        self.name = name
        self.source = source
        super().__init__(self._render())

    @property
    def subject(self) -> str:
        return subject(self.kind, self.name)

    def _render(self) -> str:
        head = heading(self.source, self.kind, self.name)
        return "\n".join(f"{head}: {error}" if head else str(error) for error in self.errors)


def prune_nulls(value: Any) -> Any:
    """Drop null fields, as the API server does for non-nullable fields before defaulting."""
    if isinstance(value, Mapping):
        return {k: prune_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [prune_nulls(v) for v in value]
    return value


def format_location(loc: tuple[str | int, ...]) -> str:
    """``('spec', 'env', 0, 'name')`` -> ``spec.env[0].name``."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


def _describe(error: Mapping[str, Any]) -> FieldError:
    loc = tuple(error["loc"])
    if loc[-1:] == ("[key]",):
        # a map's key (spec.podMetadata.labels): the error names the map, and its message the
        # key, as the API server reports a pod's bad label key at metadata.labels
        loc = loc[:-2]
    kind = error["type"]
    if kind == rules.RULE_ERROR_TYPE:
        ctx = error["ctx"]
        field = tuple(ctx["field"].split(".")) if ctx["field"] else ()
        return FieldError(format_location(loc + field), ctx["explanation"])
    path = format_location(loc)
    if kind == "extra_forbidden":
        return FieldError(path, "unknown field; check its spelling and case against docs/api.md")
    if kind == "missing":
        return FieldError(path, "required field is missing")
    message = str(error["msg"]).removeprefix("Value error, ")
    if "input" in error and kind not in ("value_error",) and not isinstance(error["input"], dict | list):
        given = error["input"]
        # YAML's types, which the file shows and pydantic's words do not: `inject: false` read as a
        # boolean where a string is wanted said "(got False)", found nowhere in the file
        if kind == "string_type" and isinstance(given, bool | int | float):
            what = "a YAML boolean" if isinstance(given, bool) else "a YAML number"
            message += f" (got {_as_yaml(given)}, {what}); quote it: \"{_as_yaml(given)}\""
        elif kind in ("int_type", "float_type", "bool_type") and isinstance(given, str) \
                and _unquoted_fits(given, kind):
            message += f" (got {_as_yaml(given)}, a YAML string); remove the quotes"
        else:
            message += f" (got {_as_yaml(given)})"
        shape = _object_shape(str((error.get("ctx") or {}).get("class_name", "")))
        if kind == "model_type" and shape:
            # `imagePullSecrets: [regcred]`, as `kubectl create secret` users write it, said only
            # that an object was wanted, not which one
            message += f"; give an object with {shape}"
            if "," not in shape:
                message += f", as {{{shape}: {error['input']!r}}}"
    return FieldError(path, message)


def _unquoted_fits(text: str, kind: str) -> bool:
    """Whether `text` without its quotes is what the field wants (an integer, a number, a
    boolean): only then is "remove the quotes" the fix ("maybe" for a boolean is not)."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    wanted = {"int_type": int, "float_type": int | float, "bool_type": bool}[kind]
    return isinstance(value, wanted) and (kind == "bool_type" or not isinstance(value, bool))


def _as_yaml(value: Any) -> str:
    """A scalar as the manifest spells it (false, 8080, 'text'), long text cut to its length."""
    if isinstance(value, bool) or value is None:
        return yaml.safe_dump(value).split("\n")[0]
    return base.shown(value)


def _object_shape(class_name: str) -> str:
    """The wire names of an API model's required fields (all its fields when none is required),
    found by its class name as pydantic reports it; "" for a class that is not Huorn's."""
    pending: list[type[base.ApiModel]] = [base.ApiModel]
    while pending:
        model = pending.pop()
        if model.__name__ == class_name and model is not base.ApiModel:
            fields = model.model_fields
            names = [f.alias or n for n, f in fields.items() if f.is_required()] or \
                [f.alias or n for n, f in fields.items()]
            return ", ".join(names)
        pending.extend(model.__subclasses__())
    return ""


def describe_validation_error(error: pydantic.ValidationError) -> list[FieldError]:
    """Turn pydantic's errors into FieldErrors with wire paths and actionable messages."""
    return [_describe(e) for e in error.errors()]


def load_manifest(source: Mapping[str, Any] | str | Path, origin: str = "") -> kinds.Resource:
    """Parse and validate one manifest: a dict, or a path to a file holding exactly one document.

    Raises ManifestError naming every field at fault. ``origin`` labels errors (a file name).
    """
    if isinstance(source, str | Path):
        documents = list(read_documents(Path(source)))
        if len(documents) != 1:
            raise ManifestError(
                [FieldError("", f"expected one YAML document, found {len(documents)}; "
                                "use load_manifests for multi-document files")],
                source=str(source),
            )
        return load_document(documents[0], origin=origin or str(source))
    return load_document(source, origin=origin)


def load_document(source: Any, origin: str = "") -> kinds.Resource:
    """Validate one parsed YAML document (any value: a stray scalar is an error, not a path)."""
    if not isinstance(source, Mapping):
        problem = FieldError("", "a manifest must be a mapping with apiVersion, kind, metadata and spec")
        raise ManifestError([problem], source=origin)
    body = prune_nulls(source)
    kind = str(body.get("kind", ""))
    metadata = body.get("metadata")
    name = str(metadata.get("name", "")) if isinstance(metadata, Mapping) else ""
    if body.get("apiVersion") != base.API_VERSION:
        raise ManifestError(
            [FieldError("apiVersion", f"must be {base.API_VERSION} (got {body.get('apiVersion')!r})")],
            kind=kind, name=name, source=origin,
        )
    model = kinds.RESOURCE_MODELS.get(kind)
    if model is None:
        raise ManifestError(
            [FieldError("kind", f"{kind!r} is not a Huorn kind; use one of {_KIND_NAMES}")],
            kind=kind, name=name, source=origin,
        )
    bad_key = _non_string_key(body)
    if bad_key is not None:
        loc, key = bad_key
        message = f"key {key} is a YAML {type(key).__name__}, and keys must be strings; quote it (\"{key}\")"
        problem = FieldError(format_location(loc), message)
        raise ManifestError([problem], kind=kind, name=name, source=origin)
    try:
        # NB: strict JSON mode, because the API server is strict: it refuses "3" for an integer,
        # which pydantic's lax Python mode would quietly accept. default=str keeps YAML
        # timestamps (metadata.creationTimestamp) passing through as text.
        return model.model_validate_json(json.dumps(body, default=str), strict=True)
    except pydantic.ValidationError as error:
        raise ManifestError(describe_validation_error(error), kind=kind, name=name, source=origin) from None


def _non_string_key(value: Any, loc: tuple[str | int, ...] = ()) -> tuple[tuple[str | int, ...], Any] | None:
    """The first mapping key that is not a string (YAML reads an unquoted 2024-01-01 as a date, 1
    as an int): JSON, and so the API server, has string keys only. None when every key is one."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                return loc, key
            found = _non_string_key(item, (*loc, key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found = _non_string_key(item, (*loc, index))
            if found is not None:
                return found
    return None


STDIN = Path("-")  # as kubectl's `-f -`: `helm template ... | huorn validate -`


def read_documents(path: Path) -> Iterator[Any]:
    """The YAML documents of a file (`-`: standard input), skipping empty ones (a trailing ``---``)."""
    try:
        text = sys.stdin.buffer.read().decode("utf-8") if path == STDIN else path.read_text(encoding="utf-8")
    except OSError as error:
        problem = FieldError("", f"cannot read the file: {error.strerror}")
        raise ManifestError([problem], source=str(path)) from None
    except UnicodeDecodeError as error:
        problem = FieldError("", f"not UTF-8 text (byte {error.start}); save the manifest as UTF-8 YAML")
        raise ManifestError([problem], source=str(path)) from None
    try:
        documents = _parse_yaml(text)
    except yaml.YAMLError as error:
        raise ManifestError([FieldError("", f"not valid YAML: {error}")], source=str(path)) from None
    except _UnsafeYaml as error:
        raise ManifestError([error.problem], source=str(path)) from None
    yield from (doc for doc in documents if doc is not None)


# How many values a document may hold once its aliases are expanded. A manifest holds thousands
# (the API server stores at most 1.5 MB of JSON, fewer than a million values); a 467-byte file of
# nested anchors ("billion laughs") held 10^8, and took minutes and gigabytes to refuse.
MAX_EXPANDED_VALUES = 1_000_000


# How deep a document may nest. A manifest nests a dozen levels; past a few hundred PyYAML's parser
# ran out of stack (a RecursionError traceback), and from 200 pydantic refused the JSON with the
# whole document quoted in its message.
MAX_DEPTH = 100


def _too_deep(line: int | None = None) -> FieldError:
    where = f"line {line}: " if line is not None else ""
    return FieldError("", f"{where}nested more than {MAX_DEPTH} levels deep, far deeper than any manifest; "
                          "flatten the document")


class _UnsafeYaml(Exception):
    """A document that parses but that no manifest reader should build: `problem` says why."""

    def __init__(self, problem: FieldError) -> None:
        super().__init__(str(problem))
        self.problem = problem


def _parse_yaml(text: str) -> list[Any]:
    """yaml.safe_load_all, with each document's node graph checked before it is built."""
    loader = yaml.SafeLoader(text)
    try:
        documents = []
        while loader.check_node():
            node = loader.get_node()
            _check_aliases(node)
            _check_duplicate_keys(node)
            documents.append(loader.construct_document(node))
        return documents
    except RecursionError:  # PyYAML's parser recurses once per level, and runs out past hundreds
        raise _UnsafeYaml(_too_deep()) from None
    finally:
        loader.dispose()


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _check_aliases(root: yaml.Node) -> None:
    """Refuse an alias inside the value it names (`a: &a [*a]`, a value without end, which every
    reader after PyYAML recursed into until it crashed), a document whose aliases expand it past
    MAX_EXPANDED_VALUES, and one nested past MAX_DEPTH. An alias is the node it names, so the first
    two show in the node graph: a cycle, and a size counted once per node (sizes memoised) but
    summed once per use."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, _children(root), 0)]
    open_nodes.add(id(root))
    while stack:
        node, children, index = stack[-1]
        if index < len(children):
            stack[-1] = (node, children, index + 1)
            child = children[index]
            if id(child) in open_nodes:
                line = child.start_mark.line + 1
                raise _UnsafeYaml(FieldError("", (
                    f"line {line}: the value anchored there holds an alias to itself, so it never ends; "
                    "write the value out instead of aliasing it inside itself")))
            if id(child) not in sizes:
                if len(stack) >= MAX_DEPTH:
                    raise _UnsafeYaml(_too_deep(child.start_mark.line + 1))
                open_nodes.add(id(child))
                stack.append((child, _children(child), 0))
            continue
        stack.pop()
        open_nodes.discard(id(node))
        sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children)
        if sizes[id(node)] > MAX_EXPANDED_VALUES:
            what = "the document" if node is root else f"line {node.start_mark.line + 1}: the value there"
            raise _UnsafeYaml(FieldError("", (
                f"{what} holds more than {MAX_EXPANDED_VALUES:,} values once its aliases (*name) are "
                "expanded, far more than any manifest; write the values out instead of aliasing them")))


_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_duplicate_keys(root: yaml.Node) -> None:
    """Refuse a mapping that gives a key twice. YAML readers keep the last one (PyYAML) or refuse
    it (kubectl apply's strict field validation), so a file that `huorn validate` passed was then
    refused by the cluster, or ran with a value its author had meant to replace. A key given
    again after a merge (`<<: *base`) overrides the merged one, as YAML means it to."""
    visited: set[int] = set()
    stack: list[tuple[yaml.Node, tuple[str | int, ...]]] = [(root, ())]
    while stack:
        node, loc = stack.pop()
        if id(node) in visited:  # an alias: its value was checked where it was anchored
            continue
        visited.add(id(node))
        children: list[tuple[yaml.Node, tuple[str | int, ...]]] = []
        if isinstance(node, yaml.MappingNode):
            first: dict[tuple[str, str], yaml.Node] = {}
            for key, value in node.value:
                if key.tag == _MERGE_TAG:
                    children.append((value, loc))
                    continue
                if not isinstance(key, yaml.ScalarNode):
                    continue  # a complex key, which the API refuses anyway (keys are strings)
                earlier = first.setdefault((key.tag, key.value), key)
                if earlier is not key:
                    where = format_location((*loc, key.value))
                    raise _UnsafeYaml(FieldError(where, (
                        f"duplicate field (line {key.start_mark.line + 1}; first given on line "
                        f"{earlier.start_mark.line + 1}); keep one of the two, as kubectl apply "
                        "refuses a field given twice")))
                children.append((value, (*loc, key.value)))
        elif isinstance(node, yaml.SequenceNode):
            children = [(child, (*loc, index)) for index, child in enumerate(node.value)]
        stack.extend(reversed(children))  # so the first duplicate in the file is the one named


def load_manifests(path: Path) -> list[kinds.Resource | ManifestError]:
    """Every document of a multi-document file, each loaded or the error it raised, in order."""
    results: list[kinds.Resource | ManifestError] = []
    for document in read_documents(path):
        try:
            results.append(load_document(document, origin=str(path)))
        except ManifestError as error:
            results.append(error)
    return results
