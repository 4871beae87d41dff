"""What the scheduling sensitivity studies share: the trace, the baselines Huorn is measured
against, their command line (cases, output, redraw) and how they write their results.

Each study (`scheduling_elastic_range.py`, `scheduling_restart_cost.py`,
`scheduling_work_estimate.py`) changes one thing of the simulation and re-runs the same cases.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from rich.progress import track

from huorn.scheduler import allocator
from huorn.sim import engine, policies, report, run, shared_data

DATA = shared_data.shared_data_dir()
TRACE = (DATA / "openb_pod_list_default.csv", DATA / "openb_node_list_gpu_node.csv", DATA / "genai_qps.csv")
# Every Pollux form (three objectives, each with and without AdaptDL's admission on arrival): the
# best of them per case is the baseline (report.best_pollux)
POLLUXES = policies.POLLUX_FORMS


def huorn_variant(label: str) -> str:
    """The simulator policy name of Huorn run with one of a study's allocators."""
    return f"huorn[{label}]"


def register_huorn_variants(allocators: Mapping[str, allocator.AllocatorConfig]) -> None:
    """Each allocator as a simulator policy, Huorn's spec with that allocator, named by
    `huorn_variant`. Called when a study's module is imported, so every worker process has them."""
    for label, config in allocators.items():
        name = huorn_variant(label)
        policies.POLICIES[name] = dataclasses.replace(policies.POLICIES["huorn"], name=name, allocator=config)


def huorn_variants_against_best_pollux(task: tuple[int, int, float, str], labels: Iterable[str]) -> dict:
    """One seed of a study (`run_seeds`' task): every Pollux form, and Huorn with each of the
    study's allocators (registered by `register_huorn_variants`), each against the best Pollux."""
    seed, gpus, load, qps_start = task
    config = engine.SimConfig(gpus=gpus, seed=seed, load=load, qps_start=qps_start)
    labels = list(labels)
    results, _ = run.run_policies(*TRACE, [*POLLUXES, *(huorn_variant(label) for label in labels)], config)
    best = report.best_pollux(results)
    baseline = results[best]["jct_mean_s"]
    variants = {label: results[huorn_variant(label)] for label in labels}
    return {"seed": seed, "best_pollux": best, "best_pollux_jct_mean_s": baseline,
            "huorn": {label: {"jct_mean_s": r["jct_mean_s"],
                              "jct_reduction_vs_best_pollux": 1 - r["jct_mean_s"] / baseline,
                              "restarts": r["restarts"], "slo": r["inference_slo_attainment"]}
                      for label, r in variants.items()}}


def arguments(doc: str, cases: str, output: str) -> argparse.ArgumentParser:
    """--cases gpus:seed:load,..., --output JSON (the PNG goes beside it), --plot-only."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--cases", default=cases, help="gpus:seed:load, comma-separated")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/scheduling_sim") / output)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from --output's JSON")
    return parser


def seed_list(text: str) -> list[int]:
    """Seeds as ranges and single ones, "0-9,12,20-29"; "none" is no seed (a run of only the
    other seed set)."""
    found: list[int] = []
    for part in filter(None, text.replace("none", "").split(",")):
        first, _, last = part.partition("-")
        found += range(int(first), int(last or first) + 1)
    return found


def seed_study_arguments(doc: str, seeds: str, output: str) -> argparse.ArgumentParser:
    """The options of a study over many seeds of one case (the settings and borrowing studies)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--seeds", default=seeds, help=f"ranges and seeds: {seeds}, or 0,3,20-29")
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--qps-start", default="middle", choices=("middle", "beginning"))
    parser.add_argument("--workers", type=int, default=2, help="seeds run at once, one process each")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/scheduling_sim") / output)
    return parser


def run_seeds(one: Callable[[tuple[int, int, float, str]], dict], args: argparse.Namespace,
              seeds: list[int]) -> list[dict]:
    """`one((seed, gpus, load, qps_start))` for every seed, `args.workers` at a time, in order."""
    tasks = [(seed, args.gpus, args.load, args.qps_start) for seed in seeds]
    with ProcessPoolExecutor(args.workers) as pool:
        try:
            return list(track(pool.map(one, tasks), total=len(tasks), description="seeds"))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)  # the first failure ends the study
            raise


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
