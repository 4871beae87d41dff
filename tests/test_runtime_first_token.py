"""Time to first token is read when the first token is chosen, not when the answer ends: the
autoscaler's guard on `slo.p99TimeToFirstTokenMs` reads the histogram, and a slow start seen
only at the end of a long answer reached it an answer's length late."""

from __future__ import annotations

import asyncio

import pytest
import runtime_harness as harness

from huorn.runtime import continuous_batching, prefix_cache

pytestmark = pytest.mark.usefixtures("single_thread")


def test_each_row_s_first_token_wait_is_recorded_at_its_first_step_while_it_still_runs() -> None:
    model = harness.serving_decoder("none", 64)

    async def run() -> tuple[list[float], int, list[float]]:
        batch = continuous_batching.RunningBatch(model, prefix_cache.PrefixCache(512), 64, max_rows=4)
        long, short = (continuous_batching.Request(list(b"What is 1 + 2?"), n, 0.0, 0) for n in (30, 2))
        batch.admit([long, short])
        while batch.prefilling:
            batch.prefill(0)
        ended = batch.step()
        first = list(batch.first_token_waits)
        running = len(batch.rows)
        batch.first_token_waits.clear()  # what the server does once it has observed them
        batch.feed()
        while batch.rows:
            ended += batch.step()
            batch.feed()
        assert {id(r) for r, _ in ended} == {id(long), id(short)}
        return first, running, batch.first_token_waits

    first, running, later = asyncio.run(run())
    assert len(first) == 2 and all(wait >= 0 for wait in first)  # both rows' first tokens, at once
    assert running == 2  # neither answer had ended when its wait was recorded
    assert later == []  # one wait per row: later tokens are inter-token gaps, not first tokens
