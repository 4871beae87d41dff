"""The mutation API: every run-time change to a graph goes through here.

Each function changes the graph, bumps its version once and appends one log entry with the
reason and the time from the graph's injected clock. Funnelling every change through one place
is what lets the operator write "why is this job at 2 replicas" into status and Events, and lets
a backend diff two versions instead of guessing what changed.
"""

from __future__ import annotations

import copy
from typing import Any

from huorn.graph.model import (
    Edge,
    ExecutionMode,
    Graph,
    Instance,
    Mutation,
    Vertex,
    build_instances,
    retire_instances,
)


def note(graph: Graph, target: str, reason: str, detail: dict[str, Any] | None = None) -> Mutation:
    """A decision that changes nothing in the graph (a remediation that only observes: a stall
    outside collectives, a recovery), kept in the log and so in status.decisions. Written as a
    parameter, it overwrote the one a decision that did change something had left there."""
    return _record(graph, "note", target, reason, dict(detail or {}))


def _record(graph: Graph, action: str, target: str, reason: str, detail: dict[str, Any]) -> Mutation:
    if not reason.strip():
        raise ValueError(f"a {action} of {target!r} needs a reason: say why, it goes into status and Events")
    graph.version += 1
    mutation = Mutation(graph.version, graph.clock(), action, target, reason, detail)
    graph.log.append(mutation)
    graph.mutation_count += 1
    graph.action_counts[action] = graph.action_counts.get(action, 0) + 1
    return mutation


def resize(
    graph: Graph, vertex: str, replicas: int, *, reason: str, remove: list[str] | None = None,
    nodes: list[str] | None = None,
) -> Mutation | None:
    """Set a vertex's replica count; None when it already has that many and none is replaced.

    `remove` names the instances that go (a reclaim picks the cheapest workers to lose; the
    goodput allocator, those that are not where it placed the gang); without it a shrink drops
    the highest ordinals, which keeps ordinals dense for the survivors. A grow, or a resize to the
    same size, may remove some too: new instances take their place, so a gang can move while it
    resizes. `nodes`, one per new instance, is where the scheduler placed them; the reconcile
    places them there while the GPUs are still free.
    """
    v = graph.vertex(vertex)
    if not v.min_replicas <= replicas <= v.max_replicas:
        raise ValueError(
            f"replicas={replicas} for vertex {vertex!r} is outside its range "
            f"[{v.min_replicas}, {v.max_replicas}] (elasticity.minReplicas..maxReplicas)"
        )
    before = v.replicas
    if remove is None:
        remove = [i.name for i in sorted(v.instances, key=lambda i: i.ordinal)][replicas:]
    unknown = set(remove) - {i.name for i in v.instances}
    if unknown or len(set(remove)) != len(remove) or len(remove) < before - replicas:
        raise ValueError(
            f"remove={remove} must name at least {max(before - replicas, 0)} distinct current instances "
            f"of {vertex!r} (it has {[i.name for i in v.instances]})"
        )
    adding = replicas - (before - len(remove))
    if nodes is not None and len(nodes) != adding:
        raise ValueError(f"nodes={nodes} must name one node for each of the {adding} new instances "
                         f"of {vertex!r}")
    if replicas == before and not remove:
        return None
    for i in v.instances:
        if i.name in remove:
            v.retired[i.ordinal] = max(v.retired.get(i.ordinal, -1), i.generation)
    v.instances = [i for i in v.instances if i.name not in remove]
    used = {i.ordinal for i in v.instances}
    free = (o for o in range(replicas + len(used)) if o not in used)
    added = [Instance(vertex, o, v.retired.pop(o, -1) + 1) for o in (next(free) for _ in range(adding))]
    v.instances = sorted([*v.instances, *added], key=lambda i: i.ordinal)
    detail: dict[str, Any] = {"from": before, "to": replicas}
    if added:
        detail["added"] = [i.name for i in added]
    if remove:
        detail["removed"] = sorted(remove)
    if nodes:
        detail["nodes"] = encode_nodes(nodes)
    return _record(graph, "resize", vertex, reason, detail)


def encode_nodes(nodes: list[str]) -> str:
    """The new instances' nodes as one short string, "a1:2,b0:1" (node names hold neither ":"
    nor ","): a scalar, so the status log keeps it when it cuts a long detail down to its
    scalars. The new instances are interchangeable, so how many go on each node is all a
    reconcile needs (decode_nodes hands them out in the order of `added`)."""
    counts: dict[str, int] = {}
    for node in nodes:
        counts[node] = counts.get(node, 0) + 1
    return ",".join(f"{node}:{n}" for node, n in counts.items())


