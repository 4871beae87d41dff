"""What the scheduling sensitivity studies share: the trace, the baselines Huorn is measured
against, their command line (cases, output, redraw) and how they write their results.

Each study (`scheduling_elastic_range.py`, `scheduling_restart_cost.py`,
`scheduling_work_estimate.py`) changes one thing of the simulation and re-runs the same cases.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from huorn.sim import policies, shared_data

DATA = shared_data.shared_data_dir()
TRACE = (DATA / "openb_pod_list_default.csv", DATA / "openb_node_list_gpu_node.csv", DATA / "genai_qps.csv")
# Every Pollux form (three objectives, each with and without AdaptDL's admission on arrival): the
# best of them per case is the baseline (report.best_pollux)
POLLUXES = policies.POLLUX_FORMS


def arguments(doc: str, cases: str, output: str) -> argparse.ArgumentParser:
    """--cases gpus:seed:load,..., --output JSON (the PNG goes beside it), --plot-only."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cases", default=cases, help="gpus:seed:load, comma-separated")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/scheduling_sim") / output)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --output's JSON")
    return parser


def case(text: str) -> tuple[int, int, float]:
    gpus, seed, load = text.split(":")
    return int(gpus), int(seed), float(load)


def redraw(args: argparse.Namespace, plot: Callable[[list[dict], Path], None]) -> bool:
    """With --plot-only, draw the PNG from the JSON and say so: the study has nothing to run."""
    if args.plot_only:
        plot(json.loads(args.output.read_text()), args.output.with_suffix(".png"))
    return bool(args.plot_only)


def write(rows: list[dict], output: Path, plot: Callable[[list[dict], Path], None] | None = None) -> None:
    """The rows as JSON, and the study's plot beside them where it has one."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(rows, indent=2))
    if plot is not None:
        plot(rows, output.with_suffix(".png"))
    print(f"wrote {output}")
