"""Review fixes to the loan and reclaim path (2026-12-07): what counts as a lender's demand, what
a lowered lending limit does, how often a blocked reclaim is reported, which victim loses least,
and Events from code that runs outside a kopf handler.

Real kopf against KMock, as tests/test_lending_review_fixes.py: time is real, waits poll for what
the operator has written; a check that something did not happen waits out a few of the
VirtualCluster's 1 s ticks first.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import yaml
from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, hold_kopf_lists, wait_for
from kube.kubelet import Kubelet
from test_lending_review_fixes import training_lender

from huorn.backends.kubernetes import client as kube_client
from huorn.operator import index, loans, runner
from huorn.scheduler import loaning

pytest_plugins = ["kube.fixtures"]

NS = "team"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "inference-job.yaml"
TICKS = 4.0  # seconds: four of the VirtualCluster's ticks (vc_status_seconds 1 under FAST)


def serve_lends(kube: builders.Kube, **lending: object) -> None:
    kube.custom.patch_cluster_custom_object(
        builders.GROUP, builders.VERSION, "virtualclusters", "serve",
        {"spec": {"purpose": "inference",
                  "lending": {"lendable": True, "maxGPUsLent": 4, "reclaimGraceSeconds": 5, **lending}}})


def serve_events(kube: builders.Kube, reason: str) -> list:
    return [e for e in kube.events("default", "serve") + kube.events(NS, "serve") if e.reason == reason]


def test_an_inference_job_its_cluster_refuses_is_no_demand(kube: builders.Kube, operator) -> None:
    """`serve` admits only the namespace `serving`; an InferenceJob of `team` asks it for 4 × 2
    GPUs. The operator Stalls it, and before, its demand still preempted the borrower of `serve`'s
    GPUs for replicas that never came."""
    serve_lends(kube)
    kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "serve",
                                            {"spec": {"namespaces": ["serving"]}})
    serving.borrow_four_gpus_of_b0(kube, NS)
    wait_for(lambda: kube.job_status(NS, "elastic").get("phase") == "Running", what="the borrower running")
    kube.create_job(NS, serving.make_inference_job("rogue", "serve", gpus=2, min_replicas=4, max_replicas=4),
                    plural="inferencejobs")
    wait_for(lambda: kube.job_status(NS, "rogue", plural="inferencejobs").get("phase") == "Stalled",
             what="the refused InferenceJob Stalled")
    time.sleep(TICKS)
    assert not kube.job_status(NS, "elastic").get("preemptReplacements")
    assert serving.nodes_of(kube, NS, "elastic") == ["b0", "b0"]
    assert kube.get_vc("serve")["status"].get("lent") == 4


def test_the_index_counts_no_demand_for_a_stalled_or_unadmitted_job() -> None:
    idx = index.ClusterIndex()
    idx.vcs["serve"] = {"purpose": "inference", "namespaces": ["serving"]}
    idx.vcs["open"] = {"purpose": "inference"}

    def job(ns: str, vc: str, phase: str | None = None) -> dict:
        return {"metadata": {"namespace": ns, "name": "chat"},
                "spec": {"virtualCluster": vc, "resources": {"gpus": 2}, "autoscaling": {"minReplicas": 3}},
                "status": {"phase": phase} if phase else {}}

    idx.observe_inference_job(job("serving", "serve"))
    assert idx.floors_of("serve") == 6
    idx.observe_inference_job(job("serving", "serve", phase="Stalled"))
    assert idx.floors_of("serve") == 0
    idx.observe_inference_job(job("team", "serve"))
    assert idx.floors_of("serve") == 0
    idx.observe_inference_job(job("team", "open"))
    assert idx.floors_of("open") == 6


def test_a_lender_that_stops_lending_gets_its_gpus_back(kube: builders.Kube, operator) -> None:
    """The serving team sets lendable false: what is out on loan comes back (the borrower, at its
    minimum and fixed on b0, is preempted and waits at home). Before, nothing was reclaimed and
    nothing said so."""
    serve_lends(kube)
    serving.borrow_four_gpus_of_b0(kube, NS)
    kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "serve",
                                            {"spec": {"lending": {"lendable": False, "maxGPUsLent": 0}}})
    wait_for(lambda: kube.get_vc("serve").get("status", {}).get("lent") == 0, timeout=60,
             what="serve lends nothing")
    reclaimed = serve_events(kube, "Reclaimed")
    assert reclaimed and "more GPUs than spec.lending allows now (0" in reclaimed[0].message


def test_over_limit_leaves_a_pinned_borrowers_gpus_in_the_budget() -> None:
    borrowers = {("t", "a"): loans.Borrower("t", "a"), ("t", "b"): loans.Borrower("t", "b")}
    borrowers[("t", "a")].pods = [index.PodRecord("t", "a-0", "a", "trainer", "a-0", "b0", 2, 0, "train")] * 2
    borrowers[("t", "b")].pods = [index.PodRecord("t", "b-0", "b", "trainer", "b-0", "b0", 2, 0, "train")] * 2
    views = [loaning.LoanView("t/a", 2, 2, 1, 2, priority=50),
             loaning.LoanView("t/b", 2, 2, 2, 2, priority=100)]
    spec = {"lending": {"lendable": True, "maxGPUsLent": 2}}
    assert loans.over_limit(spec, borrowers, views) == (4, 2)  # 8 lent, 2 allowed, only a's 4 unpinned
    assert loans.over_limit({"lending": {"lendable": False, "maxGPUsLent": 8}}, borrowers, views)[1] == 0
    assert loans.over_limit({"lending": {"lendable": True, "maxGPUsLent": 8}}, borrowers, views) == (0, 8)


def test_a_blocked_reclaim_is_reported_once_per_change(kube: builders.Kube, operator) -> None:
    """reclaimPolicy Shrink and a borrower at its minimum: nothing can be reclaimed, which one
    Warning says. Before, a new Event object every tick: 360 an hour at the default 10 s."""
    serve_lends(kube, reclaimPolicy="Shrink")
    serving.borrow_four_gpus_of_b0(kube, NS)
    kube.create_job(NS, serving.make_inference_job("chat", "serve", gpus=2, min_replicas=3, max_replicas=3),
                    plural="inferencejobs")
    wait_for(lambda: serve_events(kube, "ReclaimBlocked"), what="the blocked reclaim reported")
    time.sleep(TICKS)
    assert len(serve_events(kube, "ReclaimBlocked")) == 1


def test_the_victim_is_the_borrower_that_loses_least_by_its_checkpoints_age() -> None:
    """Below a grace a checkpoint takes, a victim loses the work since its last checkpoint. The
    operator priced every borrower at 0 s since, so the first by name went: here `a`, whose
    checkpoint was 55 minutes old, rather than `b`, checkpointed 5 s ago."""
    now = time.time()
    stamp = lambda ago: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - ago))  # noqa: E731
    old = {"status": {"lastCheckpoint": {"step": 9, "time": stamp(3300)}, "startTime": stamp(7200)}}
    fresh = {"status": {"lastCheckpoint": {"step": 9, "time": stamp(5)}, "startTime": stamp(7200)}}
    never = {"status": {"startTime": stamp(600)}}
    assert loans.checkpoint_age(old, now) == pytest.approx(3300, abs=2)
    assert loans.checkpoint_age(never, now) == pytest.approx(600, abs=2)
    assert loans.checkpoint_age({"status": {}}, now) == 0.0
    lending = {"lendable": True, "maxGPUsLent": 8, "reclaimGraceSeconds": 5}
    view = index.build_vc_view("serve", {"purpose": "inference", "lending": lending})
    offered = [loaning.LoanView(job, 1, 1, 1, 2, seconds_since_checkpoint=loans.checkpoint_age(body, now))
               for job, body in (("team/a", old), ("team/b", fresh))]
    (victim,) = loaning.plan_reclaim(view, 2, offered, now, "demand")
    assert victim.job == "team/b"


def test_an_event_outside_a_kopf_handler_is_written_through_the_api(cluster: EmulatedCluster,
                                                                     kube: builders.Kube) -> None:
    """A reconcile that a background resync woke has no kopf event queue: its first Event raised
    LookupError and the reconcile died between its placement and its pods."""
    vc = kube.get_vc("serve")
    api = cluster.api_client()

    async def outside_kopf() -> None:
        post = runner.event_poster(kube_client.KubeClient(api))
        post(vc, "Warning", "ReclaimBlocked", "written from a background task")
        await asyncio.sleep(0)
        for _ in range(50):
            if serve_events(kube, "ReclaimBlocked"):
                return
            await asyncio.sleep(0.1)

    asyncio.run(outside_kopf())
    (event,) = serve_events(kube, "ReclaimBlocked")
    assert event.message == "written from a background task" and event.type == "Warning"
    assert event.involved_object.kind == "VirtualCluster"
    assert event.involved_object.uid == vc["metadata"]["uid"]


def test_a_restarted_operator_keeps_a_training_lenders_line_reserve(cluster: EmulatedCluster) -> None:
    """A borrower of `lender`'s 8 GPUs is preempted for the lender's own job, and its old pods
    checkpoint while the operator restarts. The new operator must keep the 4 GPUs the lender's
    job waits for unlent from its start, before the lender's first tick (its VirtualCluster
    watch held here, as a busy API server may): the reserve lived only in memory, and the
    borrower's successors took the GPUs back, to be preempted again."""
    kube = training_lender(cluster)
    kubelet = Kubelet(kube, cluster.kmock, NS)

    def live(job: str) -> list[str]:
        return sorted(p.metadata.name for p in kube.pods(NS, job, "trainer")
                      if not p.metadata.deletion_timestamp)

    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST) as first:
        kube.create_job(NS, builders.make_training_job("guest", "borrower", replicas=2, max_replicas=2,
                                                       gpus=4))
        wait_for(lambda: len(live("guest")) == 2, what="the guest on the lender's nodes")
        kube.run_all_pods(NS, "guest")
        old = live("guest")
        kubelet.hold(old)  # they checkpoint for a while
        kube.create_job(NS, builders.make_training_job("owner", "lender", replicas=1, max_replicas=1, gpus=4))
        wait_for(lambda: kube.job_status(NS, "guest").get("preemptReplacements") == 2,
                 what="the guest preempted")
        wait_for(lambda: first.ctx.index.line_reserve.get("lender") == 4, what="the first operator's reserve")
    hold_kopf_lists(cluster, "virtualclusters", seconds=6)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST) as second:
        assert second.ctx.index.line_reserve.get("lender") == 4
        kubelet.release(old)
        wait_for(lambda: live("owner"), timeout=60, what="the lender's own job placed")
        assert kube.job_status(NS, "guest").get("preemptReplacements") == 2


