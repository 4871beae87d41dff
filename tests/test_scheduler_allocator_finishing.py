"""Jobs about to finish are not torn down to admit others (AllocatorConfig.protect_finishing_restarts)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_scheduler_allocator import build_job, build_snapshot, job_mixes

from huorn.scheduler import allocator, snapshot

PROTECT = allocator.AllocatorConfig(protect_finishing_restarts=5.0)


def full_node_then_arrival(config: allocator.AllocatorConfig, seconds_left: float, new_priority: int = 50,
                           new_min: int = 1) -> dict[str, allocator.Decision]:
    """One 8-GPU node held by a job at 8 replicas that finishes in `seconds_left`; a job arrives."""
    snap = build_snapshot(train_nodes=1)
    alloc = allocator.Allocator(config)
    busy = build_job("busy", max_replicas=8, restart_seconds=60.0)
    busy.remaining_work = seconds_left * float(alloc.table(busy).good[8])  # samples left at 8 replicas
    busy.replicas = 8
    snap.assume("busy", "train", snapshot.placement.Placement(["t0"] * 8), 1)
    new = build_job("new", max_replicas=8, min_replicas=new_min, priority=new_priority, submitted=1.0,
                    remaining_work=1e6)
    return {d.job: d for d in alloc.allocate(snap, [busy, new], 0.0)}


def test_a_job_five_restarts_from_its_end_keeps_its_gpus() -> None:
    # 100 s left against a 60 s restart: shrinking it would cost it more than the arrival gains.
    kept = full_node_then_arrival(PROTECT, seconds_left=100.0)
    assert kept["busy"].action == "keep" and kept["busy"].replicas == 8
    assert kept["new"].action == "pending"
    # Without the protection the minimums pass tears it down for the arrival, as Pollux does.
    torn = full_node_then_arrival(allocator.AllocatorConfig(), seconds_left=100.0)
    assert torn["busy"].action == "shrink" and torn["new"].action == "admit"
    # Hours from its end it is an ordinary running job: the arrival gets its minimum.
    far = full_node_then_arrival(PROTECT, seconds_left=10_000.0)
    assert far["busy"].action == "shrink" and far["new"].action == "admit"


def test_a_higher_priority_arrival_still_gets_its_minimum_first() -> None:
    got = full_node_then_arrival(PROTECT, seconds_left=100.0, new_priority=60, new_min=2)
    assert got["new"].action == "admit" and got["new"].replicas >= 2
    assert got["busy"].action == "shrink" and got["busy"].replicas <= 6


def test_unknown_remaining_work_is_never_protected_and_bad_values_are_refused() -> None:
    snap = build_snapshot(train_nodes=1)
    alloc = allocator.Allocator(PROTECT)
    busy = build_job("busy", max_replicas=8, restart_seconds=60.0)  # remaining_work None
    busy.replicas = 8
    snap.assume("busy", "train", snapshot.placement.Placement(["t0"] * 8), 1)
    got = {d.job: d for d in alloc.allocate(snap, [busy, build_job("new", max_replicas=8)], 0.0)}
    assert got["new"].action == "admit"
    with pytest.raises(ValueError, match="protect_finishing_restarts"):
        allocator.AllocatorConfig(protect_finishing_restarts=-1.0)


@pytest.mark.parametrize("admission", ["minimums", "value"])
@settings(max_examples=60, deadline=None)
@given(job_mixes(), st.lists(st.floats(1.0, 1e7), min_size=8, max_size=8))
def test_invariants_hold_with_the_protection_on(admission: str, case: tuple, remaining: list[float]) -> None:
    """Capacity, limits and min/max replicas over successive cycles, with jobs nearing their end,
    and with pending jobs admitted by value (Huorn's setting) or in the minimums pass."""
    snap, jobs, lend, borrow = case
    alloc = allocator.Allocator(allocator.AllocatorConfig(protect_finishing_restarts=5.0, jct_weight=0.5,
                                                          admission=admission,
                                                          restart_over_remaining=True,
                                                          pending_order="remaining"))
    for job, left in zip(jobs, remaining, strict=False):
        job.remaining_work = left
    for cycle in range(3):
        decisions = {d.job: d for d in alloc.allocate(snap, jobs, float(cycle * 1000))}
        bindings = snap.bindings()
        assert set(decisions) == {j.name for j in jobs}
        for job in jobs:
            d = decisions[job.name]
            if d.replicas:
                assert job.min_replicas <= d.replicas <= job.max_replicas
                assert sum(bindings[job.name].gpus_by_node.values()) == d.replicas * job.gpus_per_replica
            else:
                assert job.name not in bindings
        assert all(n.gpus_free >= 0 for n in snap.node_views())
        assert snap.borrowed("train") <= borrow and snap.lent("infer") <= lend
        per_node = Counter[str]()
        for b in bindings.values():
            per_node.update(b.gpus_by_node)
        assert all(v <= 8 for v in per_node.values())
        for job in jobs:
            job.replicas = decisions[job.name].replicas
            job.last_resize = float(cycle * 1000)
            job.remaining_work = max(1.0, (job.remaining_work or 1.0) / 2)
