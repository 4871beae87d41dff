"""The goodput allocator: invariants on random clusters and job mixes, plus behaviour cases."""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from huorn.scheduler import allocator, goodput, perfmodel, snapshot
from huorn.scheduler.placement import NodeView, Placement

SCALES_WELL = perfmodel.PolluxParams(0.01, 0.01, 0.01, 0.0005, 0.05, 0.002, 3.0)
SCALES_BADLY = perfmodel.PolluxParams(0.01, 0.001, 0.3, 0.05, 1.0, 0.2, 1.0)


def build_perf(params: perfmodel.PolluxParams) -> perfmodel.PerfModel:
    return perfmodel.PerfModel("transformer", prior=params)


def build_snapshot(train_nodes: int = 2, infer_nodes: int = 0, lend: int = 0, borrow: int = 0,
                   lendable: bool | None = None) -> snapshot.ClusterSnapshot:
    """`lendable` defaults to `lend > 0`; given, it is the flag whatever the limit."""
    # GPU products alternate on the training nodes (t0 h100, t1 t4, ...), for jobs that select one
    nodes = [NodeView(f"t{i}", 8, 8, virtual_cluster="train", labels={"gpu": ("h100", "t4")[i % 2]})
             for i in range(train_nodes)]
    nodes += [NodeView(f"i{i}", 8, 8, virtual_cluster="infer", labels={"gpu": "h100"})
              for i in range(infer_nodes)]
    lendable = lend > 0 if lendable is None else lendable
    vcs = [snapshot.VirtualClusterView("train", max_gpus_borrowed=borrow),
           snapshot.VirtualClusterView("infer", purpose="inference", lendable=lendable, max_gpus_lent=lend)]
    return snapshot.ClusterSnapshot(nodes, vcs)


def build_job(name: str, params: perfmodel.PolluxParams = SCALES_WELL, **kw: object) -> allocator.JobView:
    defaults = {"virtual_cluster": "train", "min_replicas": 1, "max_replicas": 16, "noise_scale": 4096.0,
                "base_batch": 32.0}
    defaults.update(kw)
    return allocator.JobView(name, perf=build_perf(params), **defaults)  # type: ignore[arg-type]


def test_gpus_go_where_they_add_most_goodput() -> None:
    snap = build_snapshot()
    decisions = allocator.Allocator().allocate(snap, [build_job("good"), build_job("bad", SCALES_BADLY)], 0)
    got = {d.job: d for d in decisions}
    assert got["good"].replicas > got["bad"].replicas >= 1
    assert got["good"].replicas + got["bad"].replicas <= 16
    assert got["good"].lr_scale is not None and got["good"].lr_scale > 1


def test_low_noise_scale_keeps_batches_small() -> None:
    """A job whose gradient noise is small gains little from a bigger batch, so it gets fewer GPUs."""
    snap = build_snapshot()
    jobs = [build_job("noisy"), build_job("quiet", noise_scale=8.0)]
    got = {d.job: d for d in allocator.Allocator().allocate(snap, jobs, 0)}
    assert got["noisy"].replicas > got["quiet"].replicas


def test_priority_preempts_lower_and_pinned_jobs_are_never_shrunk() -> None:
    snap = build_snapshot(train_nodes=1)
    alloc = allocator.Allocator()
    low = build_job("low", min_replicas=8, max_replicas=8, priority=10)
    first = alloc.allocate(snap, [low], 0)
    assert first[0].action == "admit"
    low.replicas = 8
    high = build_job("high", min_replicas=4, max_replicas=4, priority=60, submitted=1)
    got = {d.job: d for d in alloc.allocate(snap, [low, high], 10)}
    assert got["low"].action == "preempt" and got["high"].action == "admit"
    assert "priority" in got["low"].reason

    snap2 = build_snapshot(train_nodes=1)
    pinned = build_job("pinned", min_replicas=2, max_replicas=8, priority=100)
    alloc.allocate(snap2, [pinned], 0)
    pinned.replicas = snap2.bindings()["pinned"].gpus_by_node["t0"]
    urgent = build_job("urgent", min_replicas=8, max_replicas=8, priority=900)
    got = {d.job: d for d in alloc.allocate(snap2, [pinned, urgent], 1000)}
    assert got["pinned"].replicas == pinned.replicas
    assert got["urgent"].action == "pending"


def test_restart_penalty_and_cooldown_prevent_flapping() -> None:
    snap = build_snapshot()
    alloc = allocator.Allocator(allocator.AllocatorConfig(cooldown_seconds=600))
    a = build_job("a")
    d = alloc.allocate(snap, [a], 0)[0]
    a.replicas, a.last_resize = d.replicas, 0.0
    b = build_job("b", max_replicas=2, submitted=5)
    # A small newcomer should not make `a` restart just to hand over a sliver of speedup.
    for t in (10.0, 700.0, 1400.0):
        got = {x.job: x for x in alloc.allocate(snap, [a, b], t)}
        assert got["a"].action in ("keep", "shrink")
        if got["a"].action == "shrink":
            a.replicas, a.last_resize = got["a"].replicas, t
        b.replicas = got["b"].replicas
        for x in (a, b):
            if x.name in snap.bindings() and x.replicas == 0:
                snap.forget(x.name)
    flips = alloc.allocate(snap, [a, b], 2000)
    assert {x.action for x in flips} == {"keep"}


def test_borrowing_uses_lent_gpus_only_within_limits() -> None:
    snap = build_snapshot(train_nodes=1, infer_nodes=2, lend=6, borrow=4)
    jobs = [build_job(f"j{i}", max_replicas=8) for i in range(3)]
    allocator.Allocator().allocate(snap, jobs, 0)
    assert snap.borrowed("train") <= 4 and snap.lent("infer") <= 4
    assert sum(sum(b.gpus_by_node.values()) for b in snap.bindings().values()) == 12


def test_adascale_gain_matches_efficiency() -> None:
    assert goodput.adascale_gain(1000.0, 32, 32) == pytest.approx(1.0)
    gain = goodput.adascale_gain(1000.0, 32, 128)
    assert gain == pytest.approx(4 * (1000 + 32) / (1000 + 128))
    assert 1 < gain < 4
    with pytest.raises(ValueError, match="noise_scale"):
        goodput.efficiency(-1.0, 32, 64)


