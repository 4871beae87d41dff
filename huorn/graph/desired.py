"""Graph → the backend resources that should exist: a pure, deterministic function.

Both backends reconcile against this list. The Kubernetes backend maps `instance` to a pod,
`endpoint` to a Service and `volume` to a PVC; the local backend maps them to a process tree, a
loopback port and a directory of the run. Keeping the mapping pure and sorted means the same
graph version always yields the same list, so a restarted operator computes exactly the diff it
would have computed before, and a replaced instance (a new generation, hence a new name) shows
up as one delete plus one create.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from huorn.graph.model import Graph, Instance, ResourceRequest, Scheduling, Transport, Vertex

_ORDER = {"volume": 0, "endpoint": 1, "instance": 2}


@dataclass(frozen=True)
class DesiredResource:
    kind: str  # volume | endpoint | instance
    name: str  # unique in the graph: <graph>-<instance> or <graph>-<vertex>[-<what>]
    vertex: str
    role: str
    ordinal: int | None = None
    generation: int | None = None
    resources: ResourceRequest | None = None
    params: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    depends_on: tuple[str, ...] = ()


def endpoint_name(graph: Graph, vertex: str) -> str:
    return f"{graph.name}-{vertex}"


def volume_name(graph: Graph, vertex: str, what: str) -> str:
    return volume_name_for(graph.name, vertex, what)


def volume_name_for(job: str, vertex: str, what: str) -> str:
    return f"{job}-{vertex}-{what}"


def instance_name(graph: Graph, instance: Instance) -> str:
    return f"{graph.name}-{instance.name}"


def _serves_network(graph: Graph, vertex: str) -> bool:
    return any(e.transport == Transport.NETWORK for e in graph.edges_from(vertex))


def writes_checkpoints(v: Vertex) -> bool:
    """Whether the vertex checkpoints itself: its `checkpoint` parameter is a checkpoint spec
    (path, interval, ...). A checkpoint edge's consumer (the eval) has a `checkpoint` parameter
    too, the checkpoint it was handed, which names its step; that one it reads from the producer's
    volume, and taken for a spec it got a volume of its own that nothing ever wrote into."""
    own = v.params.get("checkpoint")
    return isinstance(own, dict) and "step" not in own


def _volumes_of(graph: Graph, v: Vertex) -> list[str]:
    names = []
    if writes_checkpoints(v):
        names.append(volume_name(graph, v.name, "checkpoints"))
    for e in graph.edges_to(v.name):
        if e.transport == Transport.CHECKPOINT_FILE:
            names.append(volume_name(graph, e.source, "checkpoints"))
    return names


def build_desired(graph: Graph) -> list[DesiredResource]:
    """Every resource the graph's current version needs, sorted volumes → endpoints → instances."""
    out: dict[str, DesiredResource] = {}
    for v in graph.vertices.values():
        if not v.active:
            continue
        volumes = _volumes_of(graph, v)
        for name in volumes:
            owner = name.removeprefix(f"{graph.name}-").removesuffix("-checkpoints")
            out[name] = DesiredResource("volume", name, owner, graph.vertex(owner).role)
        if _serves_network(graph, v.name):
            name = endpoint_name(graph, v.name)
            out[name] = DesiredResource("endpoint", name, v.name, v.role)
        # Concurrent network producers must be reachable before the consumer starts (the store
        # before the trainers); sequential producers hand over through files instead.
        feeds = [
            endpoint_name(graph, e.source)
            for e in graph.edges_to(v.name)
            if e.transport == Transport.NETWORK
            and e.scheduling == Scheduling.CONCURRENT
            and graph.vertex(e.source).active
        ]
        for instance in v.instances:
            name = instance_name(graph, instance)
            out[name] = DesiredResource(
                "instance",
                name,
                v.name,
                v.role,
                instance.ordinal,
                instance.generation,
                v.resources,
                copy.deepcopy(v.params),
                tuple(sorted({*volumes, *feeds})),
            )
    depth = _producer_depths(graph)
    return sorted(out.values(), key=lambda r: (_ORDER[r.kind], depth.get(r.vertex, 0), r.name))


def _producer_depths(graph: Graph) -> dict[str, int]:
    """How many concurrent network producers stand before each vertex, so that instances are
    created producers first (the store before the trainers) whatever their names."""
    feeds = {
        v: [
            e.source
            for e in graph.edges_to(v)
            if e.transport == Transport.NETWORK and e.scheduling == Scheduling.CONCURRENT and e.source != v
        ]
        for v in graph.vertices
    }
    depth: dict[str, int] = {}

    def visit(v: str, path: frozenset[str]) -> int:
        if v not in depth:
            depth[v] = 1 + max((visit(p, path | {v}) for p in feeds[v] if p not in path), default=-1)
        return depth[v]

    for v in graph.vertices:
        visit(v, frozenset())
    return depth


def diff_desired(
    current: list[DesiredResource], desired: list[DesiredResource]
) -> tuple[list[DesiredResource], list[DesiredResource]]:
    """(to create, to delete) that turn `current` into `desired`, each in apply order."""
    have = {r.name for r in current}
    want = {r.name for r in desired}
    create = [r for r in desired if r.name not in have]
    # Delete instances before endpoints and volumes, the reverse of creation.
    delete = sorted((r for r in current if r.name not in want), key=lambda r: (-_ORDER[r.kind], r.name))
    return create, delete
