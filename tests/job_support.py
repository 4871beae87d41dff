"""A small variant of examples/quickstart.yaml for the local end-to-end tests: they differ only in
replicas, layers, micro-batch, steps and the extra spec sections they set."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

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