@st.composite
def job_mixes(draw: st.DrawFn) -> tuple[snapshot.ClusterSnapshot, list[allocator.JobView], int, int]:
    lend = draw(st.integers(0, 16))
    borrow = draw(st.integers(0, 16))
    # lendable apart from the limit: a closed lender with maxGPUsLent > 0 must lend nothing
    snap = build_snapshot(draw(st.integers(1, 3)), draw(st.integers(0, 2)), lend, borrow,
                          lendable=draw(st.booleans()))
    jobs = []
    for i in range(draw(st.integers(1, 8))):
        lo = draw(st.integers(1, 4))
        jobs.append(build_job(
            f"j{i}", draw(st.sampled_from([SCALES_WELL, SCALES_BADLY])), min_replicas=lo,
            max_replicas=lo + draw(st.integers(0, 12)), gpus_per_replica=draw(st.sampled_from([1, 2, 4])),
            priority=draw(st.sampled_from([10, 50, 100])), submitted=float(i),
            noise_scale=draw(st.floats(0, 10000)),
            remaining_work=draw(st.one_of(st.none(), st.floats(0, 1e6))),
            resizes_in_place=draw(st.booleans()),  # priced in place, and tried around its replicas
            node_selector=draw(st.sampled_from([None, None, {"gpu": "h100"}, {"gpu": "t4"}]))))
    return snap, jobs, lend, borrow


CONFIGS = {"pollux-p1": allocator.AllocatorConfig(),
           "pollux-p-1": allocator.AllocatorConfig(fairness_p=-1.0),
           "pollux-p-1-fair": allocator.AllocatorConfig(fairness_p=-1.0, speedup_reference="fair_share"),
           "huorn": allocator.HUORN,
           "huorn-runtime": allocator.HUORN_RUNTIME,
           "huorn-keep-replicas": dataclasses.replace(allocator.HUORN, keep_replicas=True)}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@settings(max_examples=60, deadline=None)
@given(job_mixes(), st.lists(st.integers(0, 16), min_size=2, max_size=2),
       st.lists(st.booleans(), min_size=2, max_size=2))
def test_invariants_hold_over_successive_cycles(config: allocator.AllocatorConfig, case: tuple,
                                                later_lends: list[int], later_lendable: list[bool]) -> None:
    """Between cycles the lender's limit moves, as the loaning board moves it: the allocator may
    leave a borrower above a lowered limit (reclaiming it is the board's job, with a grace
    period), but it never adds GPUs on loan beyond the limit, and a lender not lendable lends
    nothing new whatever its maxGPUsLent (both were passed by a snapshot that ignored the flag)."""
    snap, jobs, lend, borrow = case
    alloc = allocator.Allocator(config)
    pinned_at: dict[str, int] = {}
    lendables = [snap.virtual_cluster("infer").lendable, *later_lendable]
    for cycle, (limit, lendable) in enumerate(zip([lend, *later_lends], lendables, strict=True)):
        lent_before = snap.lent("infer")
        held_before = {name: b.gpus_by_node for name, b in snap.bindings().items()}
        snap.set_virtual_cluster(snapshot.VirtualClusterView(
            "infer", purpose="inference", lendable=lendable, max_gpus_lent=limit))
        allowed = limit if lendable else 0
        decisions = alloc.allocate(snap, jobs, float(cycle * 1000))
        bindings = snap.bindings()
        newly_lent = sum(max(0, gpus - held_before.get(name, {}).get(node, 0))
                         for name, b in bindings.items() for node, gpus in b.gpus_by_node.items()
                         if node.startswith("i"))
        by_job = {d.job: d for d in decisions}
        assert set(by_job) == {j.name for j in jobs}
        for job in jobs:
            d = by_job[job.name]
            if d.replicas:
                assert job.min_replicas <= d.replicas <= job.max_replicas
                used = sum(bindings[job.name].gpus_by_node.values())
                assert used == d.replicas * job.gpus_per_replica
                assert len(d.assignments) == d.replicas
                labels = {n.name: n.labels for n in snap.node_views()}
                for node in bindings[job.name].gpus_by_node:  # only on the nodes it selects
                    assert all(labels[node].get(k) == v for k, v in (job.node_selector or {}).items())
            else:
                assert job.name not in bindings
            if job.name in pinned_at:
                assert d.replicas >= pinned_at[job.name]
        assert all(n.gpus_free >= 0 for n in snap.node_views())
        assert snap.borrowed("train") <= borrow
        assert snap.lent("infer") <= max(allowed, lent_before)
        if newly_lent:  # a loan kept above a lowered limit is allowed only if nothing new went out
            assert snap.lent("infer") <= allowed, (cycle, bindings)
        per_node = Counter[str]()
        for b in bindings.values():
            per_node.update(b.gpus_by_node)
        assert all(v <= 8 for v in per_node.values())
        for job in jobs:
            if job.replicas and by_job[job.name].replicas and job.remaining_work is not None:
                job.remaining_work = max(0.0, job.remaining_work - 1e5)  # it made progress
            job.replicas = by_job[job.name].replicas
            job.last_resize = float(cycle * 1000)
            if job.replicas and job.priority >= allocator.PINNED_PRIORITY:
                pinned_at[job.name] = job.replicas
        # Random new noise scales between cycles, as the runtime would report.
        for job in jobs:
            job.noise_scale = float(np.clip(job.noise_scale * 2, 0, 1e5))
            job.model_version += 1


