"""The monitor loop every backend shares: observe → decide → mutate the graph → apply.

The local backend runs it in `huorn run`; the operator runs the same `Monitor.tick` from a kopf
timer against the Kubernetes backend. Keeping one loop means a policy, a manager or a failure
rule behaves the same on a laptop and in a cluster, and is tested once. The loop never sleeps
by itself and reads time only through the injected clock, so tests drive it tick by tick.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from huorn.graph import managers, model


@dataclass(frozen=True)
class InstanceState:
    name: str  # the graph's instance name, e.g. trainer-1-g1
    vertex: str
    alive: bool
    failed: bool = False
    reason: str = ""
    completed: bool = False  # exited: an on-demand instance's work is done (reason says if it failed)
    input: dict[str, Any] | None = None  # what an on-demand instance was started on (its checkpoint)


@dataclass
class Observation:
    """What a backend saw since the previous observation."""

    time: float
    instances: dict[str, InstanceState] = field(default_factory=dict)
    steps: list[dict[str, Any]] = field(default_factory=list)  # new step records, oldest first
    telemetry: dict[str, dict[str, Any]] = field(default_factory=dict)  # replica → /telemetry
    checkpoint: dict[str, Any] | None = None  # a checkpoint that landed since the last look
    finished: bool = False  # the workload completed (every trainer exited cleanly)
    # instance → the node it runs on, where a backend has several (a cluster): the goodput
    # policy moves a resized gang to where the allocator placed it. Empty on one host.
    nodes: dict[str, str] = field(default_factory=dict)

    @property
    def last_step(self) -> int | None:
        return self.steps[-1].get("step") if self.steps else None


class Backend(Protocol):
    """What the monitor needs from a backend (local processes, or Kubernetes objects)."""

    def apply(self, graph: model.Graph) -> list[str]:
        """Make the world match the graph's desired resources; return what was done, in words."""
        ...

    def observe(self) -> Observation: ...


class Policy(Protocol):
    """Turns observations into events for the managers (the scheduler's decisions)."""

    def decide(self, graph: model.Graph, observation: Observation) -> list[managers.Event]: ...


@dataclass
class ScheduledResize:
    """Resize a vertex when training reaches a step: `--scale-at STEP:REPLICAS` on the CLI,
    and a deterministic stand-in for the allocator in tests and demonstrations."""

    vertex: str
    plan: list[tuple[int, int]]  # (step, replicas), any order
    _done: set[int] = field(default_factory=set)

    def decide(self, graph: model.Graph, observation: Observation) -> list[managers.Event]:
        step = observation.last_step
        if step is None:
            return []
        due = [(s, r) for s, r in sorted(self.plan) if s <= step and s not in self._done]
        if not due:
            return []
        self._done.update(s for s, _ in due)
        at, replicas = due[-1]
        reason = f"scheduled resize to {replicas} replicas at step {at} (--scale-at {at}:{replicas})"
        return [
            managers.Event(managers.SCHEDULER_DECISION, self.vertex, {"replicas": replicas, "reason": reason})
        ]


def build_failure_events(graph: model.Graph, observation: Observation) -> list[managers.Event]:
    """An instance the backend reports failed becomes an instance.failed event for its vertex;
    the managers decide what to do (by default: replace it with a new generation)."""
    live = set(graph.instance_names())
    return [
        managers.Event(managers.INSTANCE_FAILED, s.vertex, {"instance": s.name, "reason": s.reason})
        for s in observation.instances.values()
        if s.failed and s.name in live
    ]


def build_checkpoint_events(graph: model.Graph, observation: Observation) -> list[managers.Event]:
    """A landed checkpoint fires every checkpoint edge out of the vertex that wrote it."""
    if observation.checkpoint is None:
        return []
    source = observation.checkpoint.get("vertex", "trainer")
    return [
        managers.Event(managers.EDGE_FIRED, e.key, dict(observation.checkpoint))
        for e in graph.edges_from(source)
        if e.kind == "checkpoint"
    ]


def build_completion_events(graph: model.Graph, observation: Observation) -> list[managers.Event]:
    """An active on-demand vertex (an eval) whose every instance has exited is done (a failure
    is named in the reason, not retried); its manager parks it again, or runs it once more when
    a newer input landed meanwhile."""
    events = []
    for vertex in graph.vertices.values():
        if vertex.mode is not model.ExecutionMode.ON_DEMAND or not vertex.active or not vertex.instances:
            continue
        states = [observation.instances.get(i.name) for i in vertex.instances]
        if all(s is not None and s.completed for s in states):
            problems = [s.reason for s in states if s is not None and s.reason]
            reason = (f"{vertex.name} finished with errors: {'; '.join(problems)}" if problems
                      else f"{vertex.name}: every instance finished")
            events.append(managers.Event(managers.VERTEX_COMPLETED, vertex.name, {
                "reason": reason, "inputs": [s.input for s in states if s is not None]}))
    return events


@dataclass
class TickResult:
    observation: Observation
    events: list[managers.Event]
    mutations: list[model.Mutation]
    actions: list[str]


class Monitor:
    """One job's loop. `tick()` is a single pass; `run()` repeats it until a stop condition."""

    def __init__(
        self,
        graph: model.Graph,
        backend: Backend,
        policies: list[Policy] | None = None,
        manager_set: managers.ManagerSet | None = None,
        on_tick: Callable[[TickResult], None] | None = None,
    ) -> None:
        self.graph = graph
        self.backend = backend
        self.policies = list(policies or [])
        self.managers = manager_set or managers.build_default_managers()
        self.on_tick = on_tick

    def start(self) -> list[str]:
        """Materialise the graph as compiled."""
        return self.backend.apply(self.graph)

    def tick(self) -> TickResult:
        observation = self.backend.observe()
        events = (build_failure_events(self.graph, observation)
                  + build_checkpoint_events(self.graph, observation)
                  + build_completion_events(self.graph, observation))
        if not observation.finished:
            for policy in self.policies:
                events += policy.decide(self.graph, observation)
        mutations = [m for event in events for m in self.managers.dispatch(self.graph, event)]
        actions = self.backend.apply(self.graph) if mutations else []
        result = TickResult(observation, events, mutations, actions)
        if self.on_tick is not None:
            self.on_tick(result)
        return result

    def run(
        self,
        interval: float = 1.0,
        should_stop: Callable[[TickResult], bool] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> TickResult:
        """Tick every `interval` seconds until the workload finishes or `should_stop` says so."""
        while True:
            result = self.tick()
            # A finishing tick can still start work (an eval of the last checkpoint): go on until
            # a finished tick changes nothing.
            done = result.observation.finished and not result.mutations
            if done or (should_stop is not None and should_stop(result)):
                return result
            sleep(interval)