def other_controllers_pod(name: str, node: str, gpus: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"nodeName": node, "containers": [
                {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def fragmented(cluster: EmulatedCluster, lender: str, borrower: str, **lending: object) -> builders.Kube:
    """`lender` owns two 4-GPU nodes (pool b, or pool a for a training lender) and lends all 8;
    `borrower` has none. Another controller's pods hold 3 GPUs of each for now, so a 2 × 1-GPU
    borrower created next takes one GPU on each node (the caller deletes x-<node> after)."""
    kube = builders.Kube(cluster.api_client())
    home, own = ("b", "a") if lender == "serve" else ("a", "b")
    kube.create_node(builders.make_node(f"{own}0", 0, pool=own))
    for node in (f"{home}0", f"{home}1"):
        kube.create_node(builders.make_node(node, 4, pool=home))
    vc = builders.make_virtual_cluster(lender, pool=home, lend=8)
    if lender == "serve":
        vc["spec"]["purpose"] = "inference"
    vc["spec"]["lending"].update(reclaimGraceSeconds=1, **lending)
    kube.create_vc(vc)
    kube.create_vc(builders.make_virtual_cluster(borrower, pool=own, borrow=8))
    for node in (f"{home}0", f"{home}1"):
        kube.core.create_namespaced_pod(NS, other_controllers_pod(f"x-{node}", node, 3))
        kube.core.patch_namespaced_pod_status(f"x-{node}", NS, {"status": {"phase": "Running"}})
    return kube


def borrow_one_gpu_of_each(kube: builders.Kube, borrower: str, nodes: list[str]) -> None:
    kube.create_job(NS, builders.make_training_job("guest", borrower, replicas=2, max_replicas=2, gpus=1))
    wait_for(lambda: len(kube.pods(NS, "guest", "trainer")) == 2, what="the guest on both nodes")
    kube.run_all_pods(NS, "guest")
    assert serving.nodes_of(kube, NS, "guest") == nodes
    for node in nodes:
        kube.core.delete_namespaced_pod(f"x-{node}", NS)


def chat(gpus: int) -> dict:
    body = yaml.safe_load(EXAMPLE.read_text())
    body["metadata"] = {"name": "chat"}
    body["spec"]["virtualCluster"] = "serve"
    body["spec"]["resources"]["gpus"] = gpus
    body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 1}
    return body


def test_a_replica_that_needs_a_whole_node_gets_one_back(cluster: EmulatedCluster) -> None:
    """`serve`'s two 4-GPU nodes each hold one 1-GPU pod of a borrower (placed while another
    controller's pods filled the rest); a replica of 4 GPUs then waits. 6 GPUs are free in total,
    so a reclaim counted in total wanted nothing and the replica waited for good: now the GPU on
    one node comes back (the borrower, a fixed gang, is stopped), and the replica is placed there."""
    kube = fragmented(cluster, "serve", "train")
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        borrow_one_gpu_of_each(kube, "train", ["b0", "b1"])
        kube.create_job(NS, chat(gpus=4), plural="inferencejobs")
        wait_for(lambda: kube.pods(NS, "chat", "server"), timeout=60, what="the replica of 4 GPUs placed")
        (reclaimed, *_) = wait_for(lambda: serve_events(kube, "Reclaimed"), what="the reclaim's Event")
        assert "need GPUs back on b0, each replica whole on one node" in reclaimed.message


def test_a_replica_no_longer_asked_of_a_lender_is_not_reclaimed_for(cluster: EmulatedCluster) -> None:
    """A replica of 4 waits on `serve` (reclaimPolicy Shrink: its fixed borrower cannot give
    way), then its InferenceJob is moved to a cluster that does not exist. When `serve` allows
    preemption, it must not stop the borrower for that replica: the wait it recorded stayed, and
    the node-by-node reclaim preempted the borrower for a replica that would never come."""
    kube = fragmented(cluster, "serve", "train", reclaimPolicy="Shrink")
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST) as op:
        borrow_one_gpu_of_each(kube, "train", ["b0", "b1"])
        kube.create_job(NS, chat(gpus=4), plural="inferencejobs")
        wait_for(lambda: op.ctx.serving_unplaced.get((NS, "chat")), what="the replica waiting on serve")
        kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "inferencejobs",
                                                   "chat", {"spec": {"virtualCluster": "nowhere"}})
        wait_for(lambda: "does not exist" in (kube.job_status(NS, "chat", plural="inferencejobs")
                                              .get("message") or ""), what="chat pointed at no cluster")
        kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "serve",
                                                {"spec": {"lending": {"reclaimPolicy": "Preempt"}}})
        time.sleep(TICKS)
        assert not serve_events(kube, "Reclaimed")
        assert not kube.job_status(NS, "guest").get("preemptReplacements")


