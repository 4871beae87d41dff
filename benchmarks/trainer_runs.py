"""Real trainer processes for the CPU benchmarks: each run is `python -m huorn.runtime.train` with
a run config of its own, a progress bar per run, and a few at a time (one thread each)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter
from rich.progress import Progress

from huorn.runtime import config as run_config
from huorn.runtime import launcher
from huorn.runtime.data import build, corpora

ROOT = Path(__file__).resolve().parents[1]


def start_trainer(name: str, body: dict, out: Path, data_dir: Path, nproc: int = 1
                  ) -> tuple[run_config.RunConfig, subprocess.Popen]:
    """A world of one, or of `nproc` local ranks under the runtime's torchrun agent."""
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)  # a fresh run: no checkpoint, no plan from before
    config = run_config.RunConfig.model_validate({
        "jobName": name, "spec": body, "runDir": str(directory / "run"),
        "checkpointDir": str(directory / "ckpt"), "dataDir": str(data_dir), "telemetryHost": "127.0.0.1",
        "validationBatches": 4})
    path = run_config.write_run_config(config, directory / "config.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = open(directory / "train.log", "wb")  # noqa: SIM115 - closed with the process, below
    process = subprocess.Popen(launcher.build_standalone_command(path, nproc),
                               cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    return config, process


def run_all(jobs: dict[str, dict], out: Path, data_dir: Path, progress: Progress,
            parallel: int, ranks: dict[str, int] | None = None) -> dict[str, run_config.RunConfig]:
    """Each job a real trainer, `parallel` at a time (one thread each), with a bar per job;
    `ranks` names the jobs that run as more than a world of one."""
    waiting = list(jobs.items())
    running: dict[str, tuple[run_config.RunConfig, subprocess.Popen, object]] = {}
    done: dict[str, run_config.RunConfig] = {}
    while waiting or running:
        while waiting and len(running) < parallel:
            name, body = waiting.pop(0)
            config, process = start_trainer(name, body, out, data_dir, (ranks or {}).get(name, 1))
            running[name] = (config, process, progress.add_task(name, total=body["optimization"]["steps"]))
        time.sleep(0.5)
        for name, (config, process, task) in list(running.items()):
            steps_file = Path(config.run_dir) / run_config.STEPS_FILE
            count = steps_file.read_text().count('"event": "step"') if steps_file.exists() else 0
            progress.update(task, completed=count)  # type: ignore[arg-type]
            if process.poll() is not None:
                if process.returncode != 0:
                    raise SystemExit(f"{name} failed; see {out / name / 'train.log'}")
                done[name] = config
                del running[name]
    return done




def argument_parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """The benchmark's parser with its outputs: --work (runs, ignored by git), --out (the JSON
    under benchmarks/results) and --png (the figure under docs/figures)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / name)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / f"{name}.json")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "figures" / f"{name}.png")
    return parser


def finish_axes(axes: Iterable[Axes], xlabel: str) -> None:
    """The panels of a figure that compares runs: one x label, a light grid, a legend each."""
    for axis in axes:
        axis.set_xlabel(xlabel)
        axis.grid(alpha=0.3)
        axis.legend()


def write_report(args: argparse.Namespace, started: float, **fields: Any) -> dict[str, Any]:
    """`args.out` as JSON: the arguments (paths as text), the benchmark's fields and its wall
    seconds since `started` (time.perf_counter). Returns what was written."""
    report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              **fields, "seconds": round(time.perf_counter() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def plot_latency_cdf(axis: Axes, curves: Iterable[tuple[str, list[float]]]) -> None:
    """Each run's request latencies (seconds) as a CDF on a log axis of milliseconds: a serving
    benchmark's tail is what a mean hides."""
    for label, latencies in curves:
        ms = sorted(1000 * x for x in latencies)
        axis.plot(ms, [(i + 1) / len(ms) for i in range(len(ms))], label=label)
    axis.set_xscale("log")
    axis.xaxis.set_major_formatter(ScalarFormatter())
    axis.xaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel("latency (ms)")
    axis.set_ylabel("share of requests")
    axis.legend(fontsize=8)


def save_figure(figure: Figure, title: str, path: Path) -> None:
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


def build_corpora(work: Path) -> Path:
    """The shipped corpora, built once under the benchmark's work directory."""
    data_dir = work / "data"
    for corpus in corpora.CORPORA:
        build.ensure_corpus(corpus, data_dir)
    return data_dir