def test_a_job_with_a_node_selector_runs_on_its_nodes_and_is_offered_no_more_than_they_hold() -> None:
    """t0 has h100s, t1 t4s. A job that scales well and selects h100 gets t0 whole; the greedy
    offered it more, which placement then cut to t0's 8, and the GPUs it had been counted on
    went unused that cycle. Capped at what its nodes hold, the other job gets t1."""
    def run(**good: object) -> dict[str, allocator.Decision]:
        jobs = [build_job("good", **good), build_job("bad", SCALES_BADLY)]
        return {d.job: d for d in allocator.Allocator().allocate(build_snapshot(), jobs, 0)}

    free = run()
    assert free["good"].replicas > 8  # it would take more than one node
    got = run(node_selector={"gpu": "h100"})
    assert got["good"].replicas == 8 and set(got["good"].assignments) == {"t0"}
    assert set(got["bad"].assignments) == {"t1"}
    assert got["bad"].replicas == run(max_replicas=8)["bad"].replicas > free["bad"].replicas
    assert allocator.selected_slots(build_snapshot(), build_job("x", node_selector={"gpu": "a100"})) == 0


def test_a_job_that_selects_nodes_is_placed_before_one_that_may_go_anywhere() -> None:
    """`edited` (minimum 2) selects the H100s of t0 and gives up replicas there; `other`, at the
    same priority and placed first for its size, took all of t0 for its growth and left `edited`
    preempted below its minimum (a review). The most constrained job is placed first now."""
    snap = build_snapshot()
    snap.assume("edited", "train", Placement(["t0"] * 4), 1)
    snap.assume("other", "train", Placement(["t1"] * 8), 1)
    jobs = [build_job("edited", SCALES_BADLY, node_selector={"gpu": "h100"}, replicas=4, min_replicas=2,
                      max_replicas=4, last_resize=-1e9),
            build_job("other", replicas=8, last_resize=-1e9)]
    got = {d.job: d for d in allocator.Allocator().allocate(snap, jobs, 1000.0)}
    assert got["edited"].replicas >= 2 and set(got["edited"].assignments) == {"t0"}
    assert got["other"].replicas + got["edited"].replicas == 16


def test_a_selected_node_the_job_may_not_borrow_does_not_raise_its_bound() -> None:
    """An H100 node of an inference cluster that lends nothing is no room for the job that
    selects H100s: counted, it lifted the job's bound to 16, the greedy gave it GPUs placement
    could not use, and the job beside it, running at 8, was shrunk to 1 (a review)."""
    for lend, borrow, bound in ((0, 0, 8), (8, 0, 8), (8, 4, 12), (2, 8, 10)):
        snap = build_snapshot(infer_nodes=1, lend=lend, borrow=borrow)
        assert allocator.selected_slots(snap, build_job("good", node_selector={"gpu": "h100"})) == bound
        snap.assume("good", "train", Placement(["t0"] * 8), 1)
        snap.assume("bad", "train", Placement(["t1"] * 8), 1)
        jobs = [build_job("good", node_selector={"gpu": "h100"}, replicas=8, last_resize=-1e9),
                build_job("bad", SCALES_BADLY, replicas=8, last_resize=-1e9)]
        got = {d.job: d for d in allocator.Allocator().allocate(snap, jobs, 1000.0)}
        assert got["bad"].replicas == 8 and set(got["bad"].assignments) == {"t1"}, (lend, borrow)
        assert got["good"].replicas <= bound and set(got["good"].assignments) <= {"t0", "i0"}
    # what the lender keeps there for its own waiting jobs (NodeView.kept) is no room either
    kept = [dataclasses.replace(v, kept=8) if v.name == "i0" else v
            for v in build_snapshot(infer_nodes=1).node_views()]
    snap = snapshot.ClusterSnapshot(kept, build_snapshot(infer_nodes=1, lend=8, borrow=8).virtual_clusters())
    assert allocator.selected_slots(snap, build_job("good", node_selector={"gpu": "h100"})) == 8


def test_a_pinned_job_is_never_shrunk_onto_a_better_packed_smaller_gang() -> None:
    """Regression (found by the property test above in a full-suite run): a pinned job of 4
    replicas spread over the training node and a lender's node was moved to 3 replicas on the
    lender's node alone, which its model priced faster, once the lender allowed 3 GPUs on loan.
    Pass 1 reserves a pinned job's size; the placement search now stops there too."""
    snap = build_snapshot(train_nodes=1, infer_nodes=1, lend=0, borrow=3)
    jobs = [build_job("j0", SCALES_BADLY, min_replicas=3, max_replicas=5, priority=100, noise_scale=591.0),
            build_job("j1", min_replicas=1, max_replicas=3, gpus_per_replica=2, priority=100, submitted=1.0,
                      noise_scale=0.0)]
    alloc = allocator.Allocator()
    sizes: list[dict[str, int]] = []
    for cycle, limit in enumerate([0, 0, 3]):
        snap.set_virtual_cluster(snapshot.VirtualClusterView(
            "infer", purpose="inference", lendable=limit > 0, max_gpus_lent=limit))
        got = {d.job: d.replicas for d in alloc.allocate(snap, jobs, float(cycle * 1000))}
        sizes.append(got)
        for job in jobs:
            job.replicas, job.last_resize = got[job.name], float(cycle * 1000)
            job.noise_scale, job.model_version = job.noise_scale * 2, job.model_version + 1
    assert sizes[1]["j0"] == 4, sizes  # the case: running at 4 when the lender opens
    assert sizes[2]["j0"] >= 4 and sizes[2]["j1"] >= sizes[1]["j1"], sizes


