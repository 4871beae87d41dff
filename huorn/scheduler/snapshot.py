"""ClusterSnapshot: the state one scheduling decision runs against, Kueue style.

A decision (admit this gang, grow that one, shrink a third to make room) is tried on the snapshot,
judged, and either kept or undone; the real cluster is touched only after the whole cycle has
decided. An undo log instead of copies keeps a try-and-undo at O(nodes touched), which is what
lets the allocator and the simulator try thousands of candidate allocations per cycle.

Lending is accounted per GPU: a replica of a job of virtual cluster A placed on a node of B adds
its GPUs to A's `borrowed` and to B's `lent`, and both are held to the limits of the VirtualCluster
spec (maxGPUsBorrowed, maxGPUsLent). A job of a cluster the snapshot does not hold (its
VirtualCluster was deleted while its pods run) borrows for no one, but B has lent those GPUs all
the same: they count in B's `lent`, against B's maxGPUsLent, until the pods are gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from huorn.scheduler import placement


@dataclass(frozen=True)
class VirtualClusterView:
    """The parts of a VirtualCluster's spec that scheduling decisions obey."""

    name: str
    purpose: str = "training"  # "training" or "inference"
    lendable: bool = False
    max_gpus_lent: int = 0
    max_gpus_borrowed: int = 0
    reclaim_grace_seconds: float = 30.0
    # GPUs the cluster's own workloads need now beyond what they hold (an inference cluster's
    # demand): never lent, so a borrower is not placed on GPUs that reclaim would take back at once
    reserved_gpus: int = 0


@dataclass(frozen=True)
class Binding:
    """A job's GPUs on the snapshot: where they are and whose they are."""

    job: str
    virtual_cluster: str
    gpus_by_node: Mapping[str, int]
    cpu_by_node: Mapping[str, int]


