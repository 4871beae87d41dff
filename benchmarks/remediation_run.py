"""One TrainingJob on the local backend, under the monitor loop and the remediation policy, with
injected faults: what the remediation benchmarks on real jobs (benchmarks/s2_local.py,
s2_pipeline_local.py, s3_local.py) run once per case, so that their baseline, Huorn and healthy
runs differ only in the ladder's cap and the faults."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

import huorn.graph.jobs  # noqa: F401  (registers the TrainingJob compiler)
from huorn.api.common import Remediation
from huorn.backends import monitor
from huorn.backends.local import backend as local_backend
from huorn.backends.local import report
from huorn.graph import compiler
from huorn.graph.model import Graph
from huorn.scheduler.remediation import ladder, policy

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class LocalJob:
    """The job's shape: a small decoder, `replicas` agents (pipeline replicas when pipelined),
    in `pipeline_stages` stages or, with None, data-parallel only."""

    layers: int
    replicas: int
    micro_batch: int
    steps: int = 70
    global_batch: int = 8
    pipeline_stages: int | None = 2
    timeout_s: float = 900.0


@dataclass
class FinishedRun:
    graph: Graph
    remediation: policy.RemediationPolicy
    run_dir: Path
    records: list[dict]
    wall_seconds: float

    def step_seconds(self) -> dict[int, float]:
        return {r["step"]: r["step_seconds"] for r in self.records if r.get("event") == "step"}

    def mutations(self) -> list[str]:
        return [m.reason for m in self.graph.log if m.action == "set-param"]


def run_local_job(name: str, cap: str, faults: list[dict], workdir: Path, job: LocalJob,
                  costs: ladder.LadderCosts) -> FinishedRun:
    """Run `job` to its last step with the ladder capped at `cap` and `faults` injected."""
    manifest = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    spec = manifest["spec"]
    spec["elasticity"].update(minReplicas=job.replicas, maxReplicas=job.replicas, policy="fixed")
    spec["model"].update(layers=job.layers, width=32, heads=2, context=32)
    spec["optimization"].update(globalBatch=job.global_batch, microBatch=job.micro_batch, steps=job.steps)
    spec["checkpoint"] = {"path": "./checkpoints", "intervalSteps": 100}
    if job.pipeline_stages is not None:
        spec["parallelism"] = {"pipelineStages": job.pipeline_stages, "schedule": "1f1b"}
    spec["remediation"] = {"hangTimeout": "60s", "maxMitigation": cap}
    graph = compiler.compile(manifest)
    run_dir = workdir / name
    run_dir.mkdir(parents=True)
    (run_dir / "faults.json").write_text(json.dumps({"faults": faults}))
    backend = local_backend.LocalBackend(graph, run_dir, local_backend.LocalSettings(step_limit=job.steps))
    remediation = policy.RemediationPolicy(Remediation.model_validate(spec["remediation"]), costs=costs)
    loop = monitor.Monitor(graph, backend, [remediation])
    started = time.monotonic()
    try:
        loop.start()
        loop.run(interval=0.5, should_stop=lambda _: time.monotonic() - started > job.timeout_s)
    finally:
        backend.stop(graceful=False)
    return FinishedRun(graph, remediation, run_dir, report.read_records(run_dir), time.monotonic() - started)
