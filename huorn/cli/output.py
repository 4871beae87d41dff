"""What `-o table|json|yaml` means for the commands that print a result: one enum and one way
to render each form, so that every command's JSON and YAML read alike."""

from __future__ import annotations

import io
import json
import math
import os
import socket
from enum import StrEnum
from pathlib import Path
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


def render_console(*renderables: Any, width: int = 100) -> str:
    """Rich renderables (tables, lines) as plain text, at most `width` columns, for stdout."""
    console = Console(width=width, file=io.StringIO())
    for renderable in renderables:
        console.print(renderable)
    return console.file.getvalue().rstrip()  # type: ignore[attr-defined]


def print_error(message: str) -> None:
    """`error: MESSAGE` on stderr as plain text: rich would wrap it at the terminal's width (a
    file path split across lines can no longer be copied or grepped) and read `[...]` in it as
    markup, dropping part of the message."""
    typer.echo(f"error: {message}", err=True)


def check_number(flag: str, value: float | None, low: float | None = None, high: float | None = None, *,
                 above: bool = False, below: bool = False, fix: str = "") -> None:
    """Exit 2 naming `flag` unless `value` (None: not given) is a finite number from `low` to
    `high` (`above`/`below`: strictly). Every float flag comes through here before its command
    starts anything: NaN passes any comparison-based check (nan <= 0 is False), so
    --work-estimate-error nan hung the simulator and --requests-per-gpu nan printed nonsense with
    exit 0, and --interval inf passed --interval's minimum to overflow sleep() once the trainers ran."""
    if value is None:
        return
    fits = math.isfinite(value)
    if fits and low is not None:
        fits = value > low if above else value >= low
    if fits and high is not None:
        fits = value < high if below else value <= high
    if fits:
        return
    if low is not None and high is not None:
        wanted = f"must lie in {'(' if above else '['}{low:g}, {high:g}{')' if below else ']'}"
    elif low is not None:
        wanted = f"must be a finite number {'>' if above else '≥'} {low:g}"
    elif high is not None:
        wanted = f"must be a finite number {'<' if below else '≤'} {high:g}"
    else:
        wanted = "must be a finite number"
    print_error(f"{flag} {wanted}, got {value:g}" + (f"; {fix}" if fix else ""))
    raise typer.Exit(2)


def check_png(path: Path, flag: str) -> None:
    """Exit 2 unless `path` ends in .png: matplotlib picks the format from the suffix, so `g.dot`
    raised deep inside it, `g.svg` wrote an SVG and `g` wrote `g.png` while `g` was printed."""
    if path.suffix.lower() != ".png":
        print_error(f"{flag} {path}: -o png writes a PNG; give a path ending in .png")
        raise typer.Exit(2)


def check_not_a_format(path: Path, formats: tuple[str, ...]) -> None:
    """Exit 2 when --output names a format: in kubectl `--output json` is the format, and here
    (graph, simulate) --output is where to write and -o/--output-format the format, so the habit
    wrote a file or directory named `json` and exited 0."""
    if not path.suffix and path.parent == Path(".") and path.name.lower() in formats:
        print_error(f"--output {path}: --output is the path to write; for the {path.name} format use "
                    f"-o {path.name.lower()} (for a path of that name, give its directory too: "
                    f"--output $PWD/{path.name})")
        raise typer.Exit(2)


def cannot_listen(port: int, host: str = "") -> str | None:
    """Why `port` cannot be bound on `host` now (the OS's reason), or None: a flag's port is
    checked before anything starts, and the process binds it again later."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
        try:
            probe.bind((host, port))
        except OSError as error:
            return error.strerror or str(error)
    return None


def check_writable(path: Path, flag: str, directory: bool = False, fix: str | None = None) -> None:
    """Exit 2 naming `flag` unless `path` (a file, or a directory when `directory`) can be written.

    Commands call this before their work: a report that cannot be saved after minutes of
    simulation loses all of it, and a traceback names neither the flag nor the fix. Nothing is
    created here, so a refused run leaves nothing behind; missing parents are created on write.
    `fix` replaces the generic way out where the flag was not given (a default path).
    """
    reason = _unwritable(path, directory)
    if reason is not None:
        what = "a directory" if directory else "a file path"
        print_error(f"{flag} {path}: {reason}; {fix or f'give {what} you can write'}")
        raise typer.Exit(2)


def _unwritable(path: Path, directory: bool) -> str | None:
    if path.exists():
        if path.is_dir() != directory:
            return "is a directory" if path.is_dir() else "is a file, not a directory"
        return None if os.access(path, os.W_OK) else "permission denied"
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"cannot create it in {ancestor} (permission denied)"
    return None
