"""Where the shared traces (OpenB pod and node lists, the GenAI QPS series) are read from.

They stay outside the repository and are never copied into it, so the simulator, its CLI, the
benchmarks and the tests all look in one place: `HUORN_DATA_DIR` when set, else `../shared/data`
beside the checkout, else `/work/shared/data`, the location on the project's machines, which a
checkout elsewhere (a worktree, a CI clone) still finds.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "HUORN_DATA_DIR"
FALLBACK = Path("/work/shared/data")


def shared_data_dir() -> Path:
    """The directory to read traces from; it may not exist, and callers name the file they miss."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    beside_checkout = Path(__file__).resolve().parents[3] / "shared" / "data"
    return beside_checkout if beside_checkout.is_dir() else FALLBACK
