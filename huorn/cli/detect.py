"""`huorn detect STEPTIMES.csv`: run the fail-slow detector on a recorded table of step times.

The table is the detector's generic input (``iteration,worker,time`` and optionally
``compute,comm``), so a trace from any framework, or one that Huorn recorded live, can be
checked offline with exactly the code the operator runs. Exit code 2 means malformed input,
with the column and line named on stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.table import Table

from huorn.cli.output import OutputFormat, check_number, print_error, render_console, render_data
from huorn.scheduler.remediation import bocd, failslow, steptable

EXIT_INVALID = 2
STDIN = Path("-")


def _read_stdin() -> str:
    try:
        return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError as error:  # as steptable.read_csv says it of a file
        raise steptable.StepTableError(f"not UTF-8 text (byte {error.start}): expected a CSV with header "
                                       f"{','.join(steptable.REQUIRED)}") from None


def render_findings(findings: list[failslow.SlowFinding], output: OutputFormat) -> str:
    rows = [f.to_dict() for f in findings]
    if output is not OutputFormat.TABLE:
        return render_data({"findings": rows}, output)
    table = Table("WORKER", "KIND", "ONSET", "DETECTED", "FACTOR", box=None, pad_edge=False)
    for f in findings:
        table.add_row(f.worker, f.kind, str(f.onset_iteration), str(f.detected_iteration), f"{f.factor:.2f}x")
    return render_console(table if findings else "no fail-slow found")


def detect_command(
    steptimes: Path = typer.Argument(
        ..., metavar="STEPTIMES",
        help="CSV with columns iteration,worker,time[,compute,comm]; - reads standard input."),
    output: OutputFormat = typer.Option(OutputFormat.TABLE, "--output", "-o", help="table, json or yaml."),
    as_json: bool = typer.Option(False, "--json", help="Same as -o json."),
    min_shift: float = typer.Option(0.10, "--min-shift", help="Smallest slowdown kept (0.10 = 10%)."),
) -> None:
    """Find fail-slow workers in a table of per-worker step times (FALCON: BOCD + validation)."""
    if as_json:
        if output not in (OutputFormat.TABLE, OutputFormat.JSON):  # -o given, and not json
            print_error(f"--json with -o {output.value}: choose one (--json is -o json)")
            raise typer.Exit(EXIT_INVALID)
        output = OutputFormat.JSON
    check_number("--min-shift", min_shift, 0, 10, above=True, below=True,
                 fix="use a fraction, such as 0.10 for 10%")
    try:
        # NB: `-` as for validate, graph and run (`... | huorn detect -`); it was a file named "-"
        table = steptable.parse_csv(_read_stdin()) if steptimes == STDIN else steptable.read_csv(steptimes)
    except OSError as error:
        print_error(f"cannot read {steptimes}: {error.strerror or error}")
        raise typer.Exit(EXIT_INVALID) from None
    except steptable.StepTableError as error:
        print_error(f"{steptimes}: {error}")
        raise typer.Exit(EXIT_INVALID) from None
    findings = failslow.detect_fail_slow(table, bocd.BocdConfig(min_shift=min_shift))
    typer.echo(render_findings(findings, output))