def test_a_pinned_job_that_cannot_grow_keeps_its_loan_within_the_lenders_limit() -> None:
    """Regression (found by the property test above): two pinned jobs changed size in one cycle.
    j1, placed first as the bigger gang, moved onto the lender's node into the room that j5's
    loan was counted in (j5 had been released up front); j5, unable to grow, then fell back on
    its old GPUs there, and the lender had 5 GPUs out against a limit of 3. Pinned jobs are now
    placed before the others, each released only at its turn."""
    snap = build_snapshot(train_nodes=2, infer_nodes=1, lend=2, borrow=3)
    jobs = [build_job("j0", min_replicas=1, max_replicas=3, gpus_per_replica=2, priority=100,
                      noise_scale=0.0),
            build_job("j1", SCALES_BADLY, min_replicas=3, max_replicas=4, priority=100, submitted=1.0,
                      noise_scale=0.0),
            build_job("j2", min_replicas=1, max_replicas=3, gpus_per_replica=2, priority=100, submitted=2.0,
                      noise_scale=0.0),
            build_job("j5", SCALES_BADLY, min_replicas=2, max_replicas=3, priority=100, submitted=3.0,
                      noise_scale=102.0)]
    alloc = allocator.Allocator(allocator.HUORN)
    sizes: list[dict[str, int]] = []
    for cycle, limit in enumerate([2, 0, 3]):
        lent_before = snap.lent("infer")
        snap.set_virtual_cluster(snapshot.VirtualClusterView(
            "infer", purpose="inference", lendable=limit > 0, max_gpus_lent=limit))
        got = {d.job: d.replicas for d in alloc.allocate(snap, jobs, float(cycle * 1000))}
        sizes.append(got)
        assert snap.lent("infer") <= max(limit, lent_before), (cycle, snap.bindings())
        if cycle == 1:  # the case: j5 runs on loan when the lender reopens with room for 3
            assert snap.bindings()["j5"].gpus_by_node == {"i0": 2}
        for job in jobs:
            job.replicas, job.last_resize = got[job.name], float(cycle * 1000)
            job.noise_scale, job.model_version = job.noise_scale * 2, job.model_version + 1
    assert all(sizes[2][j] >= sizes[1][j] > 0 for j in sizes[1]), sizes  # pinned: none shrunk


@pytest.mark.parametrize("config", ["pollux-p1", "huorn", "huorn-runtime"])
def test_a_borrower_kept_at_its_size_goes_back_on_loan_only_within_the_lenders_limit(config: str) -> None:
    """The lender lowers its limit to the 4 GPUs a borrower holds; lifted off for the cycle, the
    borrower leaves that room to a higher-priority gang, which fragmentation sends whole onto the
    lender's node. The borrower, whose grow does not pay, must not fall back on its old GPUs there
    (a keep without the lending-limit check put 7 GPUs out against the limit of 4)."""
    snap = build_snapshot(train_nodes=2, infer_nodes=1, lend=8, borrow=16)
    fill = [build_job(f"f{i}", min_replicas=6, max_replicas=6, priority=100, replicas=6, submitted=float(i))
            for i in range(2)]  # pinned at their size: 2 GPUs left on each training node
    borrower = build_job("k", min_replicas=1, max_replicas=8, priority=10, replicas=4, submitted=2.0,
                         noise_scale=0.0)
    gang = build_job("g", min_replicas=3, max_replicas=3, priority=50, submitted=3.0)
    for job, node in ((fill[0], "t0"), (fill[1], "t1"), (borrower, "i0")):
        snap.assume(job.name, "train", Placement([node] * job.replicas), 1)
    snap.set_virtual_cluster(snapshot.VirtualClusterView("infer", purpose="inference", lendable=True,
                                                         max_gpus_lent=4))
    got = {d.job: d for d in allocator.Allocator(CONFIGS[config]).allocate(
        snap, [*fill, borrower, gang], 0.0)}
    assert got["g"].action == "admit" and snap.bindings()["g"].gpus_by_node == {"i0": 3}  # the case
    assert snap.lent("infer") <= 4, {name: dict(b.gpus_by_node) for name, b in snap.bindings().items()}
    assert got["k"].replicas >= 1  # moved, not preempted: the training nodes had room for it


