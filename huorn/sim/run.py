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
    infer_gpus = max(8, round(config.gpus * config.inference_share))
    train_gpus = config.gpus - infer_gpus
    jobs = workload.load_jobs(trace, config.gpus, train_gpus, config.load, config.seed,
                              config.elastic_range, config.restart_cost, config.work_estimate_error,
                              config.undeclared_share)
    spec = policies.POLICIES[policy]
    load = inference.InferenceLoad(qps, infer_gpus, config.seed, config.qps_start, board=spec.board)
    return engine.Simulation(jobs, nodes, load, spec, config)


def run_policies(
    trace: Path, nodes_csv: Path, qps: Path, names: list[str], config: engine.SimConfig,
    progress: Callable[[str, float], None] | None = None,
) -> tuple[dict[str, dict], dict[str, engine.Simulation]]:
    results: dict[str, dict] = {}
    sims: dict[str, engine.Simulation] = {}
    for name in names:
        sim = build_simulation(trace, nodes_csv, qps, name, config)
        start = time.perf_counter()
        sim.run(None if progress is None else (lambda f, name=name: progress(name, f)))
        results[name] = report.summarise(sim, time.perf_counter() - start)
        sims[name] = sim
    return results, sims
