"""Run a quickstart-derived job with injected faults under the remediation policy on the local
backend, as the S2 and S3 end-to-end tests both do."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import job_support
import yaml

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import MitigationLevel, Remediation
from huorn.graph import compiler, model
from huorn.scheduler.remediation import failslow, ladder, policy

SLOW = failslow.SlowFinding("trainer-1", "compute", 40, 50, 7.0)
GRAPH = compiler.compile(yaml.safe_load(job_support.QUICKSTART.read_text()))  # for policy-level tests
LADDER_COSTS = ladder.LadderCosts(rebalance=1.0, resplit=2.0, restart=1000.0)


def climb_to_s2(times: list[float], noise: float = 0.0) -> ladder.MitigationLadder:
    """A ladder on S2 for ranks of `times` seconds per micro-batch (8 in all), rank 1 found slow."""
    shape = ladder.JobShape(microbatch_seconds=times, total_microbatches=8, noise=noise)
    lad = ladder.MitigationLadder(MitigationLevel.RESTART, LADDER_COSTS, shape)
    lad.on_fail_slow(SLOW, [1])
    decision = None
    while decision is None:
        decision = lad.on_step(2.0, 1.0)
    assert decision.level is MitigationLevel.REBALANCE
    return lad


@dataclass
class RemediatedRun:
    graph: model.Graph
    remediation: policy.RemediationPolicy
    run_dir: Path
    actions: str
    finished: bool


def run_with_faults(manifest: dict[str, Any], faults: list[dict[str, Any]], costs: ladder.LadderCosts,
                    run_dir: Path, steps: int, budget_s: float = 500) -> RemediatedRun:
    g = compiler.compile(manifest)
    remediation = policy.RemediationPolicy(Remediation.model_validate(manifest["spec"]["remediation"]),
                                           costs=costs)
    result = job_support.run_local(g, run_dir, faults, [remediation], steps, budget_s)
    actions = (run_dir / "actions.jsonl").read_text()
    return RemediatedRun(g, remediation, run_dir, actions, result.observation.finished)


@dataclass
class Seen:
    """What a backend's Observation carries that the monitor policies read (time, each replica's
    /telemetry, new step records), for driving a policy without a backend."""

    time: float = 0.0
    telemetry: dict[str, dict[str, Any]] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)


def noisy_gang(last: int, counts: list[int], speeds: list[float], jitter: float, seed: int) -> dict:
    """Two ranks' /telemetry after `last` steps: each step's compute is its counts × seconds per
    micro-batch, times a log-normal jitter drawn from (seed, rank, step), so every tick sees
    the same past."""
    snaps = {}
    for rank, (count, speed) in enumerate(zip(counts, speeds, strict=True)):
        steps = []
        for step in range(max(0, last - 255), last + 1):
            noise = random.Random(f"{seed}-{rank}-{step}").lognormvariate(0.0, jitter)
            compute = count * speed * noise
            steps.append({"step": step, "step_seconds": 0.5 * noise, "compute_seconds": compute,
                          "comm_seconds": 0.0})
        snaps[f"trainer-{rank}"] = {
            "rank": rank, "world_size": 2, "replica": f"trainer-{rank}", "heartbeat": 0.0,
            "collective": {"entered": last, "completed": last, "in_flight": []},
            "parameters": {"micro_batches": {"total": 8, "mine": count}}, "steps": steps}
    return snaps