def test_cooldown_blocks_reversals_but_not_the_next_step() -> None:
    alloc = allocator.Allocator(allocator.AllocatorConfig(cooldown_seconds=300))
    snap = build_snapshot()
    shrunk = build_job("shrunk", replicas=2, last_resize=0.0, last_direction=-1)
    where = snap.place("train", 2, 1)
    snap.assume("shrunk", "train", where, 1)
    # Just shrunk: no regrowth inside the cooldown even with the whole cluster idle.
    assert alloc.allocate(snap, [shrunk], 10.0)[0].action == "keep"
    # After the cooldown the idle GPUs are worth a restart.
    grown = alloc.allocate(snap, [shrunk], 400.0)[0]
    assert grown.action == "grow" and grown.replicas > 2


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 16), st.floats(0, 5000), st.sampled_from([8.0, 32.0, 100.0]))
def test_vectorised_tables_match_the_one_config_reference(replicas: int, noise: float, base: float) -> None:
    """The allocator prices all sizes in one call; goodput.choose_batch prices one. They must agree."""
    job = build_job("j", SCALES_BADLY, noise_scale=noise, base_batch=base, max_local_batch=256.0)
    choice = allocator.Allocator().table(job).choices[replicas]
    nodes = -(-replicas // 8)

    def throughput(local: np.ndarray) -> np.ndarray:
        return job.perf.predict_many(np.full(local.shape, replicas), np.full(local.shape, nodes), local)

    reference = goodput.choose_batch(throughput, noise, base, replicas, 256.0)
    assert choice is not None and reference is not None
    assert choice.goodput == pytest.approx(reference.goodput, rel=1e-9)
    assert choice.global_batch == pytest.approx(reference.global_batch)
    assert choice.lr_scale == pytest.approx(reference.lr_scale)
    assert reference.global_batch >= base  # never below the batch the user tuned


# Cheap on one node, costly across nodes: the Pollux inter-node terms dominate.
NETWORK_BOUND = perfmodel.PolluxParams(0.01, 0.002, 0.01, 0.0005, 2.0, 0.2, 2.0)


def fragmented_snapshot() -> snapshot.ClusterSnapshot:
    """Six GPUs free on one node, two on another: eight replicas fit, but only across two nodes."""
    nodes = [NodeView("big", 6, 6, virtual_cluster="train"), NodeView("small", 2, 2, virtual_cluster="train")]
    return snapshot.ClusterSnapshot(nodes, [snapshot.VirtualClusterView("train")])


def test_a_gang_is_priced_at_the_nodes_it_would_really_span() -> None:
    job = build_job("net", NETWORK_BOUND, max_replicas=8)
    aware = allocator.Allocator().allocate(fragmented_snapshot(), [job], 0)[0]
    naive = allocator.Allocator(allocator.AllocatorConfig(placement_aware=False)).allocate(
        fragmented_snapshot(), [build_job("net", NETWORK_BOUND, max_replicas=8)], 0)[0]
    # The table assumes 8 replicas pack onto one node; they would span two, which is slower here.
    assert naive.replicas == 8 and len(set(naive.assignments)) == 2
    assert aware.replicas == 6 and set(aware.assignments) == {"big"}
    perf = job.perf
    assert perf is not None
    at6 = perf.predict(6, 1, aware.local_batch or 0).throughput
    at8 = perf.predict(8, 2, naive.local_batch or 0).throughput
    assert at6 > at8  # the choice is the faster one, by the job's own model


def test_a_placement_worse_than_the_table_does_not_make_a_job_flap() -> None:
    snap = fragmented_snapshot()
    alloc = allocator.Allocator()
    job = build_job("net", NETWORK_BOUND, max_replicas=8)
    first = alloc.allocate(snap, [job], 0)[0]
    job.replicas, job.last_resize, job.last_direction = first.replicas, 0.0, 1
    for t in (60.0, 600.0, 6000.0):
        got = alloc.allocate(snap, [job], t)[0]
        assert got.action == "keep", (t, got)


def test_jct_weight_gives_the_extra_gpus_to_the_job_that_finishes_sooner() -> None:
    def run(weight: float) -> dict[str, int]:
        jobs = [build_job("short", remaining_work=2e4), build_job("long", remaining_work=2e7, submitted=1)]
        config = allocator.AllocatorConfig(jct_weight=weight)
        return {d.job: d.replicas for d in allocator.Allocator(config).allocate(build_snapshot(), jobs, 0)}

    plain, weighted = run(0.0), run(0.5)
    assert plain["short"] == plain["long"]  # identical curves: the sum of speedups splits evenly
    assert weighted["short"] > weighted["long"] >= 1
    assert weighted["short"] + weighted["long"] == plain["short"] + plain["long"]


def test_rank_weights_follow_the_order_of_remaining_times_not_their_ratios() -> None:
    """heSRPT: with speedups k^p the optimal shares weigh job i (the i-th longest of J) by about
    i^p, whatever the sizes are: the same weights whether the long job has twice the short one's
    work left or a thousand times. Weighed by remaining time, the long job's weight moves."""
    def weights(long_work: float, by: str) -> dict[str, float]:
        config = allocator.AllocatorConfig(jct_weight=0.5, jct_weight_by=by, horizon_seconds=3600.0)
        jobs = [build_job("short", remaining_work=2e5), build_job("long", remaining_work=long_work)]
        return allocator.Allocator(config)._jct_weights(jobs, {})

    assert weights(4e5, "rank") == weights(4e8, "rank") == pytest.approx({"short": 2 ** 0.5, "long": 1.0})
    assert weights(4e5, "remaining")["long"] > 10 * weights(4e8, "remaining")["long"]

    jobs = [build_job("short", remaining_work=2e4), build_job("long", remaining_work=2e7, submitted=1)]
    config = allocator.AllocatorConfig(jct_weight=0.5, jct_weight_by="rank")
    got = {d.job: d.replicas for d in allocator.Allocator(config).allocate(build_snapshot(), jobs, 0)}
    assert got["short"] > got["long"] >= 1  # identical curves split evenly unweighed (the test above)


def test_rank_weights_count_the_jobs_at_least_as_long_ties_and_unknown_lengths_included() -> None:
    alloc = allocator.Allocator(allocator.AllocatorConfig(jct_weight=0.5, jct_weight_by="rank",
                                                          horizon_seconds=3600.0))
    jobs = [build_job("a", remaining_work=1e3), build_job("b", remaining_work=1e3),
            build_job("c", remaining_work=1e9), build_job("unknown", remaining_work=None)]
    left = {j.name: alloc.remaining_seconds(j) for j in jobs}
    assert left["a"] < left["unknown"] == 3600 < left["c"]  # an unknown length: one horizon left
    weights = alloc._jct_weights(jobs, {})
    assert weights == pytest.approx({"a": 2.0, "b": 2.0, "unknown": 2 ** 0.5, "c": 1.0})
    with pytest.raises(ValueError, match="jct_weight_by must be rank or remaining"):
        allocator.AllocatorConfig(jct_weight_by="size")


def test_rank_weights_count_the_jobs_of_the_same_virtual_cluster_only() -> None:
    """Ranked across virtual clusters, one team's long jobs moved how another team's jobs split
    its own GPUs (a review: 16/0 became 11/5 with four long jobs added elsewhere)."""
    alloc = allocator.Allocator(allocator.AllocatorConfig(jct_weight=0.4, jct_weight_by="rank"))
    mine = [build_job("short", remaining_work=1e3), build_job("long", remaining_work=1e6)]
    others = [build_job(f"other-{i}", remaining_work=1e9, virtual_cluster="infer") for i in range(4)]
    alone, beside = alloc._jct_weights(mine, {}), alloc._jct_weights(mine + others, {})
    assert alone == {"short": pytest.approx(2 ** 0.4), "long": 1.0}
    assert {name: beside[name] for name in alone} == alone
    assert beside["other-0"] == pytest.approx(4 ** 0.4)  # ties share the higher rank, among their own


def test_rank_weights_count_the_live_jobs_left_out_so_the_cut_does_not_move_them() -> None:
    """A caller that hands over only the pending jobs that could start (the simulator) or only
    the running ones (the operator's arbiter) passes the others' remaining times: the split of
    the GPUs among the jobs handed over is then the same whichever of them were left out, and
    is the split of the allocation over every live job."""
    config = allocator.AllocatorConfig(jct_weight=0.6, jct_weight_by="rank", horizon_seconds=3600.0)
    alloc = allocator.Allocator(config)
    short, middle = build_job("short", remaining_work=2e4), build_job("middle", remaining_work=2e6)
    waiting = [build_job(f"waiting-{i}", remaining_work=w, submitted=i)
               for i, w in enumerate((1e5, 1e7, 1e8))]  # one between them, two longer than both
    everyone = alloc._jct_weights([short, middle, *waiting], {})
    left_out = {"train": [alloc.remaining_seconds(j) for j in waiting]}
    handed = alloc._jct_weights([short, middle], left_out)
    assert handed == pytest.approx({"short": 5 ** 0.6, "middle": 3 ** 0.6})
    assert handed == pytest.approx({name: everyone[name] for name in handed})
    assert alloc._jct_weights([short, middle], {}) == pytest.approx({"short": 2 ** 0.6, "middle": 1.0})
    assert alloc._jct_weights([short, middle], {"infer": [1e9] * 4}) == pytest.approx(
        {"short": 2 ** 0.6, "middle": 1.0})  # another cluster's jobs do not count

    old_form = allocator.Allocator(dataclasses.replace(config, rank_among="allocation"))
    assert old_form._jct_weights([short, middle], left_out) == pytest.approx(
        {"short": 2 ** 0.6, "middle": 1.0})
    with pytest.raises(ValueError, match="rank_among must be live or allocation"):
        allocator.AllocatorConfig(rank_among="queue")

    def split(left: dict[str, list[float]]) -> dict[str, int]:
        jobs = [build_job("short", remaining_work=2e5, max_replicas=16),
                build_job("middle", remaining_work=2e6, max_replicas=16, submitted=1)]
        return {d.job: d.replicas for d in alloc.allocate(build_snapshot(), jobs, 0, also_ranked=left)}

    assert split({}) != split({"train": [1e9] * 6})  # six longer jobs waiting: both weigh nearly alike


def test_restarts_are_charged_over_the_remaining_time() -> None:
    def grows(remaining: float) -> bool:
        snap = build_snapshot(train_nodes=1)
        config = allocator.AllocatorConfig(restart_over_remaining=True)
        alloc = allocator.Allocator(config)
        job = build_job("j", remaining_work=remaining, restart_seconds=60.0, max_replicas=8)
        job.replicas = 1
        snap.assume("j", "train", snapshot.placement.Placement(["t0"]), 1)
        return alloc.allocate(snap, [job], 0)[0].action == "grow"

    # At one replica this job processes a few hundred samples a second: 3e3 samples is seconds of
    # work, not worth a 60 s restart; 3e7 is hours, and growing pays for itself many times over.
    assert not grows(3e3)
    assert grows(3e7)


def test_pending_jobs_can_be_admitted_shortest_remaining_first() -> None:
    """One free GPU, two pending jobs: FIFO admits the older, SRPT the one that finishes sooner."""
    def admitted(order: str) -> str:
        snap = build_snapshot(train_nodes=1)
        blocker = build_job("blocker", min_replicas=7, max_replicas=7)
        alloc = allocator.Allocator(allocator.AllocatorConfig(pending_order=order))
        alloc.allocate(snap, [blocker], 0)
        jobs = [build_job("old-long", remaining_work=1e8, max_replicas=1, submitted=1),
                build_job("new-short", remaining_work=1e4, max_replicas=1, submitted=2)]
        got = {d.job: d.action for d in alloc.allocate(snap, jobs, 10)}
        assert sorted(got.values()) == ["admit", "pending"]
        return next(name for name, action in got.items() if action == "admit")

    assert admitted("submitted") == "old-long"
    assert admitted("remaining") == "new-short"
    with pytest.raises(ValueError, match="pending_order"):
        allocator.AllocatorConfig(pending_order="random")


def test_a_job_that_declares_no_length_ranks_as_one_horizon_left_not_last() -> None:
    """Shortest-remaining-first must not starve jobs whose spec declares no steps: they rank as
    if one horizon (the time their neutral JCT weight stands for) were left."""
    alloc = allocator.Allocator(allocator.AllocatorConfig(pending_order="remaining", horizon_seconds=3600))
    short, long_ = build_job("short", remaining_work=1e3), build_job("long", remaining_work=1e9)
    unknown = build_job("unknown", remaining_work=None)
    keys = {j.name: alloc.remaining_seconds(j) for j in (short, long_, unknown)}
    assert keys["unknown"] == 3600
    assert keys["short"] < keys["unknown"] < keys["long"]

    snap = build_snapshot(train_nodes=1)
    alloc.allocate(snap, [build_job("blocker", min_replicas=7, max_replicas=7)], 0)
    jobs = [build_job("long", remaining_work=1e9, max_replicas=1, submitted=1),
            build_job("unknown", remaining_work=None, max_replicas=1, submitted=2)]
    got = {d.job: d.action for d in alloc.allocate(snap, jobs, 10)}
    assert got == {"long": "pending", "unknown": "admit"}


# ---------------------------------------------------------------- Pollux's fairness exponent p


def test_fitness_terms_at_p_1_are_the_speedups_themselves() -> None:
    """p = 1 must leave the greedy exactly as it was: the terms are the speedups, bit for bit."""
    speedups = np.array([0.0, 1.0, 1.9696937, 2.93, 0.5])
    assert allocator.fitness_terms(speedups, 1.0) is speedups
    assert allocator.fitness(speedups[1:], 1.0) == pytest.approx(np.mean(speedups[1:]))
    # The power mean of equal speedups is that speedup at any p, and it falls as p falls.
    assert allocator.fitness(np.array([2.0, 2.0]), -1.0) == pytest.approx(2.0, rel=1e-3)
    spread = np.array([1.0, 9.0])
    assert allocator.fitness(spread, 1.0) > allocator.fitness(spread, 0.0) > allocator.fitness(spread, -1.0)
    assert allocator.fitness(spread, -1.0) == pytest.approx(2 / (1 / 1.001 + 1 / 9.001))
    with pytest.raises(ValueError, match="fairness_p"):
        allocator.AllocatorConfig(fairness_p=float("nan"))


def two_job_split(p: float) -> tuple[dict[str, int], dict[str, float]]:
    """A job that scales well and one that scales badly share two nodes; replicas and speedups."""
    alloc = allocator.Allocator(allocator.AllocatorConfig(fairness_p=p))
    jobs = [build_job("good"), build_job("bad", SCALES_BADLY)]
    got = {d.job: d.replicas for d in alloc.allocate(build_snapshot(), jobs, 0)}
    return got, {j.name: float(alloc.table(j).speedup[got[j.name]]) for j in jobs}


def test_p_minus_1_balances_speedups_that_p_1_leaves_unequal() -> None:
    sum_replicas, sum_speed = two_job_split(1.0)
    fair_replicas, fair_speed = two_job_split(-1.0)
    # p = 1 gives nearly everything to the job that turns GPUs into speedup; the other stays at 1×.
    assert sum_replicas["good"] > 2 * sum_replicas["bad"]
    assert sum_speed["bad"] == pytest.approx(1.0)
    # p = -1 takes GPUs from it until the badly scaling job is no longer far behind.
    assert fair_replicas["bad"] > sum_replicas["bad"]
    assert min(fair_speed.values()) > min(sum_speed.values()) * 1.3
    ratio = max(fair_speed.values()) / min(fair_speed.values())
    assert ratio < 0.5 * max(sum_speed.values()) / min(sum_speed.values())
    # Balance has a price in total speedup, which p = 1 maximises; each wins on its own objective.
    assert sum(fair_speed.values()) < sum(sum_speed.values())
    for p in (1.0, -1.0):
        own = fair_speed if p == -1.0 else sum_speed
        other = sum_speed if p == -1.0 else fair_speed
        assert allocator.fitness(np.array(list(own.values())), p) > allocator.fitness(
            np.array(list(other.values())), p)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(50, 20000), st.integers(1, 2), st.integers(2, 6)), min_size=2,
                max_size=3), st.sampled_from([1.0, -1.0, 0.0]))
