"""Admission by value (AllocatorConfig.admission="value"): a pending job's first GPUs compete with extras."""

from __future__ import annotations

import pytest
from test_scheduler_allocator import build_job, build_snapshot

from huorn.scheduler import allocator, snapshot


def busy_node_then_arrival(admission: str, arrival_seconds: float, priority: int = 50
                           ) -> dict[str, allocator.Decision]:
    """A job at 8 replicas on the only node, an hour from its end; a job arrives needing `arrival_seconds`."""
    config = allocator.AllocatorConfig(admission=admission, jct_weight=0.5, horizon_seconds=3600.0,
                                       restart_over_remaining=True)
    snap = build_snapshot(train_nodes=1)
    alloc = allocator.Allocator(config)
    busy = build_job("busy", max_replicas=8, restart_seconds=60.0)
    good = alloc.table(busy).good
    busy.remaining_work = 3600.0 * float(good[8])
    busy.replicas = 8
    snap.assume("busy", "train", snapshot.placement.Placement(["t0"] * 8), 1)
    new = build_job("new", max_replicas=8, priority=priority, submitted=1.0,
                    remaining_work=arrival_seconds * float(good[1]))  # same curve: seconds at 1 replica
    return {d.job: d for d in alloc.allocate(snap, [busy, new], 0.0)}


def test_a_long_arrival_waits_while_the_running_job_gains_more_from_the_gpu() -> None:
    # 200 h at one replica: its first GPU is worth far less (weight (1 h / 200 h)^0.5) than the
    # running job's eighth replica plus the restart a shrink would cost it.
    by_value = busy_node_then_arrival("value", 200 * 3600.0)
    assert by_value["busy"].action == "keep" and by_value["busy"].replicas == 8
    assert by_value["new"].action == "pending"
    # Pollux's rule admits it regardless, tearing the running job down by a replica.
    first = busy_node_then_arrival("minimums", 200 * 3600.0)
    assert first["new"].action == "admit" and first["busy"].action == "shrink"


def test_a_short_arrival_is_admitted_by_value() -> None:
    got = busy_node_then_arrival("value", 120.0)  # two minutes of work
    assert got["new"].action == "admit" and got["new"].replicas >= 1
    assert got["busy"].action == "shrink"


def test_a_higher_priority_arrival_still_gets_its_minimum_first() -> None:
    got = busy_node_then_arrival("value", 200 * 3600.0, priority=60)
    assert got["new"].action == "admit" and got["busy"].action == "shrink"


def test_bad_admission_is_refused() -> None:
    with pytest.raises(ValueError, match="admission"):
        allocator.AllocatorConfig(admission="lottery")
