"""What `-o table|json|yaml` means for the commands that print a result: one enum and one way
to render each form, so that every command's JSON and YAML read alike."""

from __future__ import annotations

import io
import json
from enum import StrEnum
from typing import Any

import typer
import yaml
from rich.console import Console


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    YAML = "yaml"


def render_data(data: dict[str, Any], output: OutputFormat) -> str:
    """The JSON or YAML form of a result (keys in the order given)."""
    if output is OutputFormat.JSON:
        return json.dumps(data, indent=2)
    return yaml.safe_dump(data, sort_keys=False).rstrip()


def render_console(*renderables: Any) -> str:
    """Rich renderables (tables, lines) as plain text, 100 columns wide, for stdout."""
    console = Console(width=100, file=io.StringIO())
    for renderable in renderables:
        console.print(renderable)
    return console.file.getvalue().rstrip()  # type: ignore[attr-defined]


def print_error(message: str) -> None:
    """`error: MESSAGE` on stderr as plain text: rich would wrap it at the terminal's width (a
    file path split across lines can no longer be copied or grepped) and read `[...]` in it as
    markup, dropping part of the message."""
    typer.echo(f"error: {message}", err=True)