def test_greedy_reaches_the_best_power_mean_on_concave_speedups(specs: list, p: float) -> None:
    """On one 8-GPU node, with concave speedups, the greedy must find the exhaustive optimum of FITNESS_p."""
    jobs = [build_job(f"j{i}", min_replicas=lo, max_replicas=lo + extra, noise_scale=noise)
            for i, (noise, lo, extra) in enumerate(specs)]
    assume(sum(j.min_replicas for j in jobs) <= 8)
    alloc = allocator.Allocator(allocator.AllocatorConfig(fairness_p=p, placement_aware=False))
    tables = [alloc.table(j).speedup for j in jobs]
    for j, t in zip(jobs, tables, strict=True):
        steps = np.diff(t[j.min_replicas:])
        assume(np.all(steps > 0) and np.all(np.diff(steps) <= 1e-12))  # increasing and concave
    got = {d.job: d.replicas for d in alloc.allocate(build_snapshot(train_nodes=1), jobs, 0)}
    greedy = allocator.fitness(np.array([t[got[j.name]] for j, t in zip(jobs, tables, strict=True)]), p)
    best = max(
        allocator.fitness(np.array([t[a] for t, a in zip(tables, sizes, strict=True)]), p)
        for sizes in itertools.product(*(range(j.min_replicas, j.max_replicas + 1) for j in jobs))
        if sum(sizes) <= 8)
    assert greedy == pytest.approx(best, rel=1e-9)


