"""Gang placement: put every replica of a job on a node, or none of them.

A gang that starts with part of its replicas holds GPUs while it waits for the rest, and two such
half-placed gangs can deadlock each other; so placement is all-or-none and either returns a full
assignment or a reason a person can act on ("needs 8 GPUs in virtual cluster a, 3 free; borrowing
limit 2").

Packing is best fit that minimises the nodes a gang spans: data-parallel traffic across nodes is
what makes a replica slow (the Pollux inter-node β), and leaving nodes whole keeps room for the
next 8-GPU gang (the fragmentation that the OpenB paper measures). The job's own virtual cluster is
filled first; GPUs of other virtual clusters are borrowed only for the remainder and only within
the borrower's borrowing limit and each lender's lending limit.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class NodeView:
    """What placement needs to know about one node; the operator fills it from the Node object."""

    name: str
    gpus_total: int
    gpus_free: int
    labels: Mapping[str, str] = field(default_factory=dict)
    virtual_cluster: str = ""
    cordoned: bool = False  # takes no new pods: cordoned, not Ready, or tainted (see `unavailable`)
    unavailable: str = ""  # why it takes none, when not simply cordoned: "not Ready (Unknown)", a taint
    cpu_free_milli: int | None = None  # None: CPU is not a constraint on this node
    gpu_type: str = ""
    # Free GPUs its own cluster keeps for its waiting jobs that select this node (a nodeSelector):
    # its own jobs may take them, other clusters' may not borrow them. A lender's reserve is a
    # count over all its nodes, so a borrower's successor took back the selected node a reclaim
    # had just freed, and the lender reclaimed it again, in a loop (index.build_snapshot).
    kept: int = 0

    def __post_init__(self) -> None:
        if self.gpus_total < 0:
            raise ValueError(f"node {self.name}: gpus_total must be ≥ 0, got {self.gpus_total}")
        if not 0 <= self.gpus_free <= self.gpus_total:
            raise ValueError(
                f"node {self.name}: gpus_free must lie in 0..gpus_total ({self.gpus_total}), "
                f"got {self.gpus_free}"
            )


@dataclass(frozen=True)
class Placement:
    """assignments[i] is the node of replica i; replicas on one node are adjacent."""

    assignments: list[str]

    @property
    def nodes_spanned(self) -> int:
        return len(set(self.assignments))

    def gpus_by_node(self, gpus_per_replica: int) -> dict[str, int]:
        """GPUs this placement takes from each node, which is what a snapshot subtracts."""
        used: dict[str, int] = {}
        for node in self.assignments:
            used[node] = used.get(node, 0) + gpus_per_replica
        return used


@dataclass(frozen=True)
class Unplaceable:
    reason: str


def selector_labels(selector: Mapping[str, str]) -> str:
    """A nodeSelector as kubectl's `-l` writes it: gpu=h100,zone=z1."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))


def labels_match(labels: Mapping[str, str], selector: Mapping[str, str] | None) -> bool:
    """Whether `labels` hold every label of a nodeSelector (None or empty: any labels do)."""
    return not selector or all(labels.get(k) == v for k, v in selector.items())


def fits_selector(node: NodeView, selector: Mapping[str, str] | None) -> bool:
    """Whether the node carries every label of a job's nodeSelector (None or empty: any node)."""
    return labels_match(node.labels, selector)


