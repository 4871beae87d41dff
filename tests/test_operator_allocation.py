"""The operator's goodput decisions: one allocation over every elastic job it watches, on the
cluster its index mirrors (huorn.operator.allocation), not each job alone on its free GPUs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from huorn import graph
from huorn.api import kinds
from huorn.backends import goodput
from huorn.graph import mutate
from huorn.operator import allocation, context, index, queue
from huorn.scheduler import allocator, perfmodel, placement

SCALES_WELL = perfmodel.PolluxParams(0.01, 0.01, 0.01, 0.0005, 0.05, 0.002, 3.0)
SCALES_BADLY = perfmodel.PolluxParams(0.01, 0.001, 0.3, 0.05, 1.0, 0.2, 1.0)


def build_ctx(gpus: int = 8) -> context.Context:
    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.nodes["a0"] = index.NodeRecord("a0", gpus, {"pool": "a"})
    ctx.index.vcs["train"] = {"members": {"nodeSelector": {"matchLabels": {"pool": "a"}}}}
    return ctx


def run_pods(ctx: context.Context, job: str, replicas: int, gpus: int = 1, vertex: str = "trainer") -> None:
    for i in range(replicas):
        name = f"{job}-{vertex}-{i}"
        ctx.index.pods[("t", name)] = index.PodRecord("t", name, job, vertex, f"{vertex}-{i}", "a0", gpus, 0,
                                                      "train", phase="Running")


def watch(ctx: context.Context, job: str, params: perfmodel.PolluxParams, replicas: int,
          gpus: int = 1, **kw: object) -> allocator.JobView:
    """A running goodput job whose monitor has decided once: its view is what peers see."""
    run_pods(ctx, job, replicas, gpus)
    view = allocator.JobView(job, "train", perf=perfmodel.PerfModel("transformer", prior=params),
                             gpus_per_replica=gpus, min_replicas=1, max_replicas=8, replicas=replicas,
                             noise_scale=4096.0, base_batch=32.0, **kw)  # type: ignore[arg-type]
    policy = goodput.GoodputPolicy(job=job, virtual_cluster="train", slots=0, global_batch=32.0)
    policy.view = view
    ctx.monitors[("t", job)] = SimpleNamespace(goodput=policy)
    return view


def test_free_gpus_go_to_the_job_that_gains_most_whichever_monitor_decides_first() -> None:
    """Before, a monitor ran the allocator for its job alone: the poor scaler, ticking first,
    took all six free GPUs."""
    ctx = build_ctx()
    poor, strong = watch(ctx, "poor", SCALES_BADLY, 1), watch(ctx, "strong", SCALES_WELL, 1)
    first = allocation.arbiter_for(ctx, "t", "poor")(poor, 0.0)
    second = allocation.arbiter_for(ctx, "t", "strong")(strong, 0.0)
    assert (first.job, second.job) == ("poor", "strong")
    assert second.replicas > first.replicas >= 1
    assert first.replicas + second.replicas <= 8
    # The same split, whichever asks: each monitor applies its part of one allocation.
    reference = {d.job: d.replicas for d in allocator.Allocator(allocator.HUORN).allocate(
        _bound(ctx), [_named(poor), _named(strong)], 0.0)}
    assert (first.replicas, second.replicas) == (reference["t/poor"], reference["t/strong"])


def _named(view: allocator.JobView) -> allocator.JobView:
    return allocator.JobView(**{**vars(view), "name": allocation.job_key("t", view.name)})


def _bound(ctx: context.Context) -> object:
    snap = ctx.index.build_snapshot()
    for (ns, job), state in ctx.monitors.items():
        allocation.rebind_trainers(snap, allocation.job_key(ns, job), ctx.index.pods_of(ns, job),
                                   state.goodput.view.gpus_per_replica)
    return snap


def test_growth_leaves_the_gpus_that_gangs_waiting_in_line_need() -> None:
    ctx = build_ctx()
    grower = watch(ctx, "grower", SCALES_WELL, 1)
    decide = allocation.arbiter_for(ctx, "t", "grower")
    assert decide(grower, 0.0).replicas > 3
    ctx.queue.record(queue.QueuedJob("t", "waiter", "train", 10, 0.0, gpus=3, missing=2))
    ctx.queue.record(queue.QueuedJob("t", "elsewhere", "serve", 90, 0.0, gpus=8, missing=1))
    # 7 free, 6 owed to the waiter: one more replica at most, whatever the priorities.
    assert decide(grower, 0.0).replicas <= 2
    # A job's own missing replicas are not owed to itself.
    ctx.queue.record(queue.QueuedJob("t", "grower", "train", 10, 0.0, gpus=1, missing=3))
    ctx.queue.forget("t", "waiter")
    assert decide(grower, 0.0).replicas > 3


def test_a_gang_of_multi_gpu_pods_is_bound_one_replica_per_pod_and_its_eval_stays_held() -> None:
    ctx = build_ctx()
    view = watch(ctx, "wide", SCALES_WELL, 2, gpus=2)
    run_pods(ctx, "wide", 1, gpus=1, vertex="eval")
    snap = ctx.index.build_snapshot()
    assert allocation.rebind_trainers(snap, "t/wide", ctx.index.pods_of("t", "wide"), 2) == 2
    assert snap.bindings()["t/wide"].gpus_by_node == {"a0": 4}
    assert snap.free("train") == 3, "the eval pod's GPU is still held"
    decision = allocation.arbiter_for(ctx, "t", "wide")(view, 0.0)
    assert decision.replicas in (2, 3), "3 free GPUs hold one more pod of 2, not three of 1"



def test_growth_takes_only_the_gpus_free_now_not_those_a_peer_would_give_up() -> None:
    """The joint allocation may shrink a poor scaler for a strong one, but the poor scaler's own
    monitor gives the GPUs up; planned on them now, the growth would wait, unplaceable."""
    ctx = build_ctx()
    watch(ctx, "poor", SCALES_BADLY, 6)
    strong = watch(ctx, "strong", SCALES_WELL, 2)
    assert allocation.arbiter_for(ctx, "t", "strong")(strong, 0.0).replicas == 2


def test_a_resize_in_flight_is_decided_from_the_replicas_that_run() -> None:
    """Told to grow to 4 ten seconds ago, two pods run and two wait for GPUs a peer holds. Sized by
    the graph, the cooldown forbade every size but 4, which did not fit, and the job was shrunk to
    its minimum, below what ran (found by review)."""
    ctx = build_ctx(gpus=4)
    watch(ctx, "other", SCALES_WELL, 2, priority=100)
    view = watch(ctx, "g", SCALES_WELL, 2, last_resize=-10.0, last_direction=1)
    view = allocator.JobView(**{**vars(view), "replicas": 4, "max_replicas": 4})
    assert allocation.arbiter_for(ctx, "t", "g")(view, 0.0).replicas >= 2


def test_a_gpu_less_goodput_job_decides_alone_within_its_bounds() -> None:
    """The quickstart's trainers use no GPU: a JobView of 0 GPUs a replica raised at every decision
    and the monitor's whole tick failed (found by review)."""
    from huorn.operator import monitoring, validation

    body = {"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "cpu", "namespace": "t"},
            "spec": {"virtualCluster": "train", "resources": {"gpus": 0},
                     "elasticity": {"minReplicas": 1, "maxReplicas": 3, "policy": "goodput"},
                     "optimization": {"steps": 100, "globalBatch": 24, "microBatch": 4}}}
    state = monitoring.build_policies(validation.load_job(body), ("uid", 1), None,
                                      allocation.arbiter_for(build_ctx(), "t", "cpu"))
    assert state.goodput is not None and state.goodput.arbiter is None
    assert (state.goodput.slots, state.goodput.gpus_per_replica) == (3, 1)