def test_fair_share_reference_is_pollux_speedup_over_an_equal_share() -> None:
    """SPEEDUP relative to a 1/J share (the paper's) weighs each job by its speedup at that share."""
    def split(reference: str, cluster_jobs: int | None) -> dict[str, int]:
        config = allocator.AllocatorConfig(fairness_p=-1.0, speedup_reference=reference)
        jobs = [build_job("good"), build_job("bad", SCALES_BADLY)]
        decisions = allocator.Allocator(config).allocate(build_snapshot(), jobs, 0, cluster_jobs=cluster_jobs)
        return {d.job: d.replicas for d in decisions}

    # Exhaustive optimum of Σ (speedup / speedup at the fair share of 16 / 2 = 8 GPUs)^-1.
    alloc = allocator.Allocator()
    good, bad = (alloc.table(build_job("good")).speedup, alloc.table(build_job("bad", SCALES_BADLY)).speedup)
    best = min(range(1, 16), key=lambda a: good[8] / good[a] + bad[8] / bad[16 - a])
    fair = split("fair_share", None)
    assert fair == {"good": best, "bad": 16 - best}
    # The job that scales well is worth more at its fair share, so it gets more than with the minimum
    # as reference (where both count alike).
    assert fair["good"] > split("min", None)["good"]
    # With 16 jobs in the cluster the fair share is one GPU, which is the minimum here: same split.
    assert split("fair_share", 16) == split("min", None)
    with pytest.raises(ValueError, match="speedup_reference"):
        allocator.AllocatorConfig(speedup_reference="median")


KEEPING = dataclasses.replace(allocator.HUORN, keep_replicas=True)


def _bind(snap: snapshot.ClusterSnapshot, job: allocator.JobView, nodes: list[str]) -> None:
    from huorn.scheduler import placement

    snap.assume(job.name, job.virtual_cluster, placement.Placement(nodes), job.gpus_per_replica)


def test_keep_replicas_grows_a_gang_around_the_replicas_it_has() -> None:
    """The operator keeps a gang's pods and places only the new ones, and a resize in place needs
    the staying processes where they run; placed afresh, a grown gang could land elsewhere."""
    snap = build_snapshot(train_nodes=3)
    job = build_job("grower", replicas=2, max_replicas=8)
    filler = build_job("filler", min_replicas=4, max_replicas=4, replicas=4, priority=100)
    _bind(snap, job, ["t2", "t2"])
    _bind(snap, filler, ["t0"] * 4)
    decisions = allocator.Allocator(KEEPING).allocate(snap, [job, filler], 0.0)
    grown = next(d for d in decisions if d.job == "grower")
    assert grown.action == "grow" and grown.replicas > 2
    assert grown.assignments.count("t2") >= 2, "its replicas stay on t2"
    assert Counter(grown.assignments)["t2"] == min(8, grown.replicas), "new ones beside them first"


def test_keep_replicas_shrinks_a_borrower_by_its_replicas_on_the_lender_first() -> None:
    """maxReplicas lowered to 8 under a gang of 10, two of them on a lender: placed afresh, the
    eight that stay were packed onto one empty node, moving all of them."""
    snap = build_snapshot(train_nodes=3, infer_nodes=1, lend=8, borrow=8)
    job = build_job("borrower", replicas=10, max_replicas=8, min_replicas=1)
    _bind(snap, job, ["t0"] * 4 + ["t1"] * 4 + ["i0"] * 2)
    (shrunk,) = allocator.Allocator(KEEPING).allocate(snap, [job], 0.0)
    assert (shrunk.action, shrunk.replicas) == ("shrink", 8)
    assert Counter(shrunk.assignments) == {"t0": 4, "t1": 4}, "the lender's replicas went, the others stayed"


