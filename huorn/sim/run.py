"""Run policies on one scaled trace: the entry point of `huorn simulate` and the benchmark."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from huorn.sim import engine, inference, policies, report, workload


def build_simulation(trace: Path, nodes_csv: Path, qps: Path, policy: str, config: engine.SimConfig
                     ) -> engine.Simulation:
    if policy not in policies.POLICIES:
        raise ValueError(f"policy {policy!r} is unknown; use one of {sorted(policies.POLICIES)} or all")
    nodes = workload.load_nodes(nodes_csv, config.gpus, config.seed)
    split = engine.split_cluster(nodes, config)  # both loads sized for the GPUs each cluster holds
    jobs = workload.load_jobs(trace, config.gpus, split.train_gpus, config.load, config.seed,
                              config.elastic_range, config.restart_cost, config.work_estimate_error,
                              config.undeclared_share)
    spec = policies.POLICIES[policy]
    load = inference.InferenceLoad(qps, split.infer_gpus, config.seed, config.qps_start, board=spec.board)
    return engine.Simulation(jobs, nodes, load, spec, config)


def split_cluster(nodes_csv: Path, config: engine.SimConfig) -> engine.Split:
    """The inference/training split build_simulation will use: read the node list, pick the
    inference nodes. A caller checks the node list and the training load against it before
    building (huorn simulate)."""
    return engine.split_cluster(workload.load_nodes(nodes_csv, config.gpus, config.seed), config)


def build_simulations(trace: Path, nodes_csv: Path, qps: Path, names: list[str], config: engine.SimConfig
                      ) -> dict[str, engine.Simulation]:
    """Every policy's simulation, built before any runs: a bad input (a column missing from the
    trace, too few request-rate bins) is refused before a progress bar is drawn or a policy has
    spent its minutes."""
    return {name: build_simulation(trace, nodes_csv, qps, name, config) for name in names}


def run_simulations(sims: dict[str, engine.Simulation],
                    progress: Callable[[str, float], None] | None = None) -> dict[str, dict]:
    """Run the built simulations one after the other; each policy's summary, by name."""
    results: dict[str, dict] = {}
    for name, sim in sims.items():
        start = time.perf_counter()
        sim.run(None if progress is None else (lambda f, name=name: progress(name, f)))
        results[name] = report.summarise(sim, time.perf_counter() - start)
    return results


def run_policies(
    trace: Path, nodes_csv: Path, qps: Path, names: list[str], config: engine.SimConfig,
    progress: Callable[[str, float], None] | None = None,
) -> tuple[dict[str, dict], dict[str, engine.Simulation]]:
    sims = build_simulations(trace, nodes_csv, qps, names, config)
    return run_simulations(sims, progress), sims
