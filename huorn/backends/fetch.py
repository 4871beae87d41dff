"""Reading many pods' HTTP endpoints at once.

The operator polls every replica of a job each period (trainers' `/telemetry`, serving replicas'
`/metrics`); one at a time, a job of 64 pods with one slow pod would cost 64 round trips and a
timeout. In a thread pool, it costs one timeout.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def fetch_all(targets: Mapping[str, str], fetch_one: Callable[[str, float], T | None],
              timeout: float) -> dict[str, T]:
    """`fetch_one(url, timeout)` for every target (key → URL) at once; the keys that answered."""
    if not targets:
        return {}
    workers = min(16, len(targets))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="fetch") as pool:
        futures = {key: pool.submit(fetch_one, url, timeout) for key, url in targets.items()}
        out = {key: f.result() for key, f in futures.items()}
    return {key: value for key, value in out.items() if value is not None}
