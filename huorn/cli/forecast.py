"""`huorn forecast`: replay the prediction board over a service's request-rate history.

Before an inference VirtualCluster gets `lending.forecast`, its owners want to know what the board
would have reserved: how often it covers the next 10 minutes' need, how many GPUs it keeps idle to
do so, and how that compares with reserving the rate now (persistence, what a reactive lender
does). This fits the board on the first part of the history and replays it over the rest with
exactly the operator's model (`huorn.scheduler.forecast`). The history comes from a CSV in the
GenAI QPS format (`timestamp_anon,value[,container_ip,request_type]`: per 5-minute bin, each
series' mean summed over series) or from Prometheus, with the
query and URL the VirtualCluster would carry. Exit code 2 means bad input, named on stderr.
"""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

from huorn.api import files
from huorn.api.base import parse_duration
from huorn.cli.output import (
    OutputFormat,
    check_number,
    check_writable,
    print_error,
    render_console,
    render_data,
)
from huorn.scheduler import forecast

EXIT_INVALID = 2


def render(report: dict, output: OutputFormat) -> str:
    if output is not OutputFormat.TABLE:
        return render_data(report, output)
    table = Table("RESERVE", "COVERAGE", "MEAN GPUS", "IDLE GPUS", "SHORT GPU-H", box=None, pad_edge=False)
    for name, s in report["summary"].items():
        table.add_row(name, f"{s['coverage']:.1%}", f"{s['mean_reserved_gpus']:.1f}",
                      f"{s['mean_idle_gpus']:.1f}", f"{s['short_gpu_hours']:.2f}")
    heading = (f"{report['bins_replayed']} bins replayed after fitting on {report['bins_fitted']} "
               f"(quantile {report['quantile']}, {report['requests_per_gpu']:g} requests/s per GPU)")
    return render_console(heading, table)


def write_outputs(evaluation: forecast.BoardEvaluation, report: dict, directory: Path) -> None:
    """Each file is swapped in whole, so a replay cut short keeps the previous one's files."""
    directory.mkdir(parents=True, exist_ok=True)
    files.write_text_atomically(directory / "forecast.json", json.dumps(report, indent=2))
    with files.replacing(directory / "forecast.csv") as scratch, scratch.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["time", "rate", "forecast_peak", "need_gpus", "board_gpus", "persistence_gpus"])
        for row in zip(evaluation.times, evaluation.rate, evaluation.peak, evaluation.need,
                       evaluation.board_gpus, evaluation.persistence_gpus, strict=True):
            writer.writerow([f"{row[0]:.0f}", f"{row[1]:.4g}", f"{row[2]:.4g}", *(int(v) for v in row[3:])])
    plot(evaluation, directory / "forecast.png")


def plot(evaluation: forecast.BoardEvaluation, path: Path) -> None:
    """GPUs over the replayed history: what the next horizon needed, what the board reserved and
    what persistence would have; the bins where each fell short are marked."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    hours = (evaluation.times - evaluation.times[0]) / 3600
    fig, ax = plt.subplots(figsize=(9, 3.6))
    ax.step(hours, evaluation.need, where="post", color="black", lw=1.2, label="needed (next 10 min)")
    ax.step(hours, evaluation.board_gpus, where="post", color="tab:blue", label="board")
    ax.step(hours, evaluation.persistence_gpus, where="post", color="tab:orange", alpha=0.7,
            label="persistence (rate now)")
    for reserve, color in ((evaluation.board_gpus, "tab:blue"), (evaluation.persistence_gpus, "tab:orange")):
        short = reserve < evaluation.need
        ax.scatter(hours[short], evaluation.need[short], color=color, marker="x", s=14)
    ax.set_xlabel("hours into the replayed history")
    ax.set_ylabel("inference GPUs")
    ax.set_title("prediction board, replayed (× = short)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    with files.replacing(path) as scratch:
        fig.savefig(scratch, dpi=110, format="png")
    plt.close(fig)


def read_prometheus(url: str, query: str, history: str, bin_seconds: float) -> tuple[np.ndarray, np.ndarray]:
    """The history the operator's board would read, as a ValueError naming the option on failure."""
    from huorn.operator import board  # the operator's own reader; imported only for this source

    days = history[:-1] if history.endswith("d") else ""
    try:
        seconds = float(days) * 86400 if days.isdigit() else parse_duration(history)
    except ValueError:
        raise ValueError(f"--history={history}: use a duration such as 7d, 48h or 90m") from None
    now = time.time()
    try:
        return board.fetch_rate_history(url, query, now - seconds, now, bin_seconds, 30.0)
    except board.ForecastUnavailable as error:
        raise ValueError(str(error).replace("spec.lending.forecast.prometheusURL", "--prometheus")
                         .replace("spec.lending.forecast.query", "--query")) from None