def test_a_training_lenders_gang_gets_a_whole_node_back(cluster: EmulatedCluster) -> None:
    """The same fragmentation for a training lender's own job in line: a replica of 4 GPUs, and a
    borrower's 1-GPU pod on each of the lender's two 4-GPU nodes. line_wanted counted 6 free GPUs
    against 4 wanted and reclaimed nothing, for good."""
    kube = fragmented(cluster, "lender", "borrower")
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        borrow_one_gpu_of_each(kube, "borrower", ["a0", "a1"])
        kube.create_job(NS, builders.make_training_job("owner", "lender", replicas=1, max_replicas=1, gpus=4))
        wait_for(lambda: kube.pods(NS, "owner", "trainer"), timeout=60, what="the lender's gang of 4 placed")
        (reclaimed, *_) = wait_for(lambda: [e for e in kube.events("default", "lender")
                                            if e.reason == "Reclaimed"], what="the reclaim's Event")
        assert "each replica whole on one node" in reclaimed.message


def test_the_replicas_counted_waiting_are_what_the_demand_still_lacks() -> None:
    """The node-by-node reclaim counts an InferenceJob's waiting replicas from its last reconcile,
    capped by what its demand still lacks: a replica placed since holds its GPUs already (one run
    in three of a restart test preempted a borrower for it). Counted in replicas, not GPUs: while
    `resources.gpus` rolls from 8 to 4, the old 8-GPU replicas held more than their share of the
    demand, and the rolled replica's successor was hidden."""
    from huorn.operator import context

    def pod(name: str, gpus: int, deleting: bool = False) -> index.PodRecord:
        return index.PodRecord("ns", name, "chat", "server", name, "n0", gpus, 0, "serve", phase="Running",
                               deleting=deleting)

    def waiting(pods: list[index.PodRecord], replicas: int, unplaced: int) -> list[loans.WaitingReplica]:
        ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
        for p in pods:
            ctx.index.pods[("ns", p.name)] = p
        ctx.index.inference_demand[("ns", "chat")] = ("serve", replicas * 4)
        ctx.serving_unplaced[("ns", "chat")] = ("serve", 4, unplaced, {"gpu": "l4"})
        return loans.serving_replicas_waiting(ctx, "serve")

    one = [(4, {"gpu": "l4"})]  # each with its job's nodeSelector, for node_shortfall
    assert waiting([pod("a", 4), pod("b", 4)], replicas=3, unplaced=1) == one
    assert waiting([pod("a", 4), pod("b", 4), pod("c", 4)], replicas=3, unplaced=1) == []  # placed since
    assert waiting([pod("a", 8, deleting=True), pod("b", 8)], replicas=2, unplaced=1) == one  # the roll
    assert waiting([pod("a", 8), pod("b", 8), pod("a2", 4)], replicas=3 + 1, unplaced=1) == one  # surging