def decode_nodes(text: str) -> list[str]:
    out: list[str] = []
    for part in filter(None, str(text).split(",")):
        node, _, n = part.rpartition(":")
        out += [node] * int(n)
    return out


def find_instance(graph: Graph, name: str) -> tuple[Vertex, int]:
    for v in graph.vertices.values():
        for index, instance in enumerate(v.instances):
            if instance.name == name:
                return v, index
    raise KeyError(f"graph {graph.name!r} has no instance {name!r}; it has {graph.instance_names()}")


UNCOUNTED_REPLACE = "replace-uncounted"  # action_counts key: replacements that spent no failure budget
# action_counts key: failed pods replaced without spending the budget (a pod failure policy's Ignore).
# NB: apart from UNCOUNTED_REPLACE, which also holds healthy pods moved on purpose (a spec change's
# roll, an eval run again on a newer checkpoint), none of which is a failure
IGNORED_FAILURE = "replace-ignored-failure"


def replace_instance(graph: Graph, name: str, *, reason: str, drain: bool = False,
                     counted: bool = True, failure: bool = False) -> Mutation:
    """Swap one instance for a fresh one with the same ordinal and the next generation.

    By default the old instance is broken and backends kill it at once. `drain=True` says it is
    healthy but must move (its store was replaced, say): backends stop it gracefully, so its
    workers checkpoint first. `counted=False` marks a failure that is not the job's (a pod
    failure policy's Ignore): the tally travels with the graph, so it is written in the same
    status patch as the decision and can never be counted without it, or twice. `failure=True`
    marks the replacement of a pod that failed or never started, which the operator's back-off
    counts (its time is in the log)."""
    v, index = find_instance(graph, name)
    old = v.instances[index]
    new = Instance(old.vertex, old.ordinal, old.generation + 1)
    v.instances[index] = new
    detail: dict[str, Any] = {"old": old.name, "new": new.name}
    if drain:
        detail["drain"] = True
    if failure:
        detail["failure"] = True
    if not counted:
        detail["counted"] = False
        graph.action_counts[UNCOUNTED_REPLACE] = graph.action_counts.get(UNCOUNTED_REPLACE, 0) + 1
        if failure:
            graph.action_counts[IGNORED_FAILURE] = graph.action_counts.get(IGNORED_FAILURE, 0) + 1
    return _record(graph, "replace", v.name, reason, detail)


def insert_vertices(graph: Graph, vertices: list[Vertex], edges: list[Edge], *, reason: str) -> Mutation:
    """Add vertices and the edges that connect them, as one mutation (one version)."""
    clash = [v.name for v in vertices if v.name in graph.vertices]
    if clash:
        raise ValueError(f"vertices {clash} already exist in graph {graph.name!r}; pick new names")
    known = set(graph.vertices) | {v.name for v in vertices}
    for e in edges:
        for end in (e.source, e.target):
            if end not in known:
                raise ValueError(
                    f"edge {e.key} refers to vertex {end!r}, which neither exists nor is inserted"
                )
    for v in vertices:
        if not v.instances and v.active:
            v.instances = build_instances(v.name, v.min_replicas, v.retired)
        graph.vertices[v.name] = v
    graph.edges.extend(edges)
    detail = {"vertices": [v.name for v in vertices], "edges": [e.key for e in edges]}
    return _record(graph, "insert", ",".join(v.name for v in vertices), reason, detail)


def set_active(graph: Graph, vertex: str, active: bool, *, reason: str) -> Mutation | None:
    """Start or stop a vertex (an on-demand eval when a checkpoint edge fires, for instance)."""
    v = graph.vertex(vertex)
    if v.active == active:
        return None
    v.active = active
    if active and not v.instances:
        v.instances = build_instances(v.name, max(v.min_replicas, 1), v.retired)
    if not active:
        retire_instances(v)  # the next activation's instances get new names (eval-0-g1, ...)
    return _record(graph, "activate" if active else "deactivate", vertex, reason, {})


def suspend(graph: Graph, vertices: list[str], *, reason: str, renew: bool) -> Mutation | None:
    """Stop the named vertices' work and keep their instances to resume with; None when every
    one of them is suspended already.

    A long-running vertex goes inactive with its instances kept, so a resume brings back the
    replica count the allocator had chosen, not the minimum. An on-demand vertex stays as it is
    (its being active means its work is in flight), so an eval stopped here runs again on the same
    checkpoint after the resume. `renew` moves every instance to its next generation: the old
    pods may still be checkpointing when the job resumes, and their successors need other names."""
    named = [graph.vertex(name) for name in vertices]
    parked = [v for v in named if v.mode is not ExecutionMode.ON_DEMAND]
    if not any(v.active for v in parked):
        return None
    for v in named:
        if renew:
            v.instances = [Instance(i.vertex, i.ordinal, i.generation + 1) for i in v.instances]
        if v in parked:
            v.active = False
    detail = {"vertices": [v.name for v in named], "replicas": {v.name: v.replicas for v in parked}}
    return _record(graph, "suspend", ",".join(vertices), reason, detail)


