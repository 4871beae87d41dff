"""The local end-to-end tests' shared parts: a small variant of examples/quickstart.yaml (they
differ only in replicas, layers, micro-batch, steps and extra spec sections), and one run of its
graph on the local backend under the monitor's policies."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from huorn.backends import monitor
from huorn.backends.local import backend as local_backend

QUICKSTART = Path(__file__).resolve().parents[1] / "examples" / "quickstart.yaml"


def tiny_job(*, replicas: int, steps: int, micro_batch: int, layers: int = 2, interval: int = 50,
             **sections: Any) -> dict[str, Any]:
    """The quickstart job with a tiny model, a fixed gang of `replicas`, global batch 8, and each
    keyword in `sections` set as a whole spec section (remediation=..., parallelism=...)."""
    manifest = yaml.safe_load(QUICKSTART.read_text())
    spec = manifest["spec"]
    spec["elasticity"].update(minReplicas=replicas, maxReplicas=replicas, policy="fixed")
    spec["model"].update(layers=layers, width=32, heads=2, context=32)
    spec["optimization"].update(globalBatch=8, microBatch=micro_batch, steps=steps)
    spec["checkpoint"] = {"path": "./checkpoints", "intervalSteps": interval}
    spec.update(sections)
    return manifest


def run_local(graph: Any, run_dir: Path, faults: list[dict[str, Any]], policies: list[Any], steps: int,
              budget_s: float, interval: float = 0.5) -> Any:
    """The job's graph on the local backend with `faults` injected, under `policies`, until it
    finishes or `budget_s` runs out; every process is gone afterwards. Returns the last tick."""
    run_dir.mkdir()
    (run_dir / "faults.json").write_text(json.dumps({"faults": faults}))
    backend = local_backend.LocalBackend(graph, run_dir, local_backend.LocalSettings(step_limit=steps))
    loop = monitor.Monitor(graph, backend, policies)
    deadline = time.monotonic() + budget_s
    try:
        loop.start()
        return loop.run(interval=interval, should_stop=lambda _: time.monotonic() > deadline)
    finally:
        backend.stop(graceful=False)
