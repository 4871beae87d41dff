"""`huorn graph FILE`: compile a manifest and show its execution graph as DOT, PNG or JSON.

The manifest helpers here are shared with `huorn run`: both must refuse a bad manifest the same
way (the field named, exit code 2) before anything is started.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
from pydantic import BaseModel

from huorn import graph
from huorn.api import files, manifests
from huorn.cli.output import check_not_a_format, check_png, check_writable, print_error
from huorn.graph import model, render, serialise

EXIT_INVALID = 2


class GraphFormat(StrEnum):
    DOT = "dot"
    PNG = "png"
    JSON = "json"


class ManifestError(ValueError):
    """A manifest that cannot run; the message names the file, the field and the fix."""


def load_job(path: Path) -> BaseModel:
    """Read and validate a one-document manifest with the API's own loader (the same checks as
    `huorn validate` and admission), and insist on a kind that compiles into a graph."""
    try:
        documents = list(manifests.read_documents(path))
        if len(documents) != 1:
            # NB: load_manifest's own message points Python callers at load_manifests; a CLI user
            # needs to hear what to do with the file.
            found = f"holds {len(documents)} YAML documents" if documents else "holds no YAML document"
            raise ManifestError(f"{path}: {found}; give a file with exactly one job manifest "
                                "(huorn validate checks files of several)")
        resource = manifests.load_document(documents[0], origin=str(path))
    except manifests.ManifestError as error:
        raise ManifestError(str(error)) from error
    if resource.kind not in graph.registered_kinds():
        raise ManifestError(
            f"{path}: kind: {resource.kind} has no execution graph; use one of {graph.registered_kinds()}"
        )
    return resource


def compile_file(path: Path) -> tuple[BaseModel, model.Graph]:
    """Load and compile; every failure becomes a ManifestError, so callers exit 2 in one place."""
    resource = load_job(path)
    try:
        return resource, graph.compile(resource)
    except ValueError as error:
        raise ManifestError(f"{path}: {error}") from error


def fail_invalid(error: Exception) -> None:
    typer.echo(f"error: {error}", err=True)
    raise typer.Exit(EXIT_INVALID)


def default_png(g: model.Graph) -> Path:
    """Where -o png writes without --output: the current directory."""
    return Path(f"{g.name}-graph.png")


def render_graph(g: model.Graph, fmt: GraphFormat, output: Path | None) -> Any:
    """Files are swapped in whole (huorn.api.files), so a failed write keeps a previous picture;
    one that fails anyway (a disk filled, a directory made read-only since the check) exits 2
    naming the path, as the check before it would have."""
    if fmt == GraphFormat.PNG:
        target = output or default_png(g)
        with _writing(target, output is not None), files.replacing(target) as scratch:
            render.render_png(g, scratch)
        typer.echo(str(target))
        return target
    text = render.render_dot(g) if fmt == GraphFormat.DOT else json.dumps(serialise.to_status(g), indent=2)
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        with _writing(output, True):
            files.write_text_atomically(output, text)  # creates missing parents, as render_png does
        typer.echo(str(output))
    return text


@contextlib.contextmanager
def _writing(path: Path, given: bool) -> Iterator[None]:
    """An OSError while writing `path` as exit 2 naming it, not a traceback."""
    try:
        yield
    except OSError as error:
        flag = "--output" if given else "-o png (no --output: the current directory)"
        print_error(f"{flag} {path}: cannot write it ({error.strerror or error}); give --output a path "
                    "you can write")
        raise typer.Exit(EXIT_INVALID) from None


def graph_command(
    file: Path = typer.Argument(..., metavar="FILE",
                                help="A TrainingJob, RLJob or InferenceJob manifest (YAML)."),
    output_format: GraphFormat = typer.Option(GraphFormat.DOT, "-o", "--output-format", help="dot|png|json."),
    output: Path | None = typer.Option(None, "--output", help="Write here instead of stdout (png: a file)."),
) -> None:
    """Compile a job manifest and render its execution graph."""
    try:
        _, g = compile_file(file)
    except ManifestError as error:
        fail_invalid(error)
        return
    if output is not None:
        check_not_a_format(output, tuple(f.value for f in GraphFormat))
        if output_format is GraphFormat.PNG:
            check_png(output, "--output")
        elif output.suffix.lower() == ".png":  # DOT text in a file named g.png
            print_error(f"--output {output}: a .png path with -o {output_format.value}; add -o png for "
                        "a picture, or name the file for its format")
            raise typer.Exit(2)
        check_writable(output, "--output")
    elif output_format is GraphFormat.PNG:  # the current directory may be read-only
        check_writable(default_png(g), "-o png (no --output: the current directory)",
                       fix="give --output a .png path you can write")
    render_graph(g, output_format, output)