def test_a_reclaim_for_a_gang_with_a_node_selector_frees_gpus_on_the_nodes_it_selects() -> None:
    """h0 (H100s) holds 3 lent GPUs and 1 free, t0 (T4s) 2 and 2: a waiting replica of 4 GPUs is
    cheapest to fit on t0, but one that selects the H100s fits on h0 only. Counted on any node,
    its reclaim freed 2 GPUs on t0, where it could not go, and it went on waiting."""
    from huorn.operator import context

    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.observe_vc(builders.make_virtual_cluster("train", pool="a"))
    ctx.index.observe_node(builders.make_node("h0", 4, pool="a", gpu="h100"))
    ctx.index.observe_node(builders.make_node("t0", 4, pool="a", gpu="t4"))
    pods = [index.PodRecord("other", f"b-trainer-{i}", "b", "trainer", f"trainer-{i}", node, 1, 0, "research",
                            phase="Running") for i, node in enumerate(["h0"] * 3 + ["t0"] * 2)]
    for p in pods:
        ctx.index.pods[(p.namespace, p.name)] = p
    borrowers = {("other", "b"): loans.Borrower("other", "b", pods)}
    assert loans.node_shortfall(ctx, "train", borrowers, [(4, None)]) == (2, {"t0"})
    assert loans.node_shortfall(ctx, "train", borrowers, [(4, {"gpu": "h100"})]) == (3, {"h0"})
    assert loans.node_shortfall(ctx, "train", borrowers, [(4, {"gpu": "a100"})]) == (0, set())


