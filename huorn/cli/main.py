"""The `huorn` command. Each subcommand lives in its own module under huorn.cli and is
registered here, so that the list below is the whole surface (a test pins it)."""

from __future__ import annotations

import typer

from huorn import __version__

app = typer.Typer(
    name="huorn",
    help="Huorn: elastic training, RL and inference on shared GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"huorn {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Huorn: elastic training, RL and inference on shared GPU clusters."""


# Subcommand registrations: one line per command, each from its own module.
from huorn.cli import graph as _graph_cli  # noqa: E402, I001
app.command("graph")(_graph_cli.graph_command)
from huorn.cli import crds as _crds_cli  # noqa: E402, I001
app.command("crds")(_crds_cli.crds_command)
from huorn.cli import validate as _validate_cli  # noqa: E402, I001
app.command("validate")(_validate_cli.validate_command)
from huorn.cli import operator as _operator_cli  # noqa: E402, I001
app.command("operator")(_operator_cli.operator_command)
from huorn.cli import run as _run_cli  # noqa: E402, I001
app.command("run")(_run_cli.run_command)
from huorn.cli import simulate as _simulate_cli  # noqa: E402, I001
app.command("simulate")(_simulate_cli.simulate)
from huorn.cli import detect as _detect_cli  # noqa: E402, I001
app.command("detect")(_detect_cli.detect_command)