def test_a_rebuilt_policy_is_not_handed_the_old_policys_goodput_table() -> None:
    """The arbiter's allocator caches tables by job and model version; a policy rebuilt for an
    edited spec starts counting samples from 0 again, and its versions must not meet the old
    one's (found by review)."""
    old, new = (goodput.GoodputPolicy(job="j", virtual_cluster="train", slots=0, global_batch=32.0)
                for _ in range(2))
    assert old.model_version() != new.model_version()


def test_new_replicas_go_where_the_allocator_placed_them_while_that_room_is_free() -> None:
    ctx = build_ctx()
    ctx.index.nodes["a1"] = index.NodeRecord("a1", 8, {"pool": "a"})
    snap = ctx.index.build_snapshot()
    # the hinted node is free: the hinted instances go there, the others where the gang fits
    where = allocation.place_missing(snap, "train", ["trainer-0-g1", "trainer-2"], 2, {"trainer-2": "a1"})
    assert isinstance(where, placement.Placement) and where.assignments[1] == "a1"
    # stale (a peer has not yet given up what the allocator counted on): placed afresh
    run_pods(ctx, "peer", 4, gpus=2)  # all of a0
    snap = ctx.index.build_snapshot()
    where = allocation.place_missing(snap, "train", ["trainer-2", "trainer-3"], 2,
                                     {"trainer-2": "a0", "trainer-3": "a0"})
    assert isinstance(where, placement.Placement) and where.assignments == ["a1", "a1"]


