"""The graph in a resource's status, within a size bound, and back.

etcd caps an object at 1.5 MiB and every status write rewrites the whole object, so the graph
gets a fixed budget (16 KiB by default). The structure (vertices, edges, branches) always goes
in whole; the mutation log keeps its newest entries that fit, while `summary` keeps the totals
so the counts stay right after truncation. Instances are written as a compact ordinal string
("0-3,5g2" is ordinals 0..3 at generation 0 and ordinal 5 at generation 2) so that a
4096-replica vertex costs bytes, not kilobytes. The operator can be restarted at any moment and
rebuild the graph from this dict alone.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from huorn.graph.model import (
    Branch,
    Edge,
    ExecutionMode,
    Graph,
    Instance,
    Mutation,
    Pattern,
    ResourceRequest,
    Scheduling,
    Transport,
    Vertex,
)

DEFAULT_MAX_BYTES = 16 * 1024
REASON_LIMIT = 256
DETAIL_LIMIT = 512


class GraphTooLarge(ValueError):
    """The structure alone exceeds the budget: the graph, not the log, must shrink."""


def measure(obj: Any) -> int:
    """Bytes of the compact JSON the API server stores."""
    return len(json.dumps(obj, separators=(",", ":"), sort_keys=True).encode())


def encode_instances(instances: list[Instance]) -> str:
    parts: list[str] = []
    plain = sorted(i.ordinal for i in instances if i.generation == 0)
    start = prev = None
    for o in [*plain, None]:
        if o is not None and prev is not None and o == prev + 1:
            prev = o
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = o
    parts += [
        f"{i.ordinal}g{i.generation}" for i in sorted(instances, key=lambda i: i.ordinal) if i.generation
    ]
    return ",".join(parts)


def decode_instances(vertex: str, text: str) -> list[Instance]:
    out: list[Instance] = []
    for part in filter(None, text.split(",")):
        if m := re.fullmatch(r"(\d+)-(\d+)", part):
            out += [Instance(vertex, o) for o in range(int(m[1]), int(m[2]) + 1)]
        elif m := re.fullmatch(r"(\d+)(?:g(\d+))?", part):
            out.append(Instance(vertex, int(m[1]), int(m[2] or 0)))
        else:
            raise ValueError(
                f"instances of vertex {vertex!r}: cannot read {part!r} (expected '0-3' or '5g2')"
            )
    return sorted(out, key=lambda i: i.ordinal)


def _vertex_to_wire(v: Vertex) -> dict[str, Any]:
    return {
        "name": v.name,
        "role": v.role,
        "minReplicas": v.min_replicas,
        "maxReplicas": v.max_replicas,
        "replicas": v.replicas,
        "mode": v.mode.value,
        "active": v.active,
        "resources": {"gpus": v.resources.gpus, "cpu": v.resources.cpu, "memory": v.resources.memory},
        "params": v.params,
        "instances": encode_instances(v.instances),
        # "2,3g1": ordinal 2 retired at generation 0, ordinal 3 at 1 (the instances' own notation)
        **({"retired": encode_instances([Instance(v.name, o, g) for o, g in v.retired.items()])}
           if v.retired else {}),
    }


def _edge_to_wire(e: Edge) -> dict[str, Any]:
    return {
        "source": e.source,
        "target": e.target,
        "kind": e.kind,
        "pattern": e.pattern.value,
        "scheduling": e.scheduling.value,
        "transport": e.transport.value,
        "params": e.params,
    }


# A cut detail keeps its scalars (a set-param's key, a shrink's graceSeconds, a replacement's
# old and new names) and writes the instance lists the reconcile reads back in the instances'
# compact notation, under these wire keys. NB: before, a detail over DETAIL_LIMIT became
# {"truncated": true}, and a shrink of 30 replicas or more lost the names it removed with the grace
# they are deleted with: a reconcile after a restart deleted them with the pods' own 30 s.
COMPACT_LISTS = {"removed": "removedInstances", "added": "addedInstances"}
SCALAR_LIMIT = 256
# Scalars the reconcile reads back that may run longer: where a resize's new instances go
# (mutate.encode_nodes: a dozen GKE-long node names is over 400 characters). Dropped past this.
LONG_SCALARS = {"nodes": DETAIL_LIMIT}


def _cut_detail(target: str, detail: dict[str, Any]) -> dict[str, Any]:
    cut: dict[str, Any] = {k: v for k, v in detail.items() if _is_small(v) or (
        isinstance(v, str) and len(v) <= LONG_SCALARS.get(k, 0))}
    for key, wire in COMPACT_LISTS.items():
        names = detail.get(key)
        compact = _compact_names(target, names) if isinstance(names, list) else None
        if compact is not None:
            cut[wire] = compact
    cut["truncated"] = True
    return cut


def _is_small(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= SCALAR_LIMIT
    return value is None or isinstance(value, bool | int | float)


def _compact_names(vertex: str, names: list[Any]) -> str | None:
    """Instance names of `vertex` in the compact notation, or None unless they all are and read
    back to the same names."""
    pattern = re.compile(rf"{re.escape(vertex)}-(\d+)(?:-g(\d+))?")
    instances = []
    for name in names:
        m = pattern.fullmatch(str(name))
        if m is None:
            return None
        instances.append(Instance(vertex, int(m[1]), int(m[2] or 0)))
    text = encode_instances(instances)
    back = [i.name for i in decode_instances(vertex, text)]
    return text if sorted(back) == sorted(str(n) for n in names) and len(back) == len(names) else None


def _detail_from_wire(target: str, detail: dict[str, Any]) -> dict[str, Any]:
    if not any(wire in detail for wire in COMPACT_LISTS.values()):
        return detail
    out = dict(detail)
    for key, wire in COMPACT_LISTS.items():
        if wire in out:
            out[key] = sorted(i.name for i in decode_instances(target, str(out.pop(wire))))
    return out


def _mutation_to_wire(m: Mutation) -> dict[str, Any]:
    detail = m.detail if measure(m.detail) <= DETAIL_LIMIT else _cut_detail(m.target, m.detail)
    return {
        "version": m.version,
        "time": m.time,
        "action": m.action,
        "target": m.target,
        "reason": m.reason[:REASON_LIMIT],
        "detail": detail,
    }


def to_status(graph: Graph, max_bytes: int = DEFAULT_MAX_BYTES) -> dict[str, Any]:
    """The graph as a status dict of at most `max_bytes` compact-JSON bytes."""
    out: dict[str, Any] = {
        "name": graph.name,
        "kind": graph.kind,
        "version": graph.version,
        "vertices": [_vertex_to_wire(v) for v in graph.vertices.values()],
        "edges": [_edge_to_wire(e) for e in graph.edges],
        "branches": [
            {"name": b.name, "options": b.options, "chosen": b.chosen} for b in graph.branches.values()
        ],
        "summary": {
            "mutations": graph.mutation_count,
            "actions": dict(sorted(graph.action_counts.items())),
            "logDropped": 0,
        },
        "log": [],
    }
    # Headroom for logDropped growing to its final digit count.
    used = measure(out) + len(str(len(graph.log)))
    if used > max_bytes:
        raise GraphTooLarge(
            f"graph {graph.name!r} needs {used} bytes without its log, "
            f"over the {max_bytes}-byte status budget; "
            "shrink vertex params or raise max_bytes"
        )
    kept: list[dict[str, Any]] = []
    for m in reversed(graph.log):
        entry = _mutation_to_wire(m)
        cost = measure(entry) + 1  # the comma
        if used + cost > max_bytes:
            break
        kept.append(entry)
        used += cost
    out["log"] = kept[::-1]
    out["summary"]["logDropped"] = len(graph.log) - len(kept)
    return out


def from_status(data: dict[str, Any], clock: Callable[[], float] | None = None) -> Graph:
    """Rebuild a graph from `to_status` output; the log holds what survived truncation."""
    try:
        graph = Graph(name=data["name"], kind=data["kind"], version=int(data["version"]))
        for w in data["vertices"]:
            graph.vertices[w["name"]] = Vertex(
                name=w["name"],
                role=w["role"],
                min_replicas=w["minReplicas"],
                max_replicas=w["maxReplicas"],
                resources=ResourceRequest(**w["resources"]),
                mode=ExecutionMode(w["mode"]),
                params=w["params"],
                instances=decode_instances(w["name"], w["instances"]),
                active=w["active"],
                # a status written before retired was kept has none: names may repeat, as then
                retired={i.ordinal: i.generation for i in decode_instances(w["name"], w.get("retired", ""))},
            )
        graph.edges = [
            Edge(
                w["source"],
                w["target"],
                w["kind"],
                Pattern(w["pattern"]),
                Scheduling(w["scheduling"]),
                Transport(w["transport"]),
                w["params"],
            )
            for w in data["edges"]
        ]
        graph.branches = {b["name"]: Branch(b["name"], b["options"], b["chosen"]) for b in data["branches"]}
        graph.log = [
            Mutation(w["version"], w["time"], w["action"], w["target"], w["reason"],
                     _detail_from_wire(w["target"], w["detail"]))
            for w in data["log"]
        ]
        graph.mutation_count = data["summary"]["mutations"]
        graph.action_counts = dict(data["summary"]["actions"])
    except KeyError as exc:
        raise ValueError(
            f"status.graph is missing field {exc.args[0]!r}; was it written by to_status?"
        ) from None
    if clock is not None:
        graph.clock = clock
    return graph
