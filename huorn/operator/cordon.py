"""S4's first half in a cluster: take the culprit's node out of placement before replacing its pod.

The remediation monitor names the node in the replace mutation (`detail["cordon"]`), which is
in status before anything else happens. Every reconcile cordons the nodes of mutations newer than
`status.cordonedVersion` and then advances that mark, so a node is cordoned once per decision
even across operator restarts, and a node an administrator uncordons later stays uncordoned.

Both Kubernetes signals are set: `spec.unschedulable` (what `kubectl cordon` does, and what
Huorn's own placement reads) and a `huorn.io/cordoned` NoSchedule taint, which says who did it
and keeps the default scheduler away even if someone clears the flag alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from huorn.graph import model
from huorn.operator.context import Context

DETAIL_KEY = "cordon"
TAINT_KEY = "huorn.io/cordoned"
TAINT = {"key": TAINT_KEY, "value": "remediation", "effect": "NoSchedule"}
PLURAL = "trainingjobs"


def pending_cordons(graph: model.Graph, done_version: int) -> list[tuple[int, str]]:
    """(graph version, node) of S4 decisions newer than the last one cordoned."""
    return [(m.version, str(m.detail[DETAIL_KEY])) for m in graph.log
            if m.version > done_version and m.detail.get(DETAIL_KEY)]


async def ensure_cordoned(ctx: Context, body: Mapping[str, Any], graph: model.Graph) -> list[str]:
    """Cordon what the log asks for and has not been cordoned yet; returns the nodes cordoned."""
    status = body.get("status") or {}
    todo = pending_cordons(graph, int(status.get("cordonedVersion") or 0))
    if not todo:
        return []
    nodes: list[str] = []
    for _, node in todo:
        await ctx.client.cordon_node(node, TAINT)
        record = ctx.index.nodes.get(node)
        if record is not None:
            # The node watch will say the same shortly; placement in this very reconcile must
            # already avoid the node.
            record.cordon()
        if node not in nodes:
            nodes.append(node)
            ctx.post_event(body, "Warning", "Cordoned",
                           f"node {node} cordoned (spec.unschedulable, taint {TAINT_KEY}:NoSchedule) "
                           "by remediation S4")
    meta = body["metadata"]
    await ctx.client.patch_status(PLURAL, meta["namespace"], meta["name"],
                                  {"cordonedVersion": max(v for v, _ in todo)})
    return nodes