def test_the_goodput_policy_moves_a_gang_only_where_it_knows_every_replica_s_node() -> None:
    spec = {"virtualCluster": "train", "elasticity": {"minReplicas": 1, "maxReplicas": 4}}
    g = graph.compile({"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob", "metadata": {"name": "j"},
                       "spec": spec})
    v = g.vertex("trainer")
    mutate.resize(g, "trainer", 2, reason="start")
    decision = allocator.Decision("t/j", "grow", 3, 2, assignments=["a1", "a1", "a1"])
    assert goodput.repack(v, decision, {"trainer-0": "a0", "trainer-1": "a1"}) == {
        "remove": ["trainer-0"], "nodes": ["a1", "a1"]}
    assert goodput.repack(v, decision, {"trainer-0": "a0"}) == {}  # trainer-1 not placed yet
    assert goodput.repack(v, decision, {}) == {}  # one host: nothing to move


def test_a_gang_with_a_failed_replica_is_resized_in_place_not_moved() -> None:
    """The monitor's map of where replicas run (what the move keeps) and `_movable`'s (whether
    the move fits) are one: a Failed pod not yet deleted had been running to the one and gone to
    the other, so the fit was checked for another move than the one written. Such a gang is not
    moved: its failed replica's successor goes wherever it fits."""
    ctx = build_ctx(gpus=4)
    ctx.index.nodes["a1"] = index.NodeRecord("a1", 4, {"pool": "a"})
    run_pods(ctx, "mover", 2, gpus=2)  # both on a0
    ctx.index.pods[("t", "mover-trainer-1")] = dataclasses.replace(
        ctx.index.pods[("t", "mover-trainer-1")], phase="Failed")
    spec = {"virtualCluster": "train", "elasticity": {"minReplicas": 1, "maxReplicas": 4}}
    g = graph.compile({"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
                       "metadata": {"name": "mover"}, "spec": spec})
    mutate.resize(g, "trainer", 2, reason="start")
    nodes = allocation.trainer_nodes(ctx.index.pods_of("t", "mover"))
    assert nodes == {"trainer-0": "a0"}
    move = allocator.Decision("t/mover", "grow", 3, 2, assignments=["a1", "a1", "a0"])
    assert goodput.repack(g.vertex("trainer"), move, nodes) == {}
    running = {"trainer-0": "a0", "trainer-1": "a0"}
    assert goodput.repack(g.vertex("trainer"), move, running) == {"remove": ["trainer-1"],
                                                                  "nodes": ["a1", "a1"]}


