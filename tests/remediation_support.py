"""Run a quickstart-derived job with injected faults under the remediation policy on the local
backend, as the S2 and S3 end-to-end tests both do."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import job_support

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import Remediation
from huorn.graph import compiler, model
from huorn.scheduler.remediation import ladder, policy


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