def _replica_slots(node: NodeView, gpus_per_replica: int, cpu_milli: int) -> int:
    """How many replicas of this shape the node can still hold."""
    by_gpu = node.gpus_free // gpus_per_replica if gpus_per_replica else 1 << 30
    if cpu_milli and node.cpu_free_milli is not None:
        return min(by_gpu, node.cpu_free_milli // cpu_milli)
    return by_gpu


def _pack_fewest_nodes(slots: list[tuple[str, int]], replicas: int) -> list[tuple[str, int]]:
    """Take the fewest nodes that hold `replicas`, finishing on the tightest node that fits.

    The k largest nodes always hold the most that any k nodes can, so taking them in descending
    order gives the minimum count; the last one is swapped for the smallest node that still
    covers the remainder, which is best fit and leaves big nodes whole for big gangs.
    """
    ordered = sorted((s for s in slots if s[1] > 0), key=lambda s: (-s[1], s[0]))
    chosen: list[tuple[str, int]] = []
    left = replicas
    for i, (name, cap) in enumerate(ordered):
        if left <= 0:
            break
        if cap >= left:
            # Best fit for the remainder among the nodes not yet taken.
            tight = min((s for s in ordered[i:] if s[1] >= left), key=lambda s: (s[1], s[0]))
            chosen.append((tight[0], left))
            return chosen
        chosen.append((name, cap))
        left -= cap
    return chosen if left <= 0 else []


def place_gang(
    nodes: Iterable[NodeView],
    replicas: int,
    gpus_per_replica: int,
    cpu_milli_per_replica: int = 0,
    *,
    virtual_cluster: str = "",
    node_selector: Mapping[str, str] | None = None,
    borrow_limit: int = 0,
    lend_limits: Mapping[str, int] | None = None,
    single_node: bool = False,
) -> Placement | Unplaceable:
    """Place all `replicas` or none.

    `virtual_cluster` is the job's own cluster ("" means every node counts as its own, as on a
    cluster without virtual clusters). `borrow_limit` caps the GPUs the job may take from other
    virtual clusters, and `lend_limits[vc]` caps what each other cluster may still lend; a
    cluster missing from `lend_limits` lends nothing.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be ≥ 1, got {replicas}")
    if gpus_per_replica < 0:
        raise ValueError(f"gpus_per_replica must be ≥ 0, got {gpus_per_replica}")
    lend_limits = lend_limits or {}
    need = replicas * gpus_per_replica
    own: list[tuple[str, int]] = []
    foreign: dict[str, list[tuple[str, int]]] = {}
    foreign_free: dict[str, int] = {}  # free GPUs on other clusters' nodes: a lending limit lends no more
    cordoned = 0
    down: list[str] = []  # "node: why" of nodes taking no pods for another reason than a cordon
    own_free = 0
    largest_own = 0
    matched = 0
    for node in nodes:
        if not fits_selector(node, node_selector):
            continue
        matched += 1
        if node.cordoned:
            if node.unavailable and node.unavailable != "cordoned":
                down.append(f"{node.name}: {node.unavailable}")
            else:
                cordoned += 1
            continue
        if not virtual_cluster or node.virtual_cluster == virtual_cluster:
            own.append((node.name, _replica_slots(node, gpus_per_replica, cpu_milli_per_replica)))
            own_free += node.gpus_free
            largest_own = max(largest_own, node.gpus_free)
        else:
            lendable = node if not node.kept else replace(node, gpus_free=max(0, node.gpus_free - node.kept))
            slots = _replica_slots(lendable, gpus_per_replica, cpu_milli_per_replica)
            foreign.setdefault(node.virtual_cluster, []).append((node.name, slots))
            vc_free = foreign_free.get(node.virtual_cluster, 0)
            foreign_free[node.virtual_cluster] = vc_free + lendable.gpus_free

    if node_selector and not matched:
        # "0 free" would read as a busy cluster; a typo in a label reads the same
        where = f"virtual cluster {virtual_cluster}" if virtual_cluster else "the cluster"
        return Unplaceable(f"no node of {where}, nor of one it may borrow from, carries "
                           f"{selector_labels(node_selector)} (spec.nodeSelector): label nodes so, or "
                           "change the selector")
    if single_node:
        # The whole gang on one node, its own cluster's or a lender's (within both limits): the
        # tightest that fits, own nodes first on a tie.
        fits = [(slots, 0, name) for name, slots in own if slots >= replicas]
        if need <= borrow_limit:
            fits += [(slots, 1, name) for vc, vc_slots in foreign.items() if need <= lend_limits.get(vc, 0)
                     for name, slots in vc_slots if slots >= replicas]
        if fits:
            return Placement([min(fits)[2]] * replicas)
        return Unplaceable(f"no single node holds {replicas} replicas × {gpus_per_replica} GPUs")

    own_slots = sum(s for _, s in own)
    if own_slots >= replicas:
        return Placement(_expand(_pack_fewest_nodes(own, replicas)))

    # Own cluster is short: use all of it, then borrow the remainder within both limits.
    chosen = [(n, s) for n, s in own if s > 0]
    left = replicas - own_slots
    borrow_left = borrow_limit // gpus_per_replica if gpus_per_replica else left
    candidates: list[tuple[str, int]] = []
    lendable_gpus = 0
    for vc, vc_slots in sorted(foreign.items()):
        vc_left = lend_limits.get(vc, 0) // gpus_per_replica if gpus_per_replica else left
        lendable_gpus += min(lend_limits.get(vc, 0), foreign_free.get(vc, 0))
        for name, cap in sorted(vc_slots, key=lambda s: (-s[1], s[0])):
            take = min(cap, vc_left)
            if take > 0:
                candidates.append((name, take))
                vc_left -= take
    borrowable = min(borrow_left, sum(s for _, s in candidates))
    if left <= borrowable:
        chosen += _pack_fewest_nodes(candidates, left)
        return Placement(_expand(chosen))
    return Unplaceable(
        _explain(
            need, gpus_per_replica, virtual_cluster, own_free, own_slots, largest_own, cordoned,
            borrow_limit, lendable_gpus, cpu_milli_per_replica, down, node_selector,
        )
    )


def match_replicas(running: Mapping[str, str], target: Sequence[str]) -> tuple[list[str], list[str]]:
    """How a running gang becomes the gang the allocator placed: (the replicas that leave, the
    nodes of the new ones). `running` maps each replica to its node; `target` has one node per
    replica of the new gang. As many replicas as possible stay where they run: a replica only
    leaves a node where the new gang has fewer, so no node both loses and gains one. Which of a
    node's replicas leave goes by name (the later ones), so a decision taken again after a
    restart names the same ones."""
    room = Counter(target)
    leaving: list[str] = []
    for name in sorted(running, key=_natural):
        node = running[name]
        if room[node] > 0:
            room[node] -= 1
        else:
            leaving.append(name)
    new_nodes: list[str] = []
    for node in target:
        if room[node] > 0:
            room[node] -= 1
            new_nodes.append(node)
    return leaving, new_nodes


def _natural(name: str) -> tuple[tuple[int, int | str], ...]:
    """trainer-2 before trainer-10 (and trainer-1-g1 after trainer-1): numbers as numbers."""
    return tuple((0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", name))


def _expand(chosen: list[tuple[str, int]]) -> list[str]:
    return [name for name, count in chosen for _ in range(count)]


def _explain(
    need: int, per: int, vc: str, own_free: int, own_slots: int, largest: int, cordoned: int,
    borrow_limit: int, lendable: int, cpu_milli: int, down: Sequence[str] = (),
    selector: Mapping[str, str] | None = None,
) -> str:
    where = f"in virtual cluster {vc}" if vc else "in the cluster"
    if selector:
        # the counts below are of these nodes only: "0 free" in a cluster with free GPUs elsewhere
        # must say why those do not count
        where += f" on nodes labelled {selector_labels(selector)} (spec.nodeSelector)"
    parts = [f"needs {need} GPUs ({need // per if per else 0} replicas × {per}) {where}, {own_free} free"]
    if own_slots * per < own_free:
        # Some free GPUs cannot hold a replica: say whether CPU or fragmentation is to blame.
        if cpu_milli and largest >= per:
            parts.append(f"CPU ({cpu_milli}m per replica) is short on the nodes with free GPUs")
        else:
            parts.append(f"but no node has {per} free GPUs in one piece (largest {largest})")
    if cordoned:
        parts.append(f"{cordoned} node(s) cordoned")
    if down:
        shown = ", ".join(down[:3]) + (f" and {len(down) - 3} more" if len(down) > 3 else "")
        parts.append(f"{len(down)} node(s) taking no new pods ({shown})")
    if vc:
        parts.append(f"borrowing limit {borrow_limit}, lendable by other virtual clusters {lendable}")
    return "; ".join(parts)