def test_a_move_onto_gpus_that_are_not_free_now_is_left_a_plain_resize() -> None:
    """The allocation may place a moved gang on GPUs a peer is yet to give up; the move would
    then delete the replicas it replaces and leave the job waiting for the new ones."""
    ctx = build_ctx(gpus=4)
    ctx.index.nodes["a1"] = index.NodeRecord("a1", 4, {"pool": "a"})
    run_pods(ctx, "mover", 1, gpus=2)  # on a0
    view = allocator.JobView("mover", "train", gpus_per_replica=2, max_replicas=2, replicas=1)
    move = allocator.Decision("t/mover", "grow", 2, 1, assignments=["a1", "a1"])
    pods = ctx.index.pods_of("t", "mover")
    assert allocation._movable(ctx.index.build_snapshot(), view, move, pods)
    ctx.index.pods[("t", "peer")] = index.PodRecord("t", "peer", "peer", "trainer", "trainer-0", "a1", 2, 0,
                                                    "train", phase="Running")
    assert not allocation._movable(ctx.index.build_snapshot(), view, move, pods)  # a1 half taken
    beside = allocator.Decision("t/mover", "grow", 2, 1, assignments=["a0", "a1"])
    assert allocation._movable(ctx.index.build_snapshot(), view, beside, pods)  # nothing leaves


def test_a_move_whose_nodes_the_status_log_would_drop_is_left_a_plain_resize() -> None:
    """Past 512 characters of node names the log keeps the replicas a move removes but not where
    the new ones go: the gang would restart to land wherever it fits."""
    ctx = build_ctx(gpus=1)
    names = [f"gke-prod-a100-pool-7f3c9e2a-{i:04d}" for i in range(16)]
    for name in names:
        ctx.index.nodes[name] = index.NodeRecord(name, 1, {"pool": "a"})
    run_pods(ctx, "mover", 1)  # on a0
    view = allocator.JobView("mover", "train", max_replicas=16, replicas=1)
    pods = ctx.index.pods_of("t", "mover")
    few = allocator.Decision("t/mover", "grow", 4, 1, assignments=names[:4])
    many = allocator.Decision("t/mover", "grow", 16, 1, assignments=names)
    assert allocation._movable(ctx.index.build_snapshot(), view, few, pods)
    assert not allocation._movable(ctx.index.build_snapshot(), view, many, pods)


def test_a_peer_is_weighed_with_its_own_resize_mode(monkeypatch) -> None:
    """A peer's view is its monitor's, re-bound by the arbiter at the size its pods have now.
    Whether it resizes in place sets the price of its resizes (0.6 of a restart, or a whole one),
    so the re-bound view must keep it: lost, every peer would be priced as restarting to resize."""
    ctx = build_ctx()
    watch(ctx, "mover", SCALES_WELL, 1, resizes_in_place=True)
    other = watch(ctx, "other", SCALES_BADLY, 1)
    weighed: list[dict[str, bool]] = []
    real = allocation.decide

    def recording(decider, snap, me, peers, now, also_ranked=None):  # the real one, its inputs noted
        weighed.append({v.name: v.resizes_in_place for v in [me, *peers]})
        return real(decider, snap, me, peers, now, also_ranked)

    monkeypatch.setattr(allocation, "decide", recording)
    allocation.arbiter_for(ctx, "t", "other")(other, 0.0)
    assert weighed == [{"t/other": False, "t/mover": True}]


