"""The execution graph's data: vertices (task groups), typed edges, and the mutation log.

Fangorn keeps *what* runs (the logical graph) apart from *where* it runs (placement), and lets
both change while the job runs. Huorn's graph is the logical half plus the instance names the
backends materialise; placement stays with the scheduler. Everything here is plain dataclasses,
so the graph serialises into a resource's status and compares by value in tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class ExecutionMode(StrEnum):
    """Fangorn's modes: gang (all-in-one, long-running workers) or on-demand (batch)."""

    GANG = "gang"
    ON_DEMAND = "on-demand"


class Pattern(StrEnum):
    ONE_TO_ONE = "one-to-one"
    ALL_TO_ALL = "all-to-all"
    BROADCAST = "broadcast"


class Scheduling(StrEnum):
    """Sequential: the consumer starts when the producer ends (or fires); concurrent: both run."""

    SEQUENTIAL = "sequential"
    CONCURRENT = "concurrent"


class Transport(StrEnum):
    CHECKPOINT_FILE = "checkpoint-file"
    NETWORK = "network"
    MEMORY = "memory"


@dataclass(frozen=True)
class ResourceRequest:
    """What one instance asks for, in base units (cores, bytes) so backends need no parsing."""

    gpus: int = 0
    cpu: float = 1.0
    memory: float = 2.0**30


@dataclass(frozen=True)
class Instance:
    """One replica of a vertex. Replacing it bumps the generation, so the new process or pod
    gets a new name and a stale one can never be mistaken for its successor."""

    vertex: str
    ordinal: int
    generation: int = 0

    @property
    def name(self) -> str:
        base = f"{self.vertex}-{self.ordinal}"
        return base if self.generation == 0 else f"{base}-g{self.generation}"


@dataclass
class Vertex:
    name: str
    role: str
    min_replicas: int
    max_replicas: int
    resources: ResourceRequest = field(default_factory=ResourceRequest)
    mode: ExecutionMode = ExecutionMode.GANG
    params: dict[str, Any] = field(default_factory=dict)
    instances: list[Instance] = field(default_factory=list)
    # An on-demand vertex waits inactive until an edge fires or a branch chooses it.
    active: bool = True
    # Ordinal → the last generation removed there (a shrink, a park, a branch not taken). A
    # replica added again on that ordinal takes the next generation, so its name is new: the old
    # one's pod may still be checkpointing (or an eval's still be reporting), and must never be
    # taken for the new replica's (its exit read as the new one failing).
    retired: dict[int, int] = field(default_factory=dict)

    @property
    def replicas(self) -> int:
        return len(self.instances)


@dataclass
class Edge:
    source: str
    target: str
    kind: str  # what flows: rendezvous, checkpoint, rollouts, weights, requests, ...
    pattern: Pattern = Pattern.ALL_TO_ALL
    scheduling: Scheduling = Scheduling.CONCURRENT
    transport: Transport = Transport.NETWORK
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.source}->{self.target}:{self.kind}"


@dataclass
class Branch:
    """A choice point (Fangorn's conditional join): one option's vertices run, the others wait."""

    name: str
    options: dict[str, list[str]]
    chosen: str | None = None


@dataclass(frozen=True)
class Mutation:
    version: int  # the graph version this mutation produced
    time: float  # seconds since the epoch, from the graph's injected clock
    action: str  # resize, replace, insert, choose, set-param, activate, suspend, resume
    target: str
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)


def _wall_clock() -> float:
    return time.time()


@dataclass
class Graph:
    name: str
    kind: str  # the resource kind it was compiled from
    vertices: dict[str, Vertex] = field(default_factory=dict)
    edges: list[Edge] = field(default_factory=list)
    branches: dict[str, Branch] = field(default_factory=dict)
    version: int = 1
    log: list[Mutation] = field(default_factory=list)
    # Totals survive log truncation in status, so "how many resizes so far" stays answerable.
    mutation_count: int = 0
    action_counts: dict[str, int] = field(default_factory=dict)
    clock: Callable[[], float] = field(default=_wall_clock, compare=False, repr=False)

    def vertex(self, name: str) -> Vertex:
        """Return the vertex, or fail with the names that do exist (a typo should be obvious)."""
        try:
            return self.vertices[name]
        except KeyError:
            raise KeyError(
                f"graph {self.name!r} has no vertex {name!r}; it has {sorted(self.vertices)}"
            ) from None

    def edges_from(self, vertex: str) -> list[Edge]:
        return [e for e in self.edges if e.source == vertex]

    def edges_to(self, vertex: str) -> list[Edge]:
        return [e for e in self.edges if e.target == vertex]

    def vertices_with_role(self, role: str) -> list[Vertex]:
        return [v for v in self.vertices.values() if v.role == role]

    def instance_names(self) -> list[str]:
        return [i.name for v in self.vertices.values() if v.active for i in v.instances]


def build_instances(vertex: str, count: int, retired: dict[int, int] | None = None) -> list[Instance]:
    """Ordinals 0..count-1, each at the generation after the one `retired` records for it (which
    gives those entries up: the new instances are what a later retirement records)."""
    retired = {} if retired is None else retired
    return [Instance(vertex, ordinal, retired.pop(ordinal, -1) + 1) for ordinal in range(count)]


def retire_instances(vertex: Vertex) -> None:
    """Drop every instance of `vertex`, recording each name as used (Vertex.retired)."""
    for i in vertex.instances:
        vertex.retired[i.ordinal] = max(vertex.retired.get(i.ordinal, -1), i.generation)
    vertex.instances = []
