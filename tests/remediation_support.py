"""Run a quickstart-derived job with injected faults under the remediation policy on the local
backend, as the S2 and S3 end-to-end tests both do."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import Remediation
from huorn.backends import monitor
from huorn.backends.local import backend as local_backend
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
    run_dir.mkdir()
    (run_dir / "faults.json").write_text(json.dumps({"faults": faults}))
    backend = local_backend.LocalBackend(g, run_dir, local_backend.LocalSettings(step_limit=steps))
    remediation = policy.RemediationPolicy(Remediation.model_validate(manifest["spec"]["remediation"]),
                                           costs=costs)
    loop = monitor.Monitor(g, backend, [remediation])
    deadline = time.monotonic() + budget_s
    try:
        loop.start()
        result = loop.run(interval=0.5, should_stop=lambda _: time.monotonic() > deadline)
    finally:
        backend.stop(graceful=False)
    actions = (run_dir / "actions.jsonl").read_text()
    return RemediatedRun(g, remediation, run_dir, actions, result.observation.finished)