def test_jobs_in_line_count_in_the_rank_weights_as_every_live_job_does(monkeypatch) -> None:
    """The allocator ranks each job among every live job of its virtual cluster (heSRPT's set, as
    the simulator ranks them); the arbiter hands over the running jobs alone, so it passes the
    others' remaining times from their queue entries' rank views: those of the jobs in line, not
    those of the jobs it hands over, nor of another cluster's. (What the times do to the split is
    the allocator's: tests/test_scheduler_allocator.py.)"""
    ctx = build_ctx(16)
    short = watch(ctx, "short", SCALES_WELL, 1, remaining_work=2e6)
    long = watch(ctx, "long", SCALES_WELL, 1, remaining_work=2e7, submitted=1.0)
    waiting = [dataclasses.replace(long, name=allocation.ranked_name(f"t/waiting-{i}"), remaining_work=w,
                                   replicas=0) for i, w in enumerate((1e5, 2e9, 2e9))]
    for i, view in enumerate(waiting):
        ctx.queue.record(queue.QueuedJob("t", f"waiting-{i}", "train", 50, float(i), gpus=1, missing=1,
                                         ranked=view))
    elsewhere = dataclasses.replace(waiting[1], name=allocation.ranked_name("t/other"),
                                    virtual_cluster="serve")
    ctx.queue.record(queue.QueuedJob("t", "other", "serve", 50, 0.0, gpus=1, missing=1, ranked=elsewhere))
    ctx.queue.record(queue.QueuedJob("t", "long", "train", 50, 0.0, gpus=1,
                                     ranked=dataclasses.replace(long, name=allocation.ranked_name("t/long"))))
    passed: list[dict[str, list[float]] | None] = []
    real = allocation.decide

    def recording(decider, snap, me, peers, now, also_ranked=None):  # the real one, its inputs noted
        passed.append(also_ranked)
        return real(decider, snap, me, peers, now, also_ranked)

    monkeypatch.setattr(allocation, "decide", recording)
    got = allocation.arbiter_for(ctx, "t", "short")(short, 0.0)
    decider = ctx.allocators[16]
    left = sorted(decider.remaining_seconds(v) for v in waiting)
    assert [{vc: sorted(times) for vc, times in p.items()} for p in passed] == [
        {"train": left, "serve": [decider.remaining_seconds(elsewhere)]}]
    snap = _bound(ctx)
    allocation.hold_for_waiting(snap, allocation._owed(ctx, ("t", "short")))
    reference = allocator.Allocator(decider.config).allocate(snap, [_named(short), _named(long)], 0.0,
                                                             also_ranked={"train": left})
    assert got.replicas == next(d.replicas for d in reference if d.job == "t/short")
    unranked = allocator.Allocator(decider.config)._jct_weights([_named(short), _named(long)], {})
    ranked = decider._jct_weights([_named(short), _named(long)], {"train": left})
    assert ranked == pytest.approx({"t/short": 4 ** 0.7, "t/long": 3 ** 0.7}) != unranked


def test_a_job_in_line_is_ranked_at_its_prior_with_the_work_past_its_last_checkpoint() -> None:
    body = {"apiVersion": "huorn.io/v1alpha1", "kind": "TrainingJob",
            "metadata": {"name": "llm", "namespace": "t"},
            "spec": {"virtualCluster": "train", "resources": {"gpus": 2},
                     "elasticity": {"minReplicas": 2, "maxReplicas": 6, "policy": "goodput"},
                     "optimization": {"steps": 1000, "globalBatch": 64, "microBatch": 4}}}
    job = kinds.RESOURCE_MODELS["TrainingJob"].model_validate(body)
    view = allocation.rank_view(job, {"lastCheckpoint": {"step": 400}}, "")
    assert view is not None
    assert (view.name, view.virtual_cluster, view.min_replicas, view.max_replicas, view.replicas) == (
        "t/llm#ranked", "train", 2, 6, 0)
    assert view.remaining_work == 600 * 64  # steps past the checkpoint, in samples of globalBatch
    fresh = allocation.rank_view(job, {}, "")
    assert fresh is not None and fresh.remaining_work == 1000 * 64
    decider = allocator.Allocator(allocator.HUORN_RUNTIME)
    assert 0 < decider.remaining_seconds(view) < decider.remaining_seconds(fresh)

    def variant(**spec: object) -> object:
        return kinds.RESOURCE_MODELS["TrainingJob"].model_validate({**body, "spec": {**body["spec"], **spec}})

    assert allocation.rank_view(variant(suspend=True), {}, "") is None
    assert allocation.rank_view(variant(resources={"gpus": 0}), {}, "") is None
    fixed = variant(elasticity={"minReplicas": 2, "maxReplicas": 2, "policy": "fixed"})
    assert allocation.rank_view(fixed, {}, "") is None
