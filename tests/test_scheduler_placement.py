"""Gang placement and the snapshot it runs against: table cases plus hypothesis invariants."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.scheduler import placement, snapshot
from huorn.scheduler.placement import NodeView, Placement, Unplaceable


def build_nodes(*free: int, total: int = 8, vc: str = "", prefix: str = "n") -> list[NodeView]:
    return [NodeView(f"{prefix}{i}", total, f, virtual_cluster=vc) for i, f in enumerate(free)]


def test_gang_fits_on_one_node_takes_the_tightest() -> None:
    result = placement.place_gang(build_nodes(8, 4, 6), replicas=2, gpus_per_replica=2)
    assert result == Placement(["n1", "n1"])


def test_gang_spans_fewest_nodes_largest_first() -> None:
    result = placement.place_gang(build_nodes(2, 8, 4, 6), replicas=6, gpus_per_replica=2)
    assert isinstance(result, Placement)
    assert result.nodes_spanned == 2
    assert Counter(result.assignments) == {"n1": 4, "n2": 2}  # 8 GPUs on n1, the rest on the tightest fit


def test_all_or_none_when_short() -> None:
    result = placement.place_gang(build_nodes(3, vc="a"), replicas=4, gpus_per_replica=2,
                                  virtual_cluster="a", borrow_limit=2)
    assert isinstance(result, Unplaceable)
    assert "needs 8 GPUs" in result.reason
    assert "virtual cluster a" in result.reason
    assert "3 free" in result.reason
    assert "borrowing limit 2" in result.reason


def test_fragmentation_is_named() -> None:
    result = placement.place_gang(build_nodes(3, 3, 3), replicas=1, gpus_per_replica=4)
    assert isinstance(result, Unplaceable)
    assert "no node has 4 free GPUs in one piece (largest 3)" in result.reason


def test_cordoned_and_selector_are_respected() -> None:
    nodes = [
        NodeView("a", 8, 8, cordoned=True),
        NodeView("b", 8, 8, labels={"gpu": "h200"}),
        NodeView("c", 8, 8, labels={"gpu": "a10"}),
    ]
    result = placement.place_gang(nodes, replicas=2, gpus_per_replica=4, node_selector={"gpu": "h200"})
    assert result == Placement(["b", "b"])
    blocked = placement.place_gang(nodes[:1], replicas=1, gpus_per_replica=1)
    assert isinstance(blocked, Unplaceable) and "1 node(s) cordoned" in blocked.reason


def test_cpu_limits_replicas_per_node() -> None:
    nodes = [NodeView("a", 8, 8, cpu_free_milli=8000), NodeView("b", 8, 8, cpu_free_milli=64000)]
    result = placement.place_gang(nodes, replicas=4, gpus_per_replica=1, cpu_milli_per_replica=4000)
    assert result == Placement(["b"] * 4)


def test_borrowing_takes_own_first_then_within_limits() -> None:
    nodes = build_nodes(4, vc="train", prefix="t") + build_nodes(8, 8, vc="infer", prefix="i")
    ok = placement.place_gang(nodes, replicas=8, gpus_per_replica=1, virtual_cluster="train",
                              borrow_limit=4, lend_limits={"infer": 6})
    assert isinstance(ok, Placement)
    assert Counter(ok.assignments) == {"t0": 4, "i0": 4} or Counter(ok.assignments) == {"t0": 4, "i1": 4}
    too_much = placement.place_gang(nodes, replicas=9, gpus_per_replica=1, virtual_cluster="train",
                                    borrow_limit=4, lend_limits={"infer": 6})
    assert isinstance(too_much, Unplaceable)
    not_lent = placement.place_gang(nodes, replicas=5, gpus_per_replica=1, virtual_cluster="train",
                                    borrow_limit=4)
    assert isinstance(not_lent, Unplaceable) and "lendable by other virtual clusters 0" in not_lent.reason


def test_bad_node_is_rejected_with_the_field() -> None:
    with pytest.raises(ValueError, match="gpus_free"):
        NodeView("x", 4, 5)
    with pytest.raises(ValueError, match="replicas"):
        placement.place_gang(build_nodes(8), replicas=0, gpus_per_replica=1)


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeView], int, int]:
    count = draw(st.integers(1, 12))
    nodes = []
    for i in range(count):
        total = draw(st.sampled_from([1, 2, 4, 8]))
        nodes.append(NodeView(f"n{i}", total, draw(st.integers(0, total)), cordoned=draw(st.booleans())
                              and draw(st.booleans())))
    return nodes, draw(st.integers(1, 16)), draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=200, deadline=None)
@given(clusters())
def test_placement_is_all_or_none_within_capacity_and_minimal(case: tuple[list[NodeView], int, int]) -> None:
    nodes, replicas, per = case
    result = placement.place_gang(nodes, replicas, per)
    usable = [n for n in nodes if not n.cordoned]
    slots = sorted((n.gpus_free // per for n in usable), reverse=True)
    if sum(slots) < replicas:
        assert isinstance(result, Unplaceable)
        return
    assert isinstance(result, Placement)
    assert len(result.assignments) == replicas
    by_name = {n.name: n for n in nodes}
    for name, gpus in result.gpus_by_node(per).items():
        assert not by_name[name].cordoned
        assert gpus <= by_name[name].gpus_free
    # Minimal span: no fewer nodes could hold the gang.
    fewest = next(k for k in range(1, len(slots) + 1) if sum(slots[:k]) >= replicas)
    assert result.nodes_spanned == fewest


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 4]), st.sampled_from(["a", "b"])),
                min_size=1, max_size=15),
       st.integers(0, 16), st.integers(0, 16), st.booleans())
def test_snapshot_never_breaks_lend_or_borrow_limits(
    jobs: list[tuple[int, int, str]], lend_b: int, borrow_a: int, lendable_b: bool
) -> None:
    """`lendable` is drawn apart from the limit: a cluster marked not lendable, whatever its
    maxGPUsLent, lends nothing (a snapshot that read the limit alone passed)."""
    nodes = build_nodes(8, 8, vc="a", prefix="a") + build_nodes(8, 8, 8, vc="b", prefix="b")
    vcs = [snapshot.VirtualClusterView("a", max_gpus_borrowed=borrow_a),
           snapshot.VirtualClusterView("b", lendable=lendable_b, max_gpus_lent=lend_b)]
    snap = snapshot.ClusterSnapshot(nodes, vcs)
    for i, (replicas, per, vc) in enumerate(jobs):
        where = snap.place(vc, replicas, per)
        if isinstance(where, Placement):
            snap.assume(f"j{i}", vc, where, per)
        assert snap.borrowed("a") <= borrow_a
        assert snap.lent("b") <= (lend_b if lendable_b else 0)
        assert snap.lent("a") == 0  # a does not lend
        assert all(n.gpus_free >= 0 for n in snap.node_views())
    used = sum(sum(b.gpus_by_node.values()) for b in snap.bindings().values())
    assert used + snap.free() == 40


def test_snapshot_simulate_undoes_everything() -> None:
    snap = snapshot.ClusterSnapshot(build_nodes(8, 8, vc="a"), [snapshot.VirtualClusterView("a")])
    first = snap.place("a", 2, 4)
    assert isinstance(first, Placement)
    snap.assume("keep", "a", first, 4)
    before = (snap.node_views(), snap.bindings())
    with snap.simulate():
        snap.forget("keep")
        trial = snap.place("a", 4, 4)
        assert isinstance(trial, Placement)
        snap.assume("trial", "a", trial, 4)
        assert snap.free() == 0
    assert (snap.node_views(), snap.bindings()) == before
    assert snap.free() == 8
    with pytest.raises(ValueError, match="already bound"):
        snap.assume("keep", "a", first, 4)


def test_snapshot_rejects_unknown_virtual_cluster() -> None:
    with pytest.raises(ValueError, match="virtual_cluster 'x'"):
        snapshot.ClusterSnapshot([NodeView("n", 8, 8, virtual_cluster="x")], [])


def test_single_node_may_borrow_a_whole_lender_node_within_the_limits() -> None:
    nodes = build_nodes(2, 2, 2, vc="train", prefix="t") + build_nodes(8, vc="infer", prefix="i")
    limits = {"virtual_cluster": "train", "borrow_limit": 8, "lend_limits": {"infer": 8}}
    spread = placement.place_gang(nodes, 6, 1, **limits)  # type: ignore[arg-type]
    assert isinstance(spread, Placement) and spread.nodes_spanned == 3  # own cluster first
    whole = placement.place_gang(nodes, 6, 1, single_node=True, **limits)  # type: ignore[arg-type]
    assert isinstance(whole, Placement) and whole.assignments == ["i0"] * 6
    # A limit below the gang's size keeps it off the lender.
    for borrow, lend in ((4, 8), (8, 4)):
        none = placement.place_gang(nodes, 6, 1, virtual_cluster="train", borrow_limit=borrow,
                                    lend_limits={"infer": lend}, single_node=True)
        assert isinstance(none, Unplaceable) and "single node" in none.reason
    mixed = build_nodes(8, 3, vc="train", prefix="t") + build_nodes(8, vc="infer", prefix="i")
    own = placement.place_gang(mixed, 3, 1, single_node=True, **limits)  # type: ignore[arg-type]
    assert isinstance(own, Placement) and own.assignments == ["t1"] * 3  # tightest own node first


def test_a_resized_gang_keeps_every_replica_the_new_placement_has_room_for() -> None:
    running = {"trainer-0": "a", "trainer-1": "a", "trainer-2": "b"}
    # grow 3 → 4 onto b and c: both replicas on a leave (a has none in the new gang), b's stays
    assert placement.match_replicas(running, ["b", "b", "c", "c"]) == (["trainer-0", "trainer-1"],
                                                                        ["b", "c", "c"])
    # a grow where the gang runs: nothing leaves
    assert placement.match_replicas(running, ["a", "a", "b", "b"]) == ([], ["b"])
    # a shrink by one of a's replicas: the later name goes (by number: trainer-10 after trainer-2)
    assert placement.match_replicas(running, ["a", "b"]) == (["trainer-1"], [])
    assert placement.match_replicas({"trainer-10": "a", "trainer-2": "a"}, ["a"]) == (["trainer-10"], [])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from([f"r{i}" for i in range(8)]), st.sampled_from("abcd"), max_size=8),
       st.lists(st.sampled_from("abcd"), max_size=10))
def test_matching_a_gang_to_its_placement_gives_that_placement(running: dict[str, str], target: list[str]
                                                                ) -> None:
    leaving, new_nodes = placement.match_replicas(running, target)
    staying = [node for name, node in running.items() if name not in leaving]
    assert Counter(staying + new_nodes) == Counter(target)
    # no node both loses a replica and gains one, and nothing leaves that the placement could keep
    assert not {running[name] for name in leaving} & set(new_nodes)
    assert len(leaving) == len(running) - sum((Counter(running.values()) & Counter(target)).values())


def test_place_at_takes_the_named_nodes_only_while_free_and_within_the_limits() -> None:
    snap = snapshot.ClusterSnapshot(
        [NodeView("t0", 4, 4, virtual_cluster="train"), NodeView("i0", 8, 8, virtual_cluster="infer"),
         NodeView("t1", 4, 4, virtual_cluster="train", cordoned=True)],
        [snapshot.VirtualClusterView("train", max_gpus_borrowed=8),
         snapshot.VirtualClusterView("infer", purpose="inference", lendable=True, max_gpus_lent=2)])
    assert snap.place_at("train", ["t0", "t0", "i0"], 2) == Placement(["t0", "t0", "i0"])
    assert snap.place_at("train", ["t0", "t0"], 2) == Placement(["t0", "t0"])
    assert isinstance(snap.place_at("train", ["t0"] * 3, 2), Unplaceable)  # 6 GPUs on a node of 4
    assert "limits" in snap.place_at("train", ["i0", "i0"], 2).reason  # type: ignore[union-attr]
    assert "cordoned" in snap.place_at("train", ["t1"], 1).reason  # type: ignore[union-attr]
    assert "gone" in snap.place_at("train", ["x9"], 1).reason  # type: ignore[union-attr]


def test_a_gang_with_a_node_selector_goes_on_its_nodes_and_the_reason_counts_only_those() -> None:
    nodes = [NodeView("h0", 8, 8, labels={"gpu": "h100"}, virtual_cluster="a"),
             NodeView("t0", 8, 8, labels={"gpu": "t4"}, virtual_cluster="a")]
    where = placement.place_gang(nodes, 2, 4, virtual_cluster="a", node_selector={"gpu": "t4"})
    assert isinstance(where, Placement) and where.assignments == ["t0", "t0"]
    refused = placement.place_gang(nodes, 3, 4, virtual_cluster="a", node_selector={"gpu": "t4"})
    assert isinstance(refused, Unplaceable)
    assert refused.reason.startswith("needs 12 GPUs (3 replicas × 4) in virtual cluster a on nodes labelled "
                                     "gpu=t4 (spec.nodeSelector), 8 free")

    # a selector no node carries says so, rather than "0 free" (a typo in a label is not a busy cluster)
    nowhere = placement.place_gang(nodes, 1, 4, virtual_cluster="a", node_selector={"gpu": "h100x"})
    assert isinstance(nowhere, Unplaceable)
    assert nowhere.reason == ("no node of virtual cluster a, nor of one it may borrow from, carries "
                              "gpu=h100x (spec.nodeSelector): label nodes so, or change the selector")


def test_gpus_a_cluster_keeps_for_its_own_waiting_jobs_are_not_lent() -> None:
    """l0 of lender `a` keeps 4 of its 8 free GPUs (a waiting job of `a` selects it): `a` itself
    may place there, a borrower from `b` only on the other 4, in place_gang and in place_at."""
    nodes = [NodeView("l0", 8, 8, virtual_cluster="a", kept=4)]
    mine = placement.place_gang(nodes, 2, 4, virtual_cluster="a")
    assert isinstance(mine, Placement) and mine.assignments == ["l0", "l0"]
    borrowed = placement.place_gang(nodes, 1, 4, virtual_cluster="b", borrow_limit=8, lend_limits={"a": 8})
    assert isinstance(borrowed, Placement) and borrowed.assignments == ["l0"]
    too_much = placement.place_gang(nodes, 2, 4, virtual_cluster="b", borrow_limit=8, lend_limits={"a": 8})
    assert isinstance(too_much, Unplaceable)
    snap = snapshot.ClusterSnapshot(nodes, [snapshot.VirtualClusterView("a", lendable=True, max_gpus_lent=8),
                                            snapshot.VirtualClusterView("b", max_gpus_borrowed=8)])
    assert isinstance(snap.place_at("b", ["l0"], 4), Placement)
    assert isinstance(snap.place_at("b", ["l0", "l0"], 4), Unplaceable)
    assert isinstance(snap.place_at("a", ["l0", "l0"], 4), Placement)
