"""`huorn validate FILE_OR_DIR...`: offline validation of Huorn manifests.

It judges a manifest exactly as the API server with Huorn's CRDs would (same schema, same
cross-field rules, see huorn.api.manifests), so a user learns of a bad spec before applying it.
Documents of other API groups (a Service next to a TrainingJob) are skipped, not failed, so a
whole deployment directory can be checked; a huorn.io document of the wrong version still fails.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import rich.box
import rich.console
import rich.table
import typer
import yaml

from huorn.api import base, kinds, manifests
from huorn.operator import validation

EXIT_INVALID = 2


class OutputFormat(StrEnum):
    TEXT = "text"
    TABLE = "table"
    JSON = "json"
    YAML = "yaml"


@dataclass
class Verdict:
    """The outcome for one document, in the shape -o json prints."""

    file: str
    kind: str
    name: str
    status: str  # ok | invalid | skipped
    errors: list[dict[str, str]] = field(default_factory=list)


def list_manifest_files(paths: list[Path]) -> tuple[list[Path], list[Verdict]]:
    """Files to check (directories recurse into *.yaml and *.yml), and verdicts for bad paths."""
    files: list[Path] = []
    problems: list[Verdict] = []
    for path in paths:
        if path == manifests.STDIN:
            files.append(path)
        elif path.is_dir():
            found = sorted({*path.rglob("*.yaml"), *path.rglob("*.yml")})
            if not found:
                problems.append(_path_problem(path, "no *.yaml files in this directory"))
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            problems.append(_path_problem(path, "no such file or directory"))
    return files, problems


def _path_problem(path: Path, message: str) -> Verdict:
    return Verdict(str(path), "", "", "invalid", [{"path": "", "message": message}])


def _is_foreign(document: Any) -> bool:
    """Another API group's document, which is not ours to judge. A Huorn kind whose group is
    nearly ours (`huron.io`, `Huorn.io`, `huorn`, none at all) is a typo, not a foreign object:
    skipping it passed a manifest `kubectl apply` then refuses ("no matches for kind"). A kind
    of ours in a group unlike ours (SageMaker's TrainingJob) stays foreign."""
    api_version = document.get("apiVersion") if isinstance(document, dict) else None
    if not isinstance(api_version, str):
        return False
    group = api_version.split("/")[0] if "/" in api_version else ""
    if group == base.GROUP:
        return False
    # a typo of ours: load_document names apiVersion and what it must be
    nearly_ours = not group or difflib.SequenceMatcher(None, group.lower(), base.GROUP).ratio() >= 0.75
    return not (document.get("kind") in kinds.KINDS and nearly_ours)


def check_file(path: Path) -> list[Verdict]:
    """One verdict per YAML document of the file (one for the file if it cannot be read)."""
    try:
        documents = list(manifests.read_documents(path))
    except manifests.ManifestError as error:
        return [Verdict(str(path), "", "", "invalid", [asdict(e) for e in error.errors])]
    verdicts = []
    for document in documents:
        kind = str(document.get("kind", "")) if isinstance(document, dict) else ""
        metadata = document.get("metadata") if isinstance(document, dict) else None
        name = str(metadata.get("name", "")) if isinstance(metadata, dict) else ""
        if _is_foreign(document):
            verdicts.append(Verdict(str(path), kind, name, "skipped"))
            continue
        # NB: a list or a scalar is no object at all: "must be a mapping" is its whole error, and a
        # missing metadata.name in front of it sent the user looking for a field it cannot have
        named = name or not isinstance(document, dict) or not isinstance(metadata, dict | None)
        errors = [] if named else _unnamed(metadata or {})
        try:
            resource = manifests.load_document(document, origin=str(path))
        except manifests.ManifestError as error:
            errors += [asdict(e) for e in error.errors]
        else:
            errors += _operator_refusals(resource)
        verdicts.append(Verdict(str(path), kind, name, "invalid" if errors else "ok", errors))
    return verdicts


def _operator_refusals(resource: Any) -> list[dict[str, str]]:
    """What the operator would refuse in this spec alone (it Stalls the job as InvalidSpec), as
    the schema's errors are given: the field, then the message naming the fix."""
    try:
        validation.check_spec_alone(resource)
    except validation.InvalidSpec as refusal:
        field, _, message = str(refusal).partition(": ")
        return [{"path": field, "message": message}] if message else [{"path": "", "message": field}]
    return []


def _unnamed(metadata: dict[str, Any]) -> list[dict[str, str]]:
    """The API server refuses an object with neither name nor generateName before any schema
    applies, so the models (which the operator also uses on stored, named objects) never see it."""
    if metadata.get("generateName"):
        return []
    fix = "name the resource (metadata.generateName instead works with kubectl create only)"
    return [{"path": "metadata.name", "message": f"required field is missing; {fix}"}]


def _print_text(verdicts: list[Verdict]) -> None:
    for v in verdicts:
        subject = manifests.subject(v.kind, v.name)
        if v.status == "ok":
            typer.echo(f"{v.file}: {subject}: ok")
        elif v.status == "skipped":
            typer.echo(f"{v.file}: {subject}: skipped (not a {base.GROUP} resource)")
        else:
            where = manifests.heading(v.file, v.kind, v.name)
            for error in v.errors:
                typer.echo(f"{where}: {manifests.FieldError(**error)}", err=True)


def _print_table(verdicts: list[Verdict]) -> None:
    table = rich.table.Table(box=rich.box.SIMPLE, show_edge=False)
    for column in ("FILE", "RESOURCE", "STATUS", "FIELD", "MESSAGE"):
        table.add_column(column, overflow="fold")
    for v in verdicts:
        subject = f"{v.kind or '?'}/{v.name or '?'}" if v.kind or v.name else ""
        rows = v.errors or [{"path": "", "message": ""}]
        for error in rows:
            table.add_row(v.file, subject, v.status, error["path"], error["message"])
    # NB: piped output keeps one row per line (no folding at 80 columns), for grep and awk.
    console = rich.console.Console()
    if not console.is_terminal:
        console = rich.console.Console(width=10_000)
    console.print(table)


def validate_command(
    paths: list[Path] = typer.Argument(
        ..., metavar="FILE",
        help="Manifest files or directories (recursing into *.yaml); - reads standard input."),
    output: OutputFormat = typer.Option(
        OutputFormat.TEXT, "--output", "-o", help="text (one line per result), table, json or yaml."
    ),
) -> None:
    """Validate Huorn manifests offline, as the API server with the CRDs would; exit 2 if any is invalid."""
    files, verdicts = list_manifest_files(paths)
    for path in files:
        verdicts.extend(check_file(path))
    if not verdicts:
        # NB: as `kubectl apply` ("no objects passed to apply"): files of only comments or `---`
        # would otherwise pass in silence, and a script would take them for checked manifests.
        shown = " ".join(str(path) for path in paths)
        typer.echo(f"error: {shown}: no YAML documents to validate; give files that hold manifests", err=True)
        raise typer.Exit(EXIT_INVALID)
    if output is OutputFormat.TEXT:
        _print_text(verdicts)
    elif output is OutputFormat.TABLE:
        _print_table(verdicts)
    else:
        records = [asdict(v) for v in verdicts]
        if output is OutputFormat.JSON:
            typer.echo(json.dumps(records, indent=2))
        else:
            typer.echo(yaml.safe_dump(records, sort_keys=False).rstrip("\n"))
    if any(v.status == "invalid" for v in verdicts):
        raise typer.Exit(EXIT_INVALID)
