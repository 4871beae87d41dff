"""Priority preemption: which running gangs a pending one of higher priority may stop to start.

Kueue's `withinClusterQueue: LowerPriority` and Volcano's and KAI's priority preemption give a
platform team the same promise: a job of higher priority does not wait behind work of lower
priority. The rules here are theirs:

- only jobs of strictly lower priority are victims, and never one at `PINNED_PRIORITY` or above
  (the KAI convention the allocator keeps too: those are never preempted);
- candidates are taken lowest priority first and, among equals, the most recently started
  first (it has done the least since its last checkpoint, and it is Kueue's order too), until
  the pending gang fits;
- then every victim that the gang does not need after all is given back, highest priority
  first, so that the set is minimal;
- jobs already stopping (their pods are being deleted) count as gone: a gang that fits once
  they are gone preempts nobody more, it waits;
- elastic victims shrink before anyone is stopped (what Kueue users ask for as partial
  preemption): replicas above a job's minimum are given up one at a time, newest replica first,
  in the same victim order, until the gang fits. Only when shrinking every such job to its
  minimum is not enough are whole gangs stopped instead (and then nobody is shrunk).

Pure: a `ClusterSnapshot` and plain values in, names out; the snapshot is left as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from huorn.scheduler import placement
from huorn.scheduler.allocator import PINNED_PRIORITY
from huorn.scheduler.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class Candidate:
    """A running gang that holds GPUs: its snapshot binding key, priority and start time."""

    job: str
    priority: int
    started: float
    # Replicas it may give up (above its minimum, elastic only), newest first: (replica, node, GPUs)
    surplus: tuple[tuple[str, str, int], ...] = ()


@dataclass(frozen=True)
class Plan:
    """`victims` to stop and `shrinks` (job → replicas to give up); both empty: the gang fits
    once the jobs already stopping are gone."""

    victims: tuple[str, ...]
    shrinks: tuple[tuple[str, tuple[str, ...]], ...] = ()


def is_preemptible(victim_priority: int, preemptor_priority: int) -> bool:
    return victim_priority < preemptor_priority and victim_priority < PINNED_PRIORITY


def _fits(snap: ClusterSnapshot, vc: str, replicas: int, gpus: int, borrow: bool = True,
          node_selector: Mapping[str, str] | None = None) -> bool:
    return isinstance(snap.place(vc, replicas, gpus, node_selector=node_selector, borrow=borrow),
                      placement.Placement)


def plan_preemption(
    snap: ClusterSnapshot, vc: str, replicas: int, gpus_per_replica: int, priority: int,
    candidates: Iterable[Candidate], stopping: Iterable[str] = (), borrow: bool = True,
    node_selector: Mapping[str, str] | None = None,
) -> Plan | None:
    """The fewest victims, by the rules above, after which `replicas × gpus_per_replica` of
    cluster `vc` can be placed (without `borrow`, on its own nodes; with `node_selector`, on the
    nodes that carry its labels); None when no set of eligible victims is enough."""
    bound = set(snap.bindings())
    order = sorted((c for c in candidates if c.job in bound and is_preemptible(c.priority, priority)),
                   key=lambda c: (c.priority, -c.started, c.job))
    with snap.simulate():
        for job in stopping:
            if job in bound:
                snap.forget(job)
        if _fits(snap, vc, replicas, gpus_per_replica, borrow, node_selector):
            return Plan(())
        shrinks = _plan_shrinks(snap, vc, replicas, gpus_per_replica, order, borrow, node_selector)
        if shrinks is not None:
            return Plan((), shrinks)
        taken: list[Candidate] = []
        for c in order:
            snap.forget(c.job)
            taken.append(c)
            if _fits(snap, vc, replicas, gpus_per_replica, borrow, node_selector):
                break
        else:
            return None
    # Give back every victim the gang can do without, the most valuable first.
    needed = list(taken)
    for c in sorted(taken, key=lambda c: (-c.priority, c.started, c.job)):
        trial = [v for v in needed if v is not c]
        with snap.simulate():
            for job in [*stopping, *(v.job for v in trial)]:
                if job in bound:
                    snap.forget(job)
            if _fits(snap, vc, replicas, gpus_per_replica, borrow, node_selector):
                needed = trial
    return Plan(tuple(v.job for v in needed))


def _plan_shrinks(
    snap: ClusterSnapshot, vc: str, replicas: int, gpus_per_replica: int, order: list[Candidate],
    borrow: bool = True, node_selector: Mapping[str, str] | None = None,
) -> tuple[tuple[str, tuple[str, ...]], ...] | None:
    """Surplus replicas given up one at a time, in victim order, until the gang fits; None when
    all of them are not enough. Leaves `snap` as it found it."""
    given: dict[str, list[str]] = {}
    with snap.simulate():
        for c in order:
            for replica, node, gpus in c.surplus:
                binding = snap.forget(c.job)
                left = dict(binding.gpus_by_node)
                left[node] = left.get(node, 0) - gpus
                if left[node] < 0:
                    raise ValueError(f"{c.job}: replica {replica} holds {gpus} GPUs on {node}, "
                                     f"more than the job holds there")
                nodes = [n for n, count in sorted(left.items()) for _ in range(count)]
                if nodes:
                    snap.assume(c.job, binding.virtual_cluster, placement.Placement(nodes), 1)
                given.setdefault(c.job, []).append(replica)
                if _fits(snap, vc, replicas, gpus_per_replica, borrow, node_selector):
                    return tuple((job, tuple(names)) for job, names in given.items())
    return None