class ClusterSnapshot:
    def __init__(self, nodes: list[placement.NodeView], virtual_clusters: list[VirtualClusterView]):
        self._nodes = {n.name: n for n in nodes}
        if len(self._nodes) != len(nodes):
            raise ValueError("nodes: two nodes share a name; node names must be unique")
        self._vcs = {v.name: v for v in virtual_clusters}
        for n in nodes:
            if n.virtual_cluster and n.virtual_cluster not in self._vcs:
                raise ValueError(
                    f"node {n.name}: virtual_cluster {n.virtual_cluster!r} is not among the "
                    f"virtual clusters given ({sorted(self._vcs)}); add it or clear the field"
                )
        self._views = {n.name: n for n in nodes}  # current NodeViews, rebuilt only where touched
        self._stale: set[str] = set()  # nodes whose view is rebuilt when next read
        self._free = {n.name: n.gpus_free for n in nodes}
        self._cpu = {n.name: n.cpu_free_milli for n in nodes}
        self._lent = dict.fromkeys(self._vcs, 0)
        self._borrowed = dict.fromkeys(self._vcs, 0)
        self._bindings: dict[str, Binding] = {}
        self._undo: list[tuple[str, Binding]] = []

    # ----------------------------------------------------------------- reading
    def node_views(self) -> list[placement.NodeView]:
        # Views are rebuilt on read, not on every assume/forget: a cycle lifts every running job
        # off and back on (budgets, trial placements) far more often than it places a gang.
        for node in self._stale:
            self._views[node] = dataclasses.replace(
                self._nodes[node], gpus_free=self._free[node], cpu_free_milli=self._cpu[node])
        self._stale.clear()
        return list(self._views.values())

    def virtual_cluster(self, name: str) -> VirtualClusterView:
        return self._vcs[name]

    def set_virtual_cluster(self, view: VirtualClusterView) -> None:
        """Replace a cluster's limits (the loaning board lowers maxGPUsLent as load rises)."""
        if view.name not in self._vcs:
            raise ValueError(f"virtual_cluster {view.name!r} is unknown; known: {sorted(self._vcs)}")
        self._vcs[view.name] = view

    def virtual_clusters(self) -> list[VirtualClusterView]:
        return list(self._vcs.values())

    def bindings(self) -> dict[str, Binding]:
        return dict(self._bindings)

    def capacity(self, vc: str) -> int:
        """GPUs on the member nodes of `vc` that take new pods (not cordoned, Ready, untainted)."""
        return sum(n.gpus_total for n in self._nodes.values() if n.virtual_cluster == vc and not n.cordoned)

    def free(self, vc: str | None = None) -> int:
        return sum(
            self._free[n.name] for n in self._nodes.values()
            if (vc is None or n.virtual_cluster == vc) and not n.cordoned
        )

    def lent(self, vc: str) -> int:
        return self._lent[vc]

    def borrowed(self, vc: str) -> int:
        return self._borrowed[vc]

    def lend_left(self, vc: str) -> int:
        view = self._vcs[vc]
        if not view.lendable:
            return 0
        left = view.max_gpus_lent - self._lent[vc]
        if view.reserved_gpus:
            left = min(left, self.free(vc) - view.reserved_gpus)
        return max(0, left)

    def borrow_left(self, vc: str) -> int:
        return max(0, self._vcs[vc].max_gpus_borrowed - self._borrowed[vc])

    def foreign_gpus(self, vc: str, gpus_by_node: Mapping[str, int]) -> dict[str, int]:
        """The GPUs of `gpus_by_node` that other virtual clusters own, by owner: what `vc` borrows."""
        foreign: dict[str, int] = {}
        for node, gpus in gpus_by_node.items():
            owner = self._nodes[node].virtual_cluster
            if vc and owner and owner != vc:
                foreign[owner] = foreign.get(owner, 0) + gpus
        return foreign

    def limits_allow(self, vc: str, gpus_by_node: Mapping[str, int]) -> bool:
        """Whether `vc` may take these GPUs now within every lending and borrowing limit.

        `place` keeps the limits by construction; a caller that puts a job back on GPUs it held
        before (a running job that keeps its size) must ask, because other gangs may have taken
        the lenders' room since the job's GPUs were lifted off.
        """
        foreign = self.foreign_gpus(vc, gpus_by_node)
        if not foreign:
            return True
        return (sum(foreign.values()) <= self.borrow_left(vc)
                and all(gpus <= self.lend_left(owner) for owner, gpus in foreign.items()))

    # ----------------------------------------------------------------- deciding
    def place(
        self, vc: str, replicas: int, gpus_per_replica: int, cpu_milli_per_replica: int = 0,
        node_selector: Mapping[str, str] | None = None, single_node: bool = False, borrow: bool = True,
    ) -> placement.Placement | placement.Unplaceable:
        """Where a gang of `vc` would go now, within every lending and borrowing limit; without
        `borrow`, on `vc`'s own nodes only (an RLJob's Ray cluster borrows nothing)."""
        if vc and vc not in self._vcs:
            raise ValueError(f"virtual_cluster {vc!r} is unknown; known: {sorted(self._vcs)}")
        found = placement.place_gang(
            self.node_views(), replicas, gpus_per_replica, cpu_milli_per_replica,
            virtual_cluster=vc, node_selector=node_selector,
            borrow_limit=self.borrow_left(vc) if vc and borrow else 0,
            lend_limits={name: self.lend_left(name) for name in self._vcs if name != vc},
            single_node=single_node,
        )
        if isinstance(found, placement.Unplaceable) and vc and self._lent[vc]:
            # "0 free" on a cluster of 8 GPUs, with no word that they were lent out, sent users
            # looking for what else held them
            return placement.Unplaceable(f"{found.reason}; {self._lent[vc]} of its own GPUs are lent to "
                                         "other virtual clusters (a lender reclaims them for its jobs)")
        return found

    def place_at(self, vc: str, nodes: list[str], gpus_per_replica: int
                 ) -> placement.Placement | placement.Unplaceable:
        """Replicas of `vc` on these nodes (one per entry), if the GPUs are free there now and
        every lending and borrowing limit allows them: where a decision taken on an earlier
        snapshot said they should go (the cluster may have moved since)."""
        where = placement.Placement(list(nodes))
        need = where.gpus_by_node(gpus_per_replica)
        for node, gpus in sorted(need.items()):
            if node not in self._nodes:
                return placement.Unplaceable(f"node {node} is gone")
            view = self._nodes[node]
            # a node another cluster keeps for its own waiting jobs lends none of those GPUs
            free = self._free[node] - (view.kept if view.virtual_cluster not in ("", vc) else 0)
            if view.cordoned or free < gpus:
                why = f" ({view.unavailable or 'cordoned'})" if view.cordoned else ""
                return placement.Unplaceable(f"node {node}: {gpus} GPUs wanted, {max(0, free)} free{why}")
        if not self.limits_allow(vc, need):
            return placement.Unplaceable(f"the lending or borrowing limits no longer allow {need}")
        return where

    def assume(
        self, job: str, vc: str, where: placement.Placement, gpus_per_replica: int,
        cpu_milli_per_replica: int = 0,
    ) -> Binding:
        """Take the GPUs of `where` for `job`; raises if the job is already bound or they are gone.
        `vc` need not be among the snapshot's clusters: pods of a deleted VirtualCluster run on,
        and what they hold on other clusters' nodes stays lent (module docstring)."""
        if job in self._bindings:
            raise ValueError(f"job {job!r} is already bound; forget it before binding it again")
        cpu: dict[str, int] = {}
        for node in where.assignments:
            cpu[node] = cpu.get(node, 0) + cpu_milli_per_replica
        binding = Binding(job, vc, where.gpus_by_node(gpus_per_replica), cpu)
        for node, gpus in binding.gpus_by_node.items():
            if node not in self._nodes:
                raise ValueError(f"placement names node {node!r}, which the snapshot does not hold")
            if self._free[node] < gpus:
                raise ValueError(f"node {node}: {gpus} GPUs asked, {self._free[node]} free")
        self._apply(binding, sign=-1)
        self._bindings[job] = binding
        self._undo.append(("assume", binding))
        return binding

    def forget(self, job: str) -> Binding:
        """Give back every GPU of `job` (it finished, shrank to zero or was preempted)."""
        binding = self._bindings.pop(job)
        self._apply(binding, sign=+1)
        self._undo.append(("forget", binding))
        return binding

    @contextlib.contextmanager
    def simulate(self) -> Iterator[ClusterSnapshot]:
        """Try changes inside the block; every one of them is undone on exit."""
        mark = len(self._undo)
        try:
            yield self
        finally:
            self._rollback(mark)

    def _rollback(self, mark: int) -> None:
        while len(self._undo) > mark:
            op, binding = self._undo.pop()
            if op == "assume":
                del self._bindings[binding.job]
                self._apply(binding, sign=+1)
            else:
                self._bindings[binding.job] = binding
                self._apply(binding, sign=-1)

    def commit(self) -> None:
        """Drop the undo log: what was assumed so far stays, and memory stays bounded."""
        self._undo.clear()

    def _apply(self, binding: Binding, sign: int) -> None:
        for node, gpus in binding.gpus_by_node.items():
            self._free[node] += sign * gpus
            cpu = self._cpu[node]
            if cpu is not None:
                self._cpu[node] = cpu + sign * binding.cpu_by_node.get(node, 0)
            self._stale.add(node)
            owner = self._nodes[node].virtual_cluster
            vc = binding.virtual_cluster
            if owner and vc and owner != vc:
                self._lent[owner] -= sign * gpus
                if vc in self._borrowed:  # a deleted borrower has no budget left to charge
                    self._borrowed[vc] -= sign * gpus
