"""`huorn simulate`: run the scheduling policies on a trace and write a report with plots.

Exit code 2 on invalid input (a malformed CSV names its column), like kubectl's usage errors;
progress goes to stderr through rich, so stdout carries only the result (table, JSON or YAML).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from huorn.cli.output import check_not_a_format, check_number, check_writable, print_error, render_console
from huorn.sim import engine, policies, report, run, shared_data, workload

DATA = shared_data.shared_data_dir()
COLUMNS = ("jct_mean_s", "jct_p50_s", "jct_p99_s", "makespan_s", "goodput_gpu_equiv", "job_goodput_vs_trace",
           "gpu_utilisation", "inference_slo_attainment", "preemptions", "gpu_hours_lost_total",
           "gpu_hours_lost", "wall_seconds")

# σ of log(declared / true length): 10 is already a factor of e^10 at one σ, and past about 100
# workload.declared_factor's exp() overflows (it draws up to 7 σ).
MAX_WORK_ESTIMATE_ERROR = 10.0


def _check_load(ctx: typer.Context, trace: Path, sample: workload.Sample, config: engine.SimConfig,
                train_gpus: int) -> None:
    """Refuse a --load the trace cannot offer (ValueError): past it the simulator ran at the most
    the trace offers while report.json recorded the load asked. Not given, the default is only
    noted as out of reach, since a small trace then runs at its most, as it always did.
    `train_gpus` is what the node split really leaves to train (run.split_cluster), the GPUs the
    load is compressed for."""
    most = sample.offered_load(train_gpus, workload.MAX_COMPRESSION)
    if most >= config.load:
        return
    shown = math.floor(most * 100) / 100  # rounded down, so that the load it suggests is accepted
    offers = f"{trace} offers a training load of at most {shown:.2f} on {train_gpus} training GPUs"
    # NB: by name: typer carries its own copy of click, whose ParameterSource is not click's
    if getattr(ctx.get_parameter_source("load"), "name", "") != "DEFAULT":
        raise ValueError(f"--load {config.load:g}: {offers} (every arrival at once); give --load "
                         f"{shown:.2f} or less")
    typer.echo(f"note: {offers}, less than the default --load {config.load:g}; simulating at that", err=True)


def _sampling_note(sample: workload.Sample, gpus: int) -> str:
    """How many training pods the N/1024 rule kept: it applies to any trace, and a user's own
    trace lost most of its pods at --gpus 64 without a word."""
    if sample.keep >= 1:
        return (f"kept {len(sample.pods)} of {sample.training} training pods (probability 1: every pod "
                f"at --gpus {workload.FULL_TRACE_GPUS} or more)")
    return (f"kept {len(sample.pods)} of {sample.training} training pods (probability {gpus}/"
            f"{workload.FULL_TRACE_GPUS} = {sample.keep:.3g} each at --gpus {gpus}; all at --gpus "
            f"{workload.FULL_TRACE_GPUS})")


def simulate(
    ctx: typer.Context,
    trace: Path = typer.Option(DATA / "openb_pod_list_default.csv", "--trace", help="OpenB pod list CSV."),
    nodes: Path = typer.Option(DATA / "openb_node_list_gpu_node.csv", "--nodes", help="OpenB node list CSV."),
    qps: Path = typer.Option(DATA / "genai_qps.csv", "--qps", help="Inference request-rate CSV."),
    gpus: int = typer.Option(128, "--gpus", help="Cluster size; the trace is scaled to it."),
    policy: str = typer.Option("all", "--policy", help="all, or one of: fifo, kueue, pollux, pollux-p-1, "
                                                        "pollux-p-1-fair, each of those three with "
                                                        "-arrival (AdaptDL's admission on arrival), huorn."),
    seed: int = typer.Option(0, "--seed", help="Seeds node choice, task sampling and telemetry noise."),
    load: float = typer.Option(0.8, "--load", help="Offered training load over the arrival window."),
    inference_share: float = typer.Option(0.25, "--inference-share", help="Share of GPUs for inference."),
    qps_start: str = typer.Option("middle", "--qps-start", help="QPS series start: middle, beginning."),
    work_estimate_error: float = typer.Option(
        0.0, "--work-estimate-error", help="σ of log(declared / true length) of every job: how wrong "
        "the steps its spec declares are (0: exact)."),
    undeclared_share: float = typer.Option(
        0.0, "--undeclared-share", help="Share of jobs whose spec declares no length (0 to 1)."),
    output: Path = typer.Option(Path("sim-report"), "--output", help="Directory for report.json and plots."),
    fmt: str = typer.Option("table", "-o", "--output-format", help="table, json or yaml on stdout."),
) -> None:
    """Simulate the policies on the trace; writes DIR/report.json and PNG plots."""
    err = Console(stderr=True)
    check_number("--load", load, 0, above=True)
    check_number("--inference-share", inference_share, 0, 1, above=True, below=True)
    check_number("--work-estimate-error", work_estimate_error, 0, MAX_WORK_ESTIMATE_ERROR,
                 fix="σ of log(declared / true length): 0 is exact, 1 already off by a factor e")
    check_number("--undeclared-share", undeclared_share, 0, 1)
    names = list(policies.POLICIES) if policy == "all" else [policy]
    try:
        if policy != "all" and policy not in policies.POLICIES:
            raise ValueError(f"--policy {policy!r} is unknown; use all or one of {sorted(policies.POLICIES)}")
        if fmt not in ("table", "json", "yaml"):
            raise ValueError(f"-o {fmt!r} is unknown; use table, json or yaml")
        for flag, path in (("--trace", trace), ("--nodes", nodes), ("--qps", qps)):
            if not path.is_file():
                raise ValueError(f"{flag} {path}: " + ("is a directory; give a CSV file" if path.is_dir()
                                                       else "no such file"))
        try:
            config = engine.SimConfig(gpus=gpus, seed=seed, inference_share=inference_share, load=load,
                                      qps_start=qps_start, work_estimate_error=work_estimate_error,
                                      undeclared_share=undeclared_share)
        except ValueError as exc:  # SimConfig names its fields ("inference_share"); users know flags
            field, _, rest = str(exc).partition(" ")
            raise ValueError(f"--{field.replace('_', '-')} {rest}") from None
        check_not_a_format(output, ("table", "json", "yaml"))
        check_writable(output, "--output", directory=True)
        # the node list first: its errors (too few GPUs for --gpus) come before any note on the load
        split = run.split_cluster(nodes, config)
        # the pods build_simulations samples (same trace, --gpus and seed), read once more to say
        # how many were kept and what load the compression really offers
        sample = workload.sample_training_pods(trace, gpus, seed)
        _check_load(ctx, trace, sample, config, split.train_gpus)
        with err.status(f"reading the trace and building {len(names)} simulation(s)"):
            sims = run.build_simulations(trace, nodes, qps, names, config)
        if (note := split.note(config)) is not None:  # once the inputs are known good, as a run's note
            typer.echo(f"note: {note}", err=True)
        typer.echo(f"note: {_sampling_note(sample, gpus)}", err=True)
        compression = sample.compression(split.train_gpus, load)
        inputs = {"offered_load_simulated": sample.offered_load(split.train_gpus, compression),
                  "arrival_compression": compression, "training_pods_in_trace": sample.training,
                  "training_pods_kept": len(sample.pods)}
        # a bar only on a terminal: piped or redirected stderr gets no frames, as kubectl's
        with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                      TimeElapsedColumn(), console=err, disable=not err.is_terminal) as bar:
            tasks = {n: bar.add_task(f"{n:>7}", total=1.0) for n in names}
            results = run.run_simulations(sims, lambda n, f: bar.update(tasks[n], completed=f))
            for n in names:
                bar.update(tasks[n], completed=1.0)
    except (ValueError, workload.TraceError) as exc:
        print_error(str(exc))
        raise typer.Exit(2) from None
    path = report.write_report(output, results, sims, inputs)
    left_out = next(iter(sims.values())).left_out
    # plain lines, not rich's: a path or a job name holding [bold] is no markup, and a long line
    # is not wrapped at the terminal's width
    if left_out:
        typer.echo(f"note: {len(left_out)} job(s) of the trace fit no training node sampled for {gpus} GPUs "
                   f"(seed {seed}) and were left out of every policy's run (jobs_left_out): "
                   f"{', '.join(left_out[:5])}{' ...' if len(left_out) > 5 else ''}", err=True)
    for n in names:
        if (why := results[n].get("goodput_gpu_equiv_null_reason")) is not None:
            typer.echo(f"note: {n}: goodput_gpu_equiv is null (n/a): {why}", err=True)
    typer.echo(f"wrote {path} and plots in {output}", err=True)
    full = {"policies": results, "huorn_vs_baselines": report.compare(results)}
    if fmt == "json":
        sys.stdout.write(json.dumps(full, indent=2, sort_keys=True) + "\n")
    elif fmt == "yaml":
        sys.stdout.write(yaml.safe_dump(full, sort_keys=True))
    else:
        # plain columns as kubectl prints them, never cut: six policies need ~130 columns, and
        # rich at a pipe's 80 cut both the metric names and the numbers to "…"
        table = Table("METRIC", *(n.upper() for n in names), box=None, pad_edge=False)
        for column in table.columns[1:]:
            column.justify = "right"
        for col in COLUMNS:
            # null (goodput over an arrival window too short to read) shows as n/a, not a number
            table.add_row(col, *("n/a" if results[n][col] is None else f"{results[n][col]:.4g}"
                                 for n in names))
        typer.echo(render_console(table, width=200))