def test_a_lender_reclaims_for_a_waiting_gang_with_a_selector_only_where_it_could_go() -> None:
    """The lender's own job `busy` holds a0 (its only H100 node); a borrower holds a1 (T4s). Its
    job `owner`, waiting for 4 H100s, cannot use a1: the line counted every node, stopped the
    borrower there, and held the GPUs unlent while `owner` went on waiting. With the borrower on
    a0 instead, the reclaim is for a0, where `owner` goes."""
    from huorn.operator import context, queue

    def lender(borrower_on: str) -> tuple[context.Context, dict]:
        """a0 H100 and a1 T4 and a2 H100, 4 GPUs each: `busy` on a0, the borrower on
        `borrower_on`, the lender's job `t` on the third."""
        ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
        ctx.index.observe_vc(builders.make_virtual_cluster("lender", pool="a", lend=8))
        for node, gpu in (("a0", "h100"), ("a1", "t4"), ("a2", "h100")):
            ctx.index.observe_node(builders.make_node(node, 4, pool="a", gpu=gpu))
        other = "a2" if borrower_on == "a1" else "a1"
        held = (("team", "busy", "a0", "lender"), ("other", "guest", borrower_on, "borrower"),
                ("team", "t", other, "lender"))
        for ns, job, node, vc in held:
            pod = index.PodRecord(ns, f"{job}-trainer-0", job, "trainer", "trainer-0", node, 4, 0, vc,
                                  phase="Running")
            ctx.index.pods[(ns, pod.name)] = pod
        ctx.queue.record(queue.QueuedJob("team", "owner", "lender", 50, 0.0, 4, missing=1,
                                         node_selector={"gpu": "h100"}))
        return ctx, loans.find_borrowers(ctx, "lender")

    ctx, borrowers = lender("a1")
    assert loans.line_wanted(ctx, "lender", borrowers) == (0, 0, [])  # nothing to reclaim or reserve
    ctx, borrowers = lender("a2")
    need, debt, line = loans.line_wanted(ctx, "lender", borrowers)
    assert (need, debt, [j.name for j in line]) == (4, 0, ["owner"])  # reserved; reclaimed where it goes:
    assert loans.node_shortfall(ctx, "lender", borrowers, [(4, {"gpu": "h100"})]) == (4, {"a2"})


