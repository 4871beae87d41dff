"""Vertex and edge managers: plug-ins that turn events and statistics into graph mutations.

Fangorn attaches a manager to each vertex and edge; later work (remediation, mixture planning,
distillation) adds behaviour by registering a manager, without touching the graph core, the
backends or the monitor loop. A manager is keyed by a vertex role or an edge kind, or by "*" to
see every event, and returns the mutations it made so the caller can apply and report them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from huorn.graph import mutate
from huorn.graph.model import Graph, Mutation

# Event types the built-in managers understand.
SCHEDULER_DECISION = "scheduler.decision"  # data: replicas, reason, [remove], [nodes]
INSTANCE_FAILED = "instance.failed"  # data: instance, reason
EDGE_FIRED = "edge.fired"  # data: step, path (a checkpoint edge fires when a checkpoint lands)
VERTEX_COMPLETED = "vertex.completed"  # data: reason
PARAMETER_DECISION = "parameter.decision"  # data: key, value, reason (a run-time knob, e.g. S2's counts)


@dataclass(frozen=True)
class Event:
    type: str
    target: str  # a vertex name or an edge key (source->target:kind)
    data: dict[str, Any] = field(default_factory=dict)


class Manager(Protocol):
    def handle(self, graph: Graph, event: Event) -> list[Mutation]: ...


def _done(m: Mutation | None) -> list[Mutation]:
    return [m] if m is not None else []


class TrainerManager:
    """Resizes the trainer gang when the scheduler decides on a new replica count."""

    def handle(self, graph: Graph, event: Event) -> list[Mutation]:
        if event.type != SCHEDULER_DECISION:
            return []
        reason = event.data.get("reason") or f"scheduler chose {event.data['replicas']} replicas"
        return _done(
            mutate.resize(
                graph,
                event.target,
                int(event.data["replicas"]),
                reason=reason,
                remove=event.data.get("remove"),
                nodes=event.data.get("nodes"),
            )
        )


class InstanceManager:
    """Replaces a failed instance of any vertex with a new generation (remediation's last rung)."""

    def handle(self, graph: Graph, event: Event) -> list[Mutation]:
        if event.type != INSTANCE_FAILED:
            return []
        if event.data["instance"] not in graph.instance_names():
            return []  # another manager already replaced it
        reason = event.data.get("reason") or f"instance {event.data['instance']} failed"
        return [mutate.replace_instance(graph, event.data["instance"], reason=reason)]


class RendezvousManager:
    """Replaces a failed rendezvous store and, with it, every instance that joined through it.

    The c10d store holds the rendezvous state and agents keep one connection to it: a new store
    is empty and on a new address, so agents of the old one can only fail (after their
    keep-alive runs out) and be replaced one by one. Replacing them with the store, in the same
    reconcile, turns that into one restart from the last checkpoint."""

    def handle(self, graph: Graph, event: Event) -> list[Mutation]:
        if event.type != INSTANCE_FAILED or event.data["instance"] not in graph.instance_names():
            return []
        reason = event.data.get("reason") or f"rendezvous store {event.data['instance']} failed"
        out = [mutate.replace_instance(graph, event.data["instance"], reason=reason)]
        new = out[0].detail["new"]
        for edge in graph.edges_from(event.target):
            if edge.kind != "rendezvous":
                continue
            for instance in list(graph.vertex(edge.target).instances):
                out.append(
                    mutate.replace_instance(
                        graph,
                        instance.name,
                        reason=f"its rendezvous store was replaced by {new}; rejoin the new one",
                        drain=True,
                    )
                )
        return out


def _checkpoint_name(handed: dict) -> str:
    """A handed checkpoint as a reason names it: by its step, or as the final one, which a token
    budget's run hands before its step is known ({"step": None, "final": True})."""
    if handed.get("step") is not None:
        return f"the checkpoint of step {handed['step']}"
    return "the final checkpoint" if handed.get("final") else "a checkpoint"


class CheckpointEdgeManager:
    """Starts the consumer of a checkpoint edge (an eval) when the producer writes a checkpoint,
    and hands it the checkpoint's step and path as parameters."""

    def handle(self, graph: Graph, event: Event) -> list[Mutation]:
        edge = next((e for e in graph.edges if e.key == event.target), None)
        if event.type != EDGE_FIRED or edge is None:
            return []
        which = _checkpoint_name(event.data)
        out = _done(
            mutate.set_param(
                graph,
                edge.target,
                "checkpoint",
                dict(event.data),
                reason=f"{which} landed on {edge.key}",
            )
        )
        return out + _done(
            mutate.set_active(
                graph, edge.target, True,
                reason=f"{edge.kind} edge from {edge.source} fired: {which}"
            )
        )


class OnDemandManager:
    """Parks an on-demand vertex again when its work is done, releasing its resources; but when
    a newer input landed while it worked (a checkpoint written during an eval), it runs again
    on that input instead, so the newest checkpoint, the last of a run included, is never
    skipped. `data["inputs"]` are what its instances were started on (as the backend reports)."""

    def handle(self, graph: Graph, event: Event) -> list[Mutation]:
        if event.type != VERTEX_COMPLETED or event.target not in graph.vertices:
            return []
        vertex = graph.vertices[event.target]
        newest = vertex.params.get("checkpoint")
        used = event.data.get("inputs") or []
        if newest is not None and used and any(u != newest for u in used):
            reason = (f"{event.target} finished on {_checkpoint_name(used[0] or {})}; "
                      f"{_checkpoint_name(newest)} landed meanwhile: evaluate it too")
            # NB: a re-run is not a failure: counted, an eval slower than the checkpoint interval
            # spent spec.remediation.maxRestarts on every checkpoint, and after three the first
            # real pod failure failed the job
            return [mutate.replace_instance(graph, i.name, reason=reason, counted=False)
                    for i in list(vertex.instances)]
        return _done(
            mutate.set_active(graph, event.target, False, reason=event.data.get("reason") or "completed")
        )


class ParameterManager:
    """Records a policy's choice of a run-time parameter as a set-param mutation with its reason;
    the backend delivers the new value to the running instances (e.g. S2's micro-batch counts)."""

    def handle(self, graph: Graph, event: Event) -> list[Mutation]:
        if event.type != PARAMETER_DECISION:
            return []
        # stamped: the backend delivers the value once per set-param, which it must still tell
        # apart once the bounded log in status has dropped it
        return _done(mutate.set_param(graph, event.target, str(event.data["key"]), event.data["value"],
                                      reason=str(event.data["reason"]), stamp=True))


class ManagerSet:
    """The managers of one graph, by vertex role and by edge kind."""

    def __init__(self) -> None:
        self._by_key: dict[str, list[Manager]] = {}

    def add(self, key: str, manager: Manager) -> None:
        """Attach a manager to a vertex role, an edge kind (prefix `edge:`), or "*" for all."""
        self._by_key.setdefault(key, []).append(manager)

    def managers_for(self, graph: Graph, target: str) -> list[Manager]:
        if target in graph.vertices:
            keys = [graph.vertices[target].role]
        else:
            keys = [f"edge:{e.kind}" for e in graph.edges if e.key == target]
            if not keys:
                raise KeyError(
                    f"event target {target!r} is neither a vertex nor an edge of graph {graph.name!r}"
                )
        return [m for k in [*keys, "*"] for m in self._by_key.get(k, [])]

    def dispatch(self, graph: Graph, event: Event) -> list[Mutation]:
        """Let every manager of the target react; return all mutations in the order made."""
        return [m for manager in self.managers_for(graph, event.target) for m in manager.handle(graph, event)]


def build_default_managers() -> ManagerSet:
    managers = ManagerSet()
    managers.add("trainer", TrainerManager())
    managers.add("server", TrainerManager())  # an InferenceJob's servers resize the same way
    managers.add("edge:checkpoint", CheckpointEdgeManager())
    managers.add("eval", OnDemandManager())
    managers.add("rendezvous", RendezvousManager())
    managers.add("*", InstanceManager())
    managers.add("*", ParameterManager())
    return managers