def _grow_across_nodes(in_place_share: float, runs_on: str, resizes_in_place: bool = True
                       ) -> allocator.Decision:
    """A job at 2 replicas on one 2-GPU node whose table wants 4; the 4 span two nodes, which
    costs it most of the gain the table (perfect packing) promised."""
    crosses_badly = perfmodel.PolluxParams(0.01, 0.01, 0.01, 0.0005, 2.0, 0.002, 3.0)
    snap = snapshot.ClusterSnapshot([NodeView(f"n{i}", 2, 2, virtual_cluster="train") for i in range(4)],
                                    [snapshot.VirtualClusterView("train")])
    alloc = allocator.Allocator(allocator.AllocatorConfig(in_place_share=in_place_share))
    job = build_job("j", crosses_badly, max_replicas=4, restart_seconds=560.0, replicas=2,
                    resizes_in_place=resizes_in_place)
    snap.assume("j", "train", snapshot.placement.Placement([runs_on, runs_on]), 1)
    return alloc.allocate(snap, [job], 10_000.0)[0]


def test_a_placement_that_resizes_in_place_is_charged_the_in_place_share_of_a_restart() -> None:
    """4 replicas on two nodes are 1.47× the 2 on one: not worth a full restart (0.36 of the
    horizon with the margin), worth the in-place share of one (0.24). Only a placement that keeps
    the staying replicas where they run is in place. Placed afresh, the gang of a job on n3 lands
    on n0 and n1 (the search knows nothing of where the job runs), a restart that does not pay;
    the same size around its replicas, n3 and one more node, does. A job whose runtime restarts to
    resize (several processes a replica, or resize mode restart) is never charged the in-place
    share, and stays."""
    grown = _grow_across_nodes(allocator.IN_PLACE_RESIZE_SHARE, runs_on="n0")
    assert grown.action == "grow" and sorted(grown.assignments) == ["n0", "n0", "n1", "n1"]
    assert _grow_across_nodes(1.0, runs_on="n0").action == "keep"
    assert _grow_across_nodes(allocator.IN_PLACE_RESIZE_SHARE, runs_on="n0", resizes_in_place=False
                              ).action == "keep"
    around = _grow_across_nodes(allocator.IN_PLACE_RESIZE_SHARE, runs_on="n3")
    assert around.action == "grow" and around.assignments.count("n3") == 2
    assert len(set(around.assignments)) == 2
    assert _grow_across_nodes(1.0, runs_on="n3").action == "keep"
    assert allocator.HUORN.in_place_share == allocator.IN_PLACE_RESIZE_SHARE
    with pytest.raises(ValueError, match="in_place_share"):
        allocator.AllocatorConfig(in_place_share=1.5)


def test_a_resize_around_a_gangs_replicas_adds_none_on_a_cordoned_node() -> None:
    """A node cordoned under a running gang (remediation, a drain) has room left: growing the gang
    around its replicas put the new ones there, which the operator's placement then refused. The
    gang placed afresh leaves the node instead."""
    snap = snapshot.ClusterSnapshot([NodeView("n0", 4, 4, virtual_cluster="train", cordoned=True),
                                     NodeView("n1", 4, 4, virtual_cluster="train")],
                                    [snapshot.VirtualClusterView("train")])
    alloc = allocator.Allocator(allocator.AllocatorConfig(in_place_share=allocator.IN_PLACE_RESIZE_SHARE,
                                                          gpus_per_node=4))
    job = build_job("j", max_replicas=4, restart_seconds=60.0, replicas=2, resizes_in_place=True)
    snap.assume("j", "train", snapshot.placement.Placement(["n0", "n0"]), 1)
    (decision,) = alloc.allocate(snap, [job], 10_000.0)
    assert decision.replicas > 2 and decision.assignments.count("n0") <= 2


def _shrink_beside_a_grower(around: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Job a (scales badly) shrinks while b (scales well) grows and an urgent job is admitted, on
    three 2-GPU nodes; a's GPUs by node before and after. Found by a search over small clusters."""
    snap = snapshot.ClusterSnapshot([NodeView(f"n{i}", 2, 2, virtual_cluster="train") for i in range(3)],
                                    [snapshot.VirtualClusterView("train")])
    alloc = allocator.Allocator(dataclasses.replace(allocator.HUORN, resize_around_replicas=around,
                                                    gpus_per_node=2))
    a = build_job("a", SCALES_BADLY, max_replicas=6, restart_seconds=30.0, replicas=2, resizes_in_place=True,
                  remaining_work=1e7)
    b = build_job("b", max_replicas=6, restart_seconds=30.0, replicas=3, resizes_in_place=True,
                  remaining_work=1e7)
    old = snap.assume("a", "train", snapshot.placement.Placement(["n1", "n2"]), 1)
    snap.assume("b", "train", snapshot.placement.Placement(["n0", "n1", "n2"]), 1)
    urgent = build_job("u", min_replicas=1, max_replicas=1, priority=90, remaining_work=1e5)
    decisions = {d.job: d for d in alloc.allocate(snap, [a, b, urgent], 10_000.0)}
    assert decisions["a"].action == "shrink" and decisions["u"].action == "admit"
    return dict(old.gpus_by_node), snap.bindings()["a"].gpus_by_node


def test_a_shrink_keeps_replicas_where_they_run_when_that_is_worth_more() -> None:
    """Placed afresh, the shrunk gang lands on a node it did not use (a restart); tried around its
    replicas, it keeps one where it runs and is resized in place."""
    old, new = _shrink_beside_a_grower(around=True)
    assert allocator.keeps_nodes(old, new, grew=False)
    old, new = _shrink_beside_a_grower(around=False)
    assert not allocator.keeps_nodes(old, new, grew=False)