def _trainer_nodes(kube: builders.Kube, job: str) -> list[str]:
    return [p.metadata.annotations["huorn.io/node"] for p in kube.pods(NS, job, "trainer")
            if not p.metadata.deletion_timestamp]


def test_gpus_reclaimed_for_a_selector_job_stay_on_its_nodes_until_it_is_placed(
        cluster: EmulatedCluster) -> None:
    """A borrower's gang of 4 holds a0, the lender's only H100 node (a1 has T4s, free); the
    lender's job `owner` waits for 4 H100s. Its reserve was a count over both nodes, so the
    borrower's successor took a0 again each time it was freed, 42 preemptions in 45 s with the
    owner never placed (a review). Now the freed a0 is kept for the owner: one reclaim, and the
    borrower's successor goes to a1."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(builders.make_node("a0", 4, pool="a", gpu="h100"))
    kube.create_node(builders.make_node("a1", 4, pool="a", gpu="t4"))
    kube.create_node(builders.make_node("b0", 0, pool="b"))
    lender = builders.make_virtual_cluster("lender", pool="a", lend=8)
    lender["spec"]["lending"]["reclaimGraceSeconds"] = 2
    kube.create_vc(lender)
    kube.create_vc(builders.make_virtual_cluster("borrower", pool="b", borrow=8))
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        h100 = {"gpu": "h100"}
        kube.create_job(NS, builders.make_training_job("guest", "borrower", replicas=1, max_replicas=1,
                                                       gpus=4, nodeSelector=h100))
        wait_for(lambda: _trainer_nodes(kube, "guest") == ["a0"], what="the borrower on a0")
        kube.run_all_pods(NS, "guest")
        # placed on a0 by its selector, which it then drops (live: no restart), free to go anywhere
        kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                                   "guest", {"spec": {"nodeSelector": None}})
        kube.create_job(NS, builders.make_training_job("owner", "lender", replicas=1, max_replicas=1, gpus=4,
                                                       nodeSelector=h100))
        wait_for(lambda: _trainer_nodes(kube, "owner") == ["a0"], what="the owner on a0", timeout=60)
        wait_for(lambda: _trainer_nodes(kube, "guest") == ["a1"], what="the borrower's successor on a1")
        assert kube.job_status(NS, "guest").get("preemptReplacements") == 1


def _inference_lender(kube: builders.Kube) -> None:
    """`serve` (inference, lends 8, reclaim grace 2 s) owns b0 (4 H100s) and b1 (4 T4s); `train`
    (no GPUs of its own) may borrow 8."""
    kube.create_node(builders.make_node("b0", 4, pool="b", gpu="h100"))
    kube.create_node(builders.make_node("b1", 4, pool="b", gpu="t4"))
    kube.create_node(builders.make_node("a0", 0, pool="a"))
    serve = builders.make_virtual_cluster("serve", pool="b", lend=8)
    serve["spec"]["purpose"] = "inference"
    serve["spec"]["lending"]["reclaimGraceSeconds"] = 2
    kube.create_vc(serve)
    kube.create_vc(builders.make_virtual_cluster("train", pool="a", borrow=8))


def _borrow_b0(kube: builders.Kube) -> None:
    """`guest` (4 GPUs) placed on b0 by a selector it then drops (live: no restart)."""
    kube.create_job(NS, builders.make_training_job("guest", "train", replicas=1, max_replicas=1, gpus=4,
                                                   nodeSelector={"gpu": "h100"}))
    wait_for(lambda: _trainer_nodes(kube, "guest") == ["b0"], what="the borrower on b0")
    kube.run_all_pods(NS, "guest")
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                               "guest", {"spec": {"nodeSelector": None}})


def test_an_inference_lender_reclaims_for_a_selector_replica_once(cluster: EmulatedCluster) -> None:
    """b0 (H100s) is lent to a borrower's gang, b1 (T4s) is free. A replica selecting H100s is
    placed on b0 after one reclaim, and the borrower's successor goes to b1: the freed b0 is
    kept for the replica (a review saw the successor retake it 38 times)."""
    kube = builders.Kube(cluster.api_client())
    _inference_lender(kube)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        _borrow_b0(kube)
        kube.create_job(NS, serving.make_inference_job("chat", "serve", gpus=4, nodeSelector={"gpu": "h100"}),
                        plural="inferencejobs")
        wait_for(lambda: [p.metadata.annotations["huorn.io/node"] for p in kube.pods(NS, "chat", "server")
                          if not p.metadata.deletion_timestamp] == ["b0"], what="the replica on b0",
                 timeout=60)
        wait_for(lambda: _trainer_nodes(kube, "guest") == ["b1"], what="the borrower's successor on b1")
        assert kube.job_status(NS, "guest").get("preemptReplacements") == 1


def test_an_inference_lender_reclaims_nothing_for_a_replica_no_node_can_hold(
        cluster: EmulatedCluster) -> None:
    """b0 is lent, b1 serves `busy` (no selector), so nothing is free. A replica selecting a
    product no node has was counted in the cluster's demand: the lender stopped the borrower,
    and the GPUs it freed sat reserved and idle (a review)."""
    kube = builders.Kube(cluster.api_client())
    _inference_lender(kube)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        _borrow_b0(kube)
        kube.create_job(NS, serving.make_inference_job("busy", "serve", gpus=4), plural="inferencejobs")
        wait_for(lambda: len(kube.pods(NS, "busy", "server")) == 1, what="busy on b1")
        nowhere = serving.make_inference_job("nowhere", "serve", gpus=4, nodeSelector={"gpu": "a100"})
        kube.create_job(NS, nowhere, plural="inferencejobs")
        wait_for(lambda: "of which it has none" in kube.job_status(NS, "nowhere", plural="inferencejobs")
                 .get("message", ""), what="the replica that fits no node waiting")
        time.sleep(TICKS)
        assert not kube.job_status(NS, "guest").get("preemptReplacements")
        assert _trainer_nodes(kube, "guest") == ["b0"]


def test_an_inference_lenders_count_leaves_out_jobs_that_select_nodes() -> None:
    """`chat` (H100s) has one replica on h0 and waits for a second; a borrower holds l0 (L4s),
    where chat cannot go. The untargeted count asked for the borrower's 8 GPUs back; only the
    node-by-node reclaim may speak for chat, and it finds nothing to free (a review)."""
    from huorn.operator import context

    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    serve = builders.make_virtual_cluster("serve", pool="b", lend=8)
    serve["spec"]["purpose"] = "inference"
    ctx.index.observe_vc(serve)
    ctx.index.observe_node(builders.make_node("h0", 8, pool="b", gpu="h100"))
    ctx.index.observe_node(builders.make_node("l0", 8, pool="b", gpu="l4"))
    for pod in (index.PodRecord("team", "chat-server-0", "chat", "server", "server-0", "h0", 8, 0, "serve",
                                phase="Running"),
                index.PodRecord("other", "b-trainer-0", "b", "trainer", "trainer-0", "l0", 8, 0, "train",
                                phase="Running")):
        ctx.index.pods[(pod.namespace, pod.name)] = pod
    chat = {"metadata": {"namespace": "team", "name": "chat"},
            "spec": {"virtualCluster": "serve", "resources": {"gpus": 8}, "nodeSelector": {"gpu": "h100"},
                     "autoscaling": {"minReplicas": 2}}, "status": {"desiredReplicas": 2}}
    ctx.index.observe_inference_job(chat)
    ctx.serving_unplaced[("team", "chat")] = ("serve", 8, 1, {"gpu": "h100"})
    borrowers = loans.find_borrowers(ctx, "serve")
    assert loans.count_wanted(ctx, "serve", borrowers) == 0
    waiting = loans.serving_replicas_waiting(ctx, "serve")
    assert waiting == [(8, {"gpu": "h100"})]
    assert loans.node_shortfall(ctx, "serve", borrowers, waiting) == (0, set())
    # a forecast of the whole service's load is met by chat's replica too: nothing to reclaim
    # (the replica left out of the count as well, the lender reclaimed l0 for load h0 served,
    # lent it again, and looped: a third review)
    ctx.index.forecast_demand["serve"] = 8
    assert loans.count_wanted(ctx, "serve", borrowers) == 0
    del ctx.index.forecast_demand["serve"]
    # the same job without a selector is the cluster's demand, counted as before
    del chat["spec"]["nodeSelector"]
    ctx.index.observe_inference_job(chat)
    assert loans.count_wanted(ctx, "serve", borrowers) == 8
    assert ctx.index.kept_on_nodes() == {}


def test_jobs_that_select_the_same_nodes_are_counted_against_them_once() -> None:
    """Two waiting jobs want 4 H100s each, and the lender has 4 (a0; a1 and a2 are T4s, 12 GPUs
    free in all): only the first is in the line, and its 4 GPUs are kept on a0. Both were
    counted, 8 GPUs were held back for them, and the lender lent 4 where it could lend 8."""
    from huorn.operator import context, queue

    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.observe_vc(builders.make_virtual_cluster("lender", pool="a", lend=12))
    for node, gpu in (("a0", "h100"), ("a1", "t4"), ("a2", "t4")):
        ctx.index.observe_node(builders.make_node(node, 4, pool="a", gpu=gpu))
    for i in range(2):
        ctx.queue.record(queue.QueuedJob("team", f"owner{i}", "lender", 50, float(i), 4, missing=1,
                                         node_selector={"gpu": "h100"}))
    need, debt, line = loans.line_wanted(ctx, "lender", {})
    assert (need, debt, [j.name for j in line]) == (4, 0, ["owner0"])
    loans.reserve_for_line(ctx, "lender", need, line)
    assert ctx.index.kept_on_nodes() == {"a0": 4}
    snap = ctx.index.build_snapshot()
    assert snap.lend_left("lender") == 8
    assert {v.name: v.kept for v in snap.node_views()} == {"a0": 4, "a1": 0, "a2": 0}


def test_what_a_lender_keeps_for_a_selector_job_goes_once_the_job_is_placed() -> None:
    """a0 and a3 have H100s: the lender keeps 4 for `owner`; placed on a0, it keeps none. The keep
    moved to a3 until the lender's next pass (a review), unlendable for nothing."""
    from huorn.operator import context, queue

    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.observe_vc(builders.make_virtual_cluster("lender", pool="a", lend=8))
    for node in ("a0", "a3"):
        ctx.index.observe_node(builders.make_node(node, 4, pool="a", gpu="h100"))
    owner = queue.QueuedJob("team", "owner", "lender", 50, 0.0, 4, missing=1, node_selector={"gpu": "h100"})
    ctx.queue.record(owner)
    need, _, line = loans.line_wanted(ctx, "lender", {})
    loans.reserve_for_line(ctx, "lender", need, line)
    assert sum(ctx.index.kept_on_nodes().values()) == 4
    placed = index.PodRecord("team", "owner-trainer-0", "owner", "trainer", "trainer-0", "a0", 4, 0, "lender")
    ctx.index.reservations[("team", placed.name)] = placed
    assert ctx.index.kept_on_nodes() == {}
