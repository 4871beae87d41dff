"""Pictures of a graph: DOT text for Graphviz users, and a PNG drawn with networkx and
matplotlib so that no Graphviz binary is needed (CI images and laptops rarely have one).

The PNG is annotated with the newest mutations, because the question a reader brings to a run
report is "what changed and why", not only "what is the shape".
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import networkx as nx

from huorn.graph.model import Edge, Graph, Scheduling, Transport, Vertex

_EDGE_STYLE = {Transport.NETWORK: "solid", Transport.CHECKPOINT_FILE: "dashed", Transport.MEMORY: "dotted"}


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def vertex_label(v: Vertex) -> str:
    state = "" if v.active else " (waiting)"
    names = ", ".join(i.name for i in v.instances[:2]) + (f" +{v.replicas - 2}" if v.replicas > 2 else "")
    counts = f"{v.replicas} of {v.min_replicas}..{v.max_replicas}"
    return f"{v.name}{state}\n{v.role} · {v.mode.value}\n{counts}\n{names}"


def edge_label(e: Edge) -> str:
    return f"{e.kind}\n{e.pattern.value}, {e.scheduling.value}, {e.transport.value}"


def render_dot(graph: Graph) -> str:
    """Graphviz DOT of the graph; deterministic, so it diffs cleanly between versions."""
    lines = [
        f"digraph {_quote(graph.name)} {{",
        "  rankdir=LR;",
        "  node [shape=box, style=rounded];",
        f"  label={_quote(f'{graph.kind} {graph.name} v{graph.version}')};",
    ]
    for v in graph.vertices.values():
        style = "rounded" if v.active else "rounded,dashed"
        lines.append(f"  {_quote(v.name)} [label={_quote(vertex_label(v))}, style={_quote(style)}];")
    for e in graph.edges:
        lines.append(
            f"  {_quote(e.source)} -> {_quote(e.target)} "
            f"[label={_quote(edge_label(e))}, style={_EDGE_STYLE[e.transport]}];"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"


def build_networkx(graph: Graph) -> nx.MultiDiGraph:
    g = nx.MultiDiGraph(name=graph.name)
    for v in graph.vertices.values():
        g.add_node(v.name, label=vertex_label(v), active=v.active)
    for e in graph.edges:
        g.add_edge(e.source, e.target, key=e.kind, label=edge_label(e), transport=e.transport)
    return g


def _layout(graph: Graph, g: nx.MultiDiGraph) -> dict[str, tuple[float, float]]:
    """Left-to-right layers by longest path from the sources, so data flows like in the DOT."""
    order = list(graph.vertices)
    layer = dict.fromkeys(order, 0)
    # Sequential edges are feedback (weights after a step, a checkpoint for an eval): lay out
    # the concurrent data flow first, then drop whatever edge still closes a cycle.
    acyclic = nx.DiGraph(
        [
            (e.source, e.target)
            for e in graph.edges
            if e.scheduling == Scheduling.CONCURRENT and e.source != e.target
        ]
    )
    acyclic.add_nodes_from(order)
    for e in graph.edges:
        if e.scheduling == Scheduling.SEQUENTIAL and e.source != e.target:
            acyclic.add_edge(e.source, e.target)
            if not nx.is_directed_acyclic_graph(acyclic):
                acyclic.remove_edge(e.source, e.target)
    while not nx.is_directed_acyclic_graph(acyclic):
        acyclic.remove_edge(*nx.find_cycle(acyclic)[-1][:2])
    for node in nx.topological_sort(acyclic):
        for succ in acyclic.successors(node):
            layer[succ] = max(layer[succ], layer[node] + 1)
    pos: dict[str, tuple[float, float]] = {}
    for depth in sorted(set(layer.values())):
        members = [n for n in order if layer[n] == depth]
        for i, n in enumerate(members):
            pos[n] = (depth * 4.5, (len(members) - 1) / 2.0 - i * 1.6)
    return pos


def render_png(graph: Graph, path: Path, mutations: int = 12) -> Path:
    """Draw the graph and its newest mutations into a PNG at `path`."""
    g = build_networkx(graph)
    pos = _layout(graph, g)
    fig, (ax, side) = plt.subplots(1, 2, figsize=(14, 6), gridspec_kw={"width_ratios": [3, 2]})
    ax.set_title(f"{graph.kind} {graph.name}, graph version {graph.version}")
    xs = [p[0] for p in pos.values()] or [0.0]
    ys = [p[1] for p in pos.values()] or [0.0]
    ax.set_xlim(min(xs) - 1.8, max(xs) + 1.8)
    ax.set_ylim(min(ys) - 1.4, max(ys) + 1.4)
    fig.tight_layout()  # fix the data → display transform before placing labels on the arcs
    for (u, w, data), rad in zip(g.edges(data=True), _arc_radii(g), strict=True):
        nx.draw_networkx_edges(
            g,
            pos,
            edgelist=[(u, w)],
            ax=ax,
            style=_EDGE_STYLE[data["transport"]],
            arrows=True,
            arrowsize=18,
            node_size=14000,
            connectionstyle=f"arc3,rad={rad}",
        )
        # On the arc itself: arc3 bends in display space towards (dy, -dx) and the curve's
        # midpoint lies half way to its control point.
        (x1, y1), (x2, y2) = ax.transData.transform([pos[u], pos[w]])
        mx, my = ax.transData.inverted().transform(
            ((x1 + x2) / 2 + 0.5 * rad * (y2 - y1), (y1 + y2) / 2 - 0.5 * rad * (x2 - x1) + 10)
        )
        ax.text(
            mx,
            my,
            data["label"],
            fontsize=7,
            ha="center",
            va="center",
            color="#444444",
        )
    for name, (x, y) in pos.items():
        active = g.nodes[name]["active"]
        ax.text(
            x,
            y,
            g.nodes[name]["label"],
            ha="center",
            va="center",
            fontsize=8,
            bbox={
                "boxstyle": "round",
                "fc": "#e8f1fb" if active else "#f4f4f4",
                "ec": "#2a6ebb" if active else "#999999",
                "ls": "-" if active else "--",
            },
        )
    ax.axis("off")
    side.axis("off")
    side.set_title(f"mutations ({graph.mutation_count} in all, newest last)")
    lines = [
        textwrap.shorten(f"v{m.version} {m.action} {m.target}: {m.reason}", 78)
        for m in graph.log[-mutations:]
    ] or ["(none: the graph is as compiled)"]
    side.text(
        0.0,
        1.0,
        "\n".join(lines),
        va="top",
        ha="left",
        fontsize=8,
        family="monospace",
        transform=side.transAxes,
        wrap=True,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)
    return path


def _arc_radii(g: nx.MultiDiGraph) -> list[float]:
    """Curve an edge when its reverse also exists, so A→B and B→A do not overlap."""
    return [0.25 if g.has_edge(w, u) else 0.0 for u, w in g.edges()]
