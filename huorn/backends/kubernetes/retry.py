"""Retries with capped exponential backoff for API calls that a busy server refuses for now.

A real API server answers 429 under priority-and-fairness load, 5xx while an etcd leader moves,
and 409 when an optimistic write lost a race. None of these means the write was wrong, so each
is retried with full jitter (the AWS "full jitter" scheme keeps a thousand reconciles from
retrying in lockstep). Anything else (400, 403, 404, 422) is the caller's to handle: retrying a
refused spec only delays the error the user needs to see. The sleeps are asyncio sleeps so that
tests run them in fake time (looptime).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import kubernetes
import urllib3

T = TypeVar("T")

RETRIABLE = frozenset({429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 8
    base_delay: float = 0.1
    max_delay: float = 5.0
    retry_conflicts: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be ≥ 1, got {self.attempts}")
        if not 0 < self.base_delay <= self.max_delay:
            raise ValueError("RetryPolicy needs 0 < base_delay ≤ max_delay")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, base·2^attempt)]."""
        return rng.uniform(0, min(self.max_delay, self.base_delay * 2**attempt))


def is_retriable(exc: BaseException, policy: RetryPolicy) -> bool:
    if isinstance(exc, kubernetes.client.ApiException):
        if exc.status == 409:
            return policy.retry_conflicts
        return exc.status in RETRIABLE or exc.status == 0
    # Connection resets and timeouts: the server was slow or restarting. The kubernetes client lets
    # urllib3's own errors through (MaxRetryError, ProtocolError, ReadTimeoutError), which are no
    # OSError.
    return isinstance(exc, OSError | TimeoutError | urllib3.exceptions.HTTPError)


def retry_after(exc: BaseException) -> float | None:
    """The server's Retry-After hint (seconds), which a 429 from API priority-and-fairness carries."""
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


async def call_with_retry(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    rng: random.Random | None = None,
    on_retry: Callable[[BaseException, int], None] | None = None,
) -> T:
    """Await `call()` until it succeeds, a non-retriable error occurs, or attempts run out."""
    rng = rng or random.Random()
    for attempt in range(policy.attempts):
        try:
            return await call()
        except Exception as exc:
            if attempt + 1 >= policy.attempts or not is_retriable(exc, policy):
                raise
            if on_retry is not None:
                on_retry(exc, attempt)
            hint = retry_after(exc)
            delay = policy.delay(attempt, rng)
            await asyncio.sleep(min(policy.max_delay, hint) if hint is not None else delay)
    raise AssertionError("unreachable: the loop returns or raises")  # pragma: no cover