def resume(graph: Graph, vertices: list[str], *, reason: str) -> Mutation | None:
    """Start the vertices that `suspend` stopped, with the instances it kept; None when none is
    suspended."""
    parked = [v for v in (graph.vertex(name) for name in vertices)
              if v.mode is not ExecutionMode.ON_DEMAND and not v.active]
    if not parked:
        return None
    for v in parked:
        v.active = True
        if not v.instances:
            v.instances = build_instances(v.name, max(v.min_replicas, 1), v.retired)
    detail = {"vertices": [v.name for v in parked], "replicas": {v.name: v.replicas for v in parked}}
    return _record(graph, "resume", ",".join(vertices), reason, detail)


def choose_branch(graph: Graph, branch: str, option: str, *, reason: str) -> Mutation | None:
    """Run one option of a choice point and park the others."""
    try:
        b = graph.branches[branch]
    except KeyError:
        raise KeyError(
            f"graph {graph.name!r} has no branch {branch!r}; it has {sorted(graph.branches)}"
        ) from None
    if option not in b.options:
        raise ValueError(f"branch {branch!r} has no option {option!r}; choose one of {sorted(b.options)}")
    if b.chosen == option:
        return None
    b.chosen = option
    for name, members in b.options.items():
        for vertex in members:
            v = graph.vertex(vertex)
            v.active = name == option
            if v.active and not v.instances:
                v.instances = build_instances(vertex, max(v.min_replicas, 1), v.retired)
            if not v.active:
                retire_instances(v)
    return _record(graph, "choose", branch, reason, {"option": option})


# A params key: parameter → {"version", "reason"} of the set-param that set it, for parameters
# set with `stamp` (a policy's run-time knob that a backend delivers once per decision).
# NB: the log in status is bounded (serialise.to_status), and once the set-param fell out of it,
# readers took the graph's version for the decision's: every later mutation made it look new, and
# the operator rolled the whole gang for an S3 split again after each one.
PARAM_STAMPS = "paramVersions"
STAMP_REASON_LIMIT = 256  # as the log's reasons in status (serialise.REASON_LIMIT)


def set_param(graph: Graph, target: str, key: str, value: Any, *, reason: str,
              stamp: bool = False) -> Mutation | None:
    """Set a parameter of a vertex (by name) or an edge (by its `source->target:kind` key).
    `stamp` keeps the version and reason of this set-param beside the value (PARAM_STAMPS), where
    they outlive the bounded log; without it a stamp from an earlier set-param of the key is
    dropped, as it no longer describes the value."""
    params = _params_of(graph, target)
    if key in params and params[key] == value:
        return None
    old = copy.deepcopy(params.get(key))
    params[key] = value
    mutation = _record(graph, "set-param", target, reason, {"key": key, "old": old, "new": value})
    stamps = params.get(PARAM_STAMPS)
    if stamp:
        params[PARAM_STAMPS] = {**(stamps or {}), key: {"version": mutation.version,
                                                        "reason": reason[:STAMP_REASON_LIMIT]}}
    elif isinstance(stamps, dict) and key in stamps:
        params[PARAM_STAMPS] = {k: v for k, v in stamps.items() if k != key}
    return mutation


def param_setting(graph: Graph, target: str, key: str) -> tuple[int, str] | None:
    """(version, reason) of the set-param that gave `target` its current `key`: from the log while
    it holds it, else from the stamp beside the value; None when neither knows."""
    setting = next((m for m in reversed(graph.log) if m.action == "set-param" and m.target == target
                    and m.detail.get("key") == key), None)
    if setting is not None:
        return setting.version, setting.reason
    stamp = (_params_of(graph, target).get(PARAM_STAMPS) or {}).get(key)
    if isinstance(stamp, dict) and "version" in stamp:
        return int(stamp["version"]), str(stamp.get("reason", ""))
    return None


def _params_of(graph: Graph, target: str) -> dict[str, Any]:
    if target in graph.vertices:
        return graph.vertices[target].params
    for e in graph.edges:
        if e.key == target:
            return e.params
    raise KeyError(
        f"{target!r} is neither a vertex {sorted(graph.vertices)} nor an edge {[e.key for e in graph.edges]}"
    )
