"""`huorn schedule`: print, check and draw a pipeline schedule table before anything runs.

A user choosing `schedule: kfkb` and `k` for a TrainingJob wants to see what each stage will do,
how many micro-batches it will hold (the activation memory it pays), and how long the bubble is.
The table is the executor's own (`huorn.runtime.pipeline.schedules`), so what it prints is what
runs. `--lockstep` adds the batched exchanges a stage posts in lockstep mode."""

from __future__ import annotations

import json
import sys
from enum import StrEnum
from pathlib import Path

import typer

EXIT_INVALID = 2


class Output(StrEnum):
    TABLE = "table"
    JSON = "json"
    PNG = "png"


MAX_STAGES, MAX_MICROBATCHES = 128, 4096


def schedule_command(
    stages: int = typer.Option(4, "--stages", "-s", help="Pipeline stages."),
    microbatches: int = typer.Option(8, "--microbatches", "-m",
                                     help="Micro-batches in a step (per replica)."),
    name: str = typer.Option("1f1b", "--schedule", help="gpipe, 1f1b or kfkb."),
    k: int = typer.Option(1, "--k", "-k", help="kFkB's group size (kfkb only)."),
    output: Output = typer.Option(Output.TABLE, "--output", "-o", help="table, json or png."),
    file: Path | None = typer.Option(None, "--file", "-f", help="Where -o png writes the drawing."),
    lockstep: bool = typer.Option(False, "--lockstep",
                                  help="Also show the lockstep exchanges of every stage."),
) -> None:
    """Print a schedule table: each stage's actions in order, its peak micro-batches in flight,
    and the step's makespan in unit times (forward 1, backward 2)."""
    from huorn.runtime.pipeline import schedules

    # NB: the table grows as stages × micro-batches (and its check for deadlocks faster): bounds a
    # pipeline can have (spec.parallelism.pipelineStages ≤ 128), not a run that never ends
    if stages > MAX_STAGES:
        _fail(f"--stages {stages} is more than a pipeline has (at most {MAX_STAGES}, as "
              "spec.parallelism.pipelineStages)")
    if microbatches > MAX_MICROBATCHES:
        _fail(f"--microbatches {microbatches} is more than this tool draws (at most {MAX_MICROBATCHES}); "
              "past that the bubble's share, (stages − 1) / (micro-batches + stages − 1), is at most 3 %")
    if name == "kfkb" and k < 1:
        _fail("--k must be >= 1 for kfkb (k = 1 is 1F1B)")
    if name != "kfkb" and k != 1:
        _fail(f"--k applies to --schedule kfkb only, not {name}")
    try:
        table = schedules.build_schedule(name, stages, microbatches, k)
    except schedules.ScheduleError as error:
        _fail(_as_flags(str(error)))
    timeline = schedules.simulate_timeline(table)
    assert timeline is not None  # build_schedule checked the table for deadlocks
    makespan = max(end for row in timeline for _, _, end in row)
    in_flight = schedules.count_in_flight(table)
    exchanges = None
    if lockstep:
        try:
            exchanges = schedules.lockstep_exchanges(table)
        except schedules.ScheduleError as error:
            _fail(str(error))
    if output is not Output.PNG and file is not None:
        _fail(f"--file applies to -o png only (the drawing); -o {output.value} prints to stdout")
        return
    if output is Output.PNG:
        if lockstep:
            _fail("--lockstep applies to -o table and -o json; the drawing shows the actions only")
            return
        if file is None:
            _fail("-o png needs --file PATH (a PNG is not written to a terminal)")
            return
        from huorn.cli.output import check_png, check_writable

        check_png(file, "--file")
        check_writable(file, "--file")
        from huorn.runtime.pipeline import drawing

        typer.echo(str(drawing.draw_schedules([table], file)))
        return
    if output is Output.JSON:
        payload = {"schedule": table.name, "k": table.k, "stages": stages, "microbatches": microbatches,
                   "table": [[str(a) for a in row] for row in table.table], "peakInFlight": list(in_flight),
                   "makespanUnits": makespan}
        if exchanges is not None:
            payload["lockstepExchanges"] = [[[str(t) for t in ops] for ops in per_stage]
                                            for per_stage in exchanges]
        typer.echo(json.dumps(payload, indent=2))
        return
    typer.echo(f"{table.name} k={table.k}, {stages} stages, {microbatches} micro-batches; makespan "
               f"{makespan:g} units (forward 1, backward 2; no bubble would be {3 * microbatches})")
    for stage, row in enumerate(table.table):
        typer.echo(f"stage {stage} (holds up to {in_flight[stage]}): " + " ".join(map(str, row)))
    if exchanges is not None:
        typer.echo("lockstep exchanges (posted before each action; [] = none):")
        for stage, per_stage in enumerate(exchanges):
            shown = " | ".join(", ".join(map(str, ops)) or "[]" for ops in per_stage)
            typer.echo(f"stage {stage}: {shown}")


def _as_flags(message: str) -> str:
    """The table builder names its arguments; the CLI user knows them as flags."""
    for argument, flag in (("microbatches", "--microbatches"), ("stages", "--stages"),
                           ("schedule name", "--schedule")):
        message = message.replace(argument, flag, 1) if argument in message else message
    return message


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    sys.exit(EXIT_INVALID)
