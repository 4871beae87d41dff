"""`huorn graph FILE`: compile a manifest and show its execution graph as DOT, PNG or JSON.

The manifest helpers here are shared with `huorn run`: both must refuse a bad manifest the same
way (the field named, exit code 2) before anything is started.
"""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import Any

import typer
import yaml
from pydantic import BaseModel, ValidationError

from huorn import graph
from huorn.graph import model, render, serialise

EXIT_INVALID = 2


class GraphFormat(StrEnum):
    DOT = "dot"
    PNG = "png"
    JSON = "json"


class ManifestError(ValueError):
    """A manifest that cannot run; the message names the file, the field and the fix."""


def _describe(error: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in error.errors()
    )


def load_job(path: Path) -> BaseModel:
    """Read the first job document of a YAML file and validate it into its resource model."""
    try:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as error:
        raise ManifestError(f"{path}: cannot read it ({error.strerror})") from error
    except yaml.YAMLError as error:
        raise ManifestError(f"{path}: not valid YAML: {error}") from error
    jobs = [d for d in documents if isinstance(d, dict) and d.get("kind") in graph.registered_kinds()]
    if not jobs:
        raise ManifestError(f"{path}: kind: no job found; set kind to one of {graph.registered_kinds()}")
    try:
        return graph.load_resource(jobs[0])
    except ValidationError as error:
        raise ManifestError(f"{path}: {_describe(error)}") from error
    except ValueError as error:
        raise ManifestError(f"{path}: {error}") from error


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


def render_graph(g: model.Graph, fmt: GraphFormat, output: Path | None) -> Any:
    if fmt == GraphFormat.PNG:
        target = output or Path(f"{g.name}-graph.png")
        render.render_png(g, target)
        typer.echo(str(target))
        return target
    text = render.render_dot(g) if fmt == GraphFormat.DOT else json.dumps(serialise.to_status(g), indent=2)
    if output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
    else:
        output.write_text(text)
        typer.echo(str(output))
    return text


def graph_command(
    file: Path = typer.Argument(..., help="A TrainingJob, RLJob or InferenceJob manifest (YAML)."),
    output_format: GraphFormat = typer.Option(GraphFormat.DOT, "-o", "--output-format", help="dot|png|json."),
    output: Path | None = typer.Option(None, "--output", help="Write here instead of stdout (png: a file)."),
) -> None:
    """Compile a job manifest and render its execution graph."""
    try:
        _, g = compile_file(file)
    except ManifestError as error:
        fail_invalid(error)
        return
    render_graph(g, output_format, output)