def forecast_command(
    qps: Path | None = typer.Option(None, "--qps", help="Request-rate CSV (timestamp_anon,value)."),
    prometheus: str | None = typer.Option(None, "--prometheus", help="Prometheus base URL, as in "
                                          "lending.forecast.prometheusURL."),
    query: str | None = typer.Option(None, "--query", help="PromQL request rate (lending.forecast.query)."),
    history: str = typer.Option("7d", "--history", help="How far back to read from Prometheus: 7d, 48h."),
    requests_per_gpu: float = typer.Option(..., "--requests-per-gpu", help="Requests/s one GPU serves."),
    quantile: float = typer.Option(0.9, "--quantile", help="The board's quantile (0.5-0.99)."),
    headroom: float = typer.Option(0.1, "--headroom", help="Spare capacity above the forecast (0-1)."),
    train_share: float = typer.Option(0.5, "--train-share", help="Share of the history fitted on."),
    output_dir: Path | None = typer.Option(None, "--output-dir", "-d", help="Write forecast.json, "
                                           "forecast.csv and forecast.png here."),
    output: OutputFormat = typer.Option(OutputFormat.TABLE, "--output", "-o", help="table, json or yaml."),
) -> None:
    """Replay the prediction board over request-rate history, against reserving the rate now."""
    err = Console(stderr=True, soft_wrap=True)

    def fail(message: str) -> None:
        print_error(message)
        raise typer.Exit(EXIT_INVALID)

    if (qps is None) == (prometheus is None):
        fail("give the history either as --qps FILE or as --prometheus URL --query PROMQL")
    if prometheus is not None and not query:
        fail("--prometheus needs --query, the PromQL that gives the request rate")
    if qps is not None and (query is not None or history != "7d"):
        # read only from Prometheus: with a CSV they were silently ignored
        fail(f"{'--query' if query is not None else '--history'} applies to --prometheus only, not to --qps")
    check_number("--requests-per-gpu", requests_per_gpu, 0, above=True)
    check_number("--quantile", quantile, 0.5, 0.99, fix="as lending.forecast.quantile")
    check_number("--headroom", headroom, 0, 1)
    check_number("--train-share", train_share, 0, 1, above=True, below=True, fix="use a share such as 0.5")
    if output_dir is not None:
        check_writable(output_dir, "--output-dir", directory=True)
    config = forecast.ForecastConfig(quantile=quantile)
    with err.status("reading the history and fitting the board"):
        try:
            if qps is not None:
                # `-` is standard input, as validate, graph, run and detect read it
                source = sys.stdin if str(qps) == "-" else qps
                times, rate = forecast.load_qps_series(source, config.bin_seconds)
            else:
                times, rate = read_prometheus(prometheus or "", query or "", history, config.bin_seconds)
        except OSError as error:
            fail(f"cannot read {qps}: {error.strerror or error}")
            raise  # not reached: fail() exits
        except ValueError as error:  # a malformed CSV, Prometheus's refusal
            fail(str(error))
            raise
        try:
            evaluation = forecast.evaluate_board(times, rate, requests_per_gpu, headroom, config, train_share)
        except ValueError as error:  # a short history: name where it came from, and the way out
            source = f"--qps {qps}" if qps is not None else f"--prometheus {prometheus} --history {history}"
            fail(f"{source}: {error} of {config.bin_seconds / 60:g} minutes; give a longer history")
            raise
    report = {"bins_fitted": len(rate) - len(evaluation.times) - config.horizon_bins,
              "bins_replayed": len(evaluation.times), "bin_seconds": config.bin_seconds,
              "quantile": quantile, "headroom": headroom, "requests_per_gpu": requests_per_gpu,
              "summary": evaluation.summary()}
    if output_dir is not None:
        write_outputs(evaluation, report, output_dir)
    typer.echo(render(report, output))
