"""Priority preemption's victim choice: lower priority only, never pinned, minimal, fitting."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.scheduler import placement, preemption
from huorn.scheduler.preemption import Candidate
from huorn.scheduler.snapshot import ClusterSnapshot, VirtualClusterView


def build_snapshot(nodes: dict[str, int], jobs: dict[str, dict[str, int]],
                   vc: str = "train") -> ClusterSnapshot:
    snap = ClusterSnapshot([placement.NodeView(n, g, g, virtual_cluster=vc) for n, g in nodes.items()],
                           [VirtualClusterView(vc)])
    for job, by_node in jobs.items():
        where = placement.Placement([n for n, gpus in by_node.items() for _ in range(gpus)])
        snap.assume(job, vc, where, gpus_per_replica=1)
    snap.commit()
    return snap


def test_the_lowest_priority_newest_gang_goes_first_and_only_what_is_needed() -> None:
    snap = build_snapshot({"a": 4, "b": 4}, {"old-low": {"a": 2}, "new-low": {"a": 2}, "mid": {"b": 4}})
    candidates = [Candidate("old-low", 10, started=100.0), Candidate("new-low", 10, started=200.0),
                  Candidate("mid", 40, started=50.0)]
    # 2 GPUs: the newest of the lowest priority is enough.
    assert preemption.plan_preemption(snap, "train", 1, 2, 50, candidates).victims == ("new-low",)
    # 4 GPUs on one node: both low ones on node a, not the mid one on b.
    both = preemption.plan_preemption(snap, "train", 1, 4, 50, candidates)
    assert both is not None and set(both.victims) == {"new-low", "old-low"}
    # 8 GPUs: everyone.
    assert len(preemption.plan_preemption(snap, "train", 2, 4, 50, candidates).victims) == 3
    # The snapshot is as it was.
    assert snap.free("train") == 0


def test_elastic_victims_shrink_before_anyone_is_stopped() -> None:
    snap = build_snapshot({"a": 4, "b": 4}, {"elastic": {"a": 3}, "fixed": {"a": 1}, "mid": {"b": 4}})
    surplus = (("trainer-2", "a", 1), ("trainer-1", "a", 1))  # 3 replicas of 1 GPU, minimum 1
    candidates = [Candidate("elastic", 10, 0.0, surplus), Candidate("fixed", 10, 5.0),
                  Candidate("mid", 40, 0.0)]
    # 1 GPU: the newer fixed gang would go whole, but the elastic one gives up a replica instead.
    one = preemption.plan_preemption(snap, "train", 1, 1, 50, candidates)
    assert one == preemption.Plan((), (("elastic", ("trainer-2",)),))
    two = preemption.plan_preemption(snap, "train", 1, 2, 50, candidates)
    assert two == preemption.Plan((), (("elastic", ("trainer-2", "trainer-1")),))
    # 3 on one node: shrinking to the minimum leaves 2, so whole gangs go, and nobody shrinks.
    three = preemption.plan_preemption(snap, "train", 1, 3, 50, candidates)
    assert three is not None and three.shrinks == () and set(three.victims) == {"elastic"}
    assert snap.free("train") == 0


def test_equal_higher_and_pinned_priorities_are_never_victims() -> None:
    snap = build_snapshot({"a": 4}, {"peer": {"a": 2}, "pinned": {"a": 2}})
    candidates = [Candidate("peer", 50, 0.0), Candidate("pinned", 100, 0.0)]
    assert preemption.plan_preemption(snap, "train", 1, 2, 50, candidates) is None
    assert preemption.plan_preemption(snap, "train", 1, 2, 1000, candidates).victims == ("peer",)
    assert preemption.plan_preemption(snap, "train", 1, 4, 1000, candidates) is None


def test_a_gang_that_fits_once_the_stopping_jobs_are_gone_preempts_nobody_more() -> None:
    snap = build_snapshot({"a": 4}, {"going": {"a": 2}, "low": {"a": 2}})
    candidates = [Candidate("low", 10, 0.0)]
    assert preemption.plan_preemption(snap, "train", 1, 2, 50, candidates, stopping=["going"]).victims == ()
    assert preemption.plan_preemption(snap, "train", 1, 4, 50, candidates, stopping=["going"]).victims == (
        "low",)


@settings(max_examples=150)
@given(
    gpus=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    jobs=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 4), st.integers(0, 150), st.integers(0, 9)),
                  max_size=8),
    want=st.tuples(st.integers(1, 3), st.integers(1, 4), st.integers(0, 150)),
)
def test_victims_are_eligible_sufficient_and_minimal(gpus: list[int], jobs: list[tuple[int, int, int, int]],
                                                     want: tuple[int, int, int]) -> None:
    nodes = {f"n{i}": g for i, g in enumerate(gpus)}
    free = dict(nodes)
    placed: dict[str, dict[str, int]] = {}
    candidates = []
    for k, (node_index, size, priority, started) in enumerate(jobs):
        node = f"n{node_index % len(gpus)}"
        take = min(size, free[node])
        if take == 0:
            continue
        free[node] -= take
        placed[f"j{k}"] = {node: take}
        # Replicas of 1 GPU; odd jobs are elastic down to one replica.
        surplus = tuple((f"r{r}", node, 1) for r in range(take - 1, 0, -1)) if k % 2 else ()
        candidates.append(Candidate(f"j{k}", priority, float(started), surplus))
    snap = build_snapshot(nodes, placed)
    replicas, per_replica, priority = want
    plan = preemption.plan_preemption(snap, "train", replicas, per_replica, priority, candidates)
    by_name = {c.job: c for c in candidates}

    def fits_without(victims: list[str], shrunk: dict[str, int] | None = None) -> bool:
        with snap.simulate():
            for v in victims:
                snap.forget(v)
            for job_name, count in (shrunk or {}).items():
                (node, held), = placed[job_name].items()
                snap.forget(job_name)
                snap.assume(job_name, "train", placement.Placement([node] * (held - count)), 1)
            return isinstance(snap.place("train", replicas, per_replica), placement.Placement)

    eligible = [c.job for c in candidates if preemption.is_preemptible(c.priority, priority)]
    if plan is None:
        assert not fits_without(eligible), "a plan existed: every eligible victim was enough"
        return
    if plan == preemption.Plan(()):
        assert fits_without([]), "nothing to do only when the gang fits already"
        return
    if plan.shrinks:
        assert plan.victims == ()
        shrunk = {job_name: len(names) for job_name, names in plan.shrinks}
        assert all(preemption.is_preemptible(by_name[j].priority, priority) for j in shrunk)
        assert all(n <= len(by_name[j].surplus) for j, n in shrunk.items()), "never below the minimum"
        assert fits_without([], shrunk)
        last_job, last_names = plan.shrinks[-1]
        assert not fits_without([], {**shrunk, last_job: len(last_names) - 1}), "the last replica was needed"
        return
    # Whole gangs only when no shrink is enough.
    everything = {c.job: len(c.surplus) for c in candidates if c.surplus
                  and preemption.is_preemptible(c.priority, priority)}
    assert not fits_without([], everything)
    assert all(preemption.is_preemptible(by_name[v].priority, priority) for v in plan.victims)
    assert fits_without(list(plan.victims))
    for v in plan.victims:
        assert not fits_without([w for w in plan.victims if w != v]), f"{v} was not needed"


def test_a_gang_that_borrows_nothing_preempts_on_its_own_nodes() -> None:
    """An RLJob's Ray workers never borrow: GPUs free on a lending cluster do not make them fit,
    so a plan for such a gang stops a job on its own nodes where a borrowing gang needs nobody."""
    nodes = [placement.NodeView("own", 4, 4, virtual_cluster="rl"),
             placement.NodeView("lender", 4, 4, virtual_cluster="serve")]
    lender = VirtualClusterView("serve", purpose="inference", lendable=True, max_gpus_lent=4)
    snap = ClusterSnapshot(nodes, [VirtualClusterView("rl", max_gpus_borrowed=4), lender])
    snap.assume("low", "rl", placement.Placement(["own"] * 4), gpus_per_replica=1)
    snap.commit()
    candidates = [Candidate("low", 10, started=100.0)]
    assert isinstance(snap.place("rl", 2, 2), placement.Placement)
    assert isinstance(snap.place("rl", 2, 2, borrow=False), placement.Unplaceable)
    assert preemption.plan_preemption(snap, "rl", 2, 2, 50, candidates) == preemption.Plan(())
    own = preemption.plan_preemption(snap, "rl", 2, 2, 50, candidates, borrow=False)
    assert own is not None and own.victims == ("low",)
    # and a gang that does not fit its own nodes even when they are empty preempts nobody
    assert preemption.plan_preemption(snap, "rl", 3, 2, 50, candidates, borrow=False) is None


def test_a_gang_with_a_node_selector_stops_only_what_frees_its_nodes() -> None:
    """Nodes h (H100) and t (T4) are full, h with the newer low job, t with the newest: a gang
    that selects the H100s is helped by stopping only the job on h, and by nothing if no such
    node would do."""
    nodes = [placement.NodeView("h", 4, 4, labels={"gpu": "h100"}, virtual_cluster="train"),
             placement.NodeView("t", 4, 4, labels={"gpu": "t4"}, virtual_cluster="train")]
    snap = ClusterSnapshot(nodes, [VirtualClusterView("train")])
    snap.assume("on-h", "train", placement.Placement(["h"] * 4), gpus_per_replica=1)
    snap.assume("on-t", "train", placement.Placement(["t"] * 4), gpus_per_replica=1)
    snap.commit()
    candidates = [Candidate("on-h", 10, started=100.0), Candidate("on-t", 10, started=200.0)]
    assert preemption.plan_preemption(snap, "train", 2, 2, 50, candidates).victims == ("on-t",)
    plan = preemption.plan_preemption(snap, "train", 2, 2, 50, candidates, node_selector={"gpu": "h100"})
    assert plan is not None and plan.victims == ("on-h",)
    nowhere = {"gpu": "a100"}
    assert preemption.plan_preemption(snap, "train", 1, 2, 50, candidates, node_selector=nowhere) is None
