"""C4P traffic planning: order ring ranks and pin their paths so collective flows share no uplink.

Training traffic is a handful of long-lived, elephant flows (ring all-reduce hops, one per
channel), so ECMP's per-flow hashing, which balances many small flows well, puts two of them on
one leaf→spine uplink often enough to halve a job's bandwidth. C4 plans those few flows instead:
1. order the ring so that nodes under one leaf are adjacent: a ring then leaves and enters each
   leaf once per channel instead of at almost every hop;
2. pin every cross-leaf hop to a spine, least-loaded first, instead of hashing it.
The topology comes from node labels (node → leaf switch, every leaf wired to every spine: a
two-tier Clos). The flow-level model counts long-lived flows per directed link; with equal
flows, the busiest link's count is the slowdown of the slowest hop.
"""

from __future__ import annotations

import collections
import dataclasses
import zlib
from collections.abc import Mapping, Sequence

LEAF_LABEL = "topology.huorn.io/leaf"
SPINE_LABEL = "topology.huorn.io/spine"

Link = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class Topology:
    leaf_of: dict[str, str]
    spines: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Flow:
    src: str
    dst: str
    channel: int


@dataclasses.dataclass(frozen=True)
class RingPlan:
    order: tuple[str, ...]
    paths: dict[Flow, tuple[Link, ...]]
    max_link_load: int  # flows on the busiest leaf↔spine link (access links carry one per channel anyway)


def build_topology(
    node_labels: Mapping[str, Mapping[str, str]],
    leaf_label: str = LEAF_LABEL,
    spine_label: str = SPINE_LABEL,
) -> Topology:
    """Read node → leaf from labels; the spines are the distinct values of the spine label.

    A node's spine label lists the spines its leaf is wired to (comma-separated); in a Clos
    every leaf has the same list, so the union is the spine layer.
    """
    leaf_of: dict[str, str] = {}
    spines: set[str] = set()
    for node, labels in node_labels.items():
        if leaf_label not in labels:
            raise ValueError(
                f"node {node!r} has no label {leaf_label!r}: label every node with its leaf switch"
            )
        leaf_of[node] = labels[leaf_label]
        spines.update(s for s in labels.get(spine_label, "").split(",") if s)
    if not spines:
        raise ValueError(
            f"no node carries {spine_label!r}: label nodes with their spines, e.g. 'spine-0,spine-1'"
        )
    return Topology(leaf_of, tuple(sorted(spines)))


def ring_flows(order: Sequence[str], channels: int = 1) -> list[Flow]:
    """The hops of `channels` concurrent rings over `order` (NCCL-style channels)."""
    if len(order) < 2:
        return []
    n = len(order)
    return [Flow(order[i], order[(i + 1) % n], c) for c in range(channels) for i in range(n)]


def _path(topo: Topology, flow: Flow, spine: str | None) -> tuple[Link, ...]:
    a, b = topo.leaf_of[flow.src], topo.leaf_of[flow.dst]
    if flow.src == flow.dst:
        return ()
    if a == b:
        return ((flow.src, a), (a, flow.dst))
    assert spine is not None
    return ((flow.src, a), (a, spine), (spine, b), (b, flow.dst))


def _ecmp_spine(topo: Topology, flow: Flow) -> str:
    """What a switch does: a hash of the flow's identity picks the uplink."""
    key = f"{flow.src}|{flow.dst}|{flow.channel}".encode()
    return topo.spines[zlib.crc32(key) % len(topo.spines)]


def count_link_loads(paths: Mapping[Flow, Sequence[Link]]) -> collections.Counter[Link]:
    return collections.Counter(link for path in paths.values() for link in path)


def max_uplink_load(topo: Topology, loads: Mapping[Link, int]) -> int:
    """The busiest leaf↔spine link: the shared links that planning can relieve. A node's access
    link carries one flow per channel in any order, so it is not counted."""
    spines = set(topo.spines)
    return max((n for (a, b), n in loads.items() if a in spines or b in spines), default=0)


def route_ecmp(topo: Topology, order: Sequence[str], channels: int = 1) -> RingPlan:
    """The default: rings in the given rank order, paths hashed by ECMP."""
    paths = {f: _path(topo, f, _ecmp_spine(topo, f)) for f in ring_flows(order, channels)}
    return RingPlan(tuple(order), paths, max_uplink_load(topo, count_link_loads(paths)))


def order_by_leaf(topo: Topology, nodes: Sequence[str]) -> list[str]:
    """Nodes grouped by leaf (leaves in first-seen order), so each ring crosses a leaf boundary
    once per leaf instead of at almost every hop."""
    leaves: dict[str, list[str]] = {}
    for node in nodes:
        if node not in topo.leaf_of:
            raise ValueError(f"node {node!r} is not in the topology: it has no leaf label")
        leaves.setdefault(topo.leaf_of[node], []).append(node)
    return [n for group in leaves.values() for n in group]


def plan_rings(topo: Topology, nodes: Sequence[str], channels: int = 1,
               background: Mapping[Link, int] | None = None) -> RingPlan:
    """C4P: leaf-grouped ring order, each cross-leaf hop pinned to the least-loaded spine.

    `background` carries the flows of jobs planned earlier, so that jobs sharing the fabric are
    planned against one another rather than each against an empty network.
    """
    order = order_by_leaf(topo, nodes)
    loads: collections.Counter[Link] = collections.Counter(background or {})
    paths: dict[Flow, tuple[Link, ...]] = {}
    for flow in ring_flows(order, channels):
        if topo.leaf_of[flow.src] == topo.leaf_of[flow.dst]:
            candidates = [_path(topo, flow, None)]
        else:
            candidates = [_path(topo, flow, s) for s in topo.spines]
        best = min(candidates, key=lambda p: (max((loads[link] for link in p[1:-1]), default=0),
                                              sum(loads[link] for link in p)))
        loads.update(best)
        paths[flow] = best
    return RingPlan(tuple(order), paths, max_uplink_load(topo, count_link_loads(paths)))
