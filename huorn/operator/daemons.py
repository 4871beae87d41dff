"""The loop of a per-job kopf daemon: tick, then wait a period, until kopf stops it.

A failing tick is logged and retried next period: a job's monitor or autoscaler must never take
its reconciles down with it, and every tick starts again from the API objects.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any


async def every(period: float, stopped: Any, tick: Callable[[], Awaitable[Any]], what: str,
                logger: logging.Logger) -> None:
    while not stopped:
        try:
            await tick()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("%s failed; next try in %.1fs", what, period)
        await stopped.wait(period)
