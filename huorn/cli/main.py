"""The `huorn` command.

Each subcommand lives in its own module under huorn.cli and is listed in `COMMANDS`, so that the
list is the whole surface (a test pins it). Subcommand modules are imported only when their
command runs: `huorn validate` must not pay for importing torch, sklearn and kopf, which `run`,
`simulate` and `operator` need (eager imports made every command take ~12 s on a loaded machine).
"""

from __future__ import annotations

import importlib

import click
import typer
import typer.core

from huorn import __version__

# name -> (module under huorn.cli, function in it, one-line help shown by `huorn --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "validate": ("validate", "validate_command", "Validate manifests offline; exit 2 if any is invalid."),
    "crds": ("crds", "crds_command", "Generate the CustomResourceDefinitions from the API models."),
    "graph": ("graph", "graph_command", "Compile a manifest into its execution graph (DOT, PNG or JSON)."),
    "run": ("run", "run_command", "Run a TrainingJob, RLJob or InferenceJob on this machine."),
    "operator": ("operator", "operator_command", "Start the Kubernetes operator."),
    "simulate": ("simulate", "simulate", "Compare scheduling policies on a cluster trace."),
    "detect": ("detect", "detect_command", "Find fail-slow workers in a step-time table."),
    "schedule": ("schedule", "schedule_command", "Print, check and draw a pipeline schedule table."),
    "forecast": ("forecast", "forecast_command", "Replay the prediction board over request-rate history."),
}


class LazyGroup(typer.core.TyperGroup):
    """A click group that imports a subcommand's module only when that command is used."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in COMMANDS:
            return super().get_command(ctx, cmd_name)
        module_name, function_name, short_help = COMMANDS[cmd_name]
        module = importlib.import_module(f"huorn.cli.{module_name}")
        # NB: plain help, as the top level's: rich's boxes cut long flags at 80 columns
        # (`--replacement-backoff-seco…`), so the flag shown could not be copied or grepped
        single = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
        single.command(cmd_name, short_help=short_help)(getattr(module, function_name))
        return typer.main.get_command(single)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # NB: listing help must not import every subcommand; the one-liners live in COMMANDS.
        rows = [(name, COMMANDS[name][2]) for name in sorted(COMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


app = typer.Typer(
    name="huorn",
    help="Huorn: elastic training, RL and inference on shared GPU clusters.",
    cls=LazyGroup,
    rich_markup_mode=None,
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
