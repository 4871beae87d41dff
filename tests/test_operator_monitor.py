"""The operator's monitor: real kopf against KMock, real HTTP telemetry from the runtime's own code.

Each trainer pod's `/telemetry` is served by `huorn.runtime.telemetry.Telemetry` (the class the
trainer runs) on a loopback address of its own (127.0.0.2, 127.0.0.3, ...), all on one port, and
that address is patched into the pod's `status.podIP` as a kubelet would. The operator polls the
pods exactly as in a cluster; the tests drive the ranks' sequence numbers and step records.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import kmock
import pytest
from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.ranks import IPS, Ranks

from huorn.graph import mutate, serialise
from huorn.operator import cordon, training

pytest_plugins = ["kube.fixtures"]

NS = "team"


@pytest.fixture()
def ranks() -> Iterator[Ranks]:
    r = Ranks("llm")
    yield r
    r.close()


def start_operator(cluster: EmulatedCluster, port: int, progress_seconds: float = 30.0
                   ) -> operator_mod.OperatorThread:
    settings = dataclasses.replace(
        operator_mod.FAST, monitor_seconds=0.3, telemetry_port=port, telemetry_timeout_seconds=1.0,
        progress_seconds=progress_seconds,
    )
    return operator_mod.OperatorThread(cluster.api_client(), settings)


def run_with_ips(kube: builders.Kube, name: str, trainers: int) -> None:
    """Pods Running with their telemetry address in status.podIP, as the kubelet reports them."""
    wait_for(lambda: len(kube.pods(NS, name, "trainer")) == trainers, what=f"{trainers} trainer pods")
    for pod in kube.pods(NS, name):
        instance = pod.metadata.labels["huorn.io/instance"]
        status = {"phase": "Running", "podIP": IPS.get(instance, "127.0.0.9")}
        kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": status})
    wait_for(lambda: kube.job_status(NS, name).get("phase") == "Running", what="phase Running")


# A job long enough that a second replica pays for its restart: a replica of 2 GPUs computes
# the tiny model's batch twice as fast as one GPU, so its gradient exchange weighs more and a
# second replica gains 1.3×, less than the 20 s restart is worth in the 100 steps of the builder.
LONG = {"steps": 100_000, "globalBatch": 48, "microBatch": 4}


def decisions(kube: builders.Kube, name: str, action: str) -> list[dict]:
    return [d for d in kube.job_status(NS, name).get("decisions") or [] if d["action"] == action]


def start_goodput_job(kube: builders.Kube, name: str, replicas: int, max_replicas: int,
                      min_replicas: int = 1, **spec: Any) -> None:
    """A goodput TrainingJob of 2-GPU replicas on "train", run until its trainers have the
    addresses the test's Ranks serve their telemetry on."""
    kube.create_job(NS, builders.make_training_job(
        name, "train", replicas=replicas, max_replicas=max_replicas, gpus=2,
        elasticity={"minReplicas": min_replicas, "maxReplicas": max_replicas, "policy": "goodput"},
        **spec))
    run_with_ips(kube, name, replicas)


def pinned_node(pod: object) -> str:
    """The node the operator placed a pod on (its required node affinity on the hostname)."""
    required = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution  # type: ignore[attr-defined]
    return str(required.node_selector_terms[0].match_expressions[0].values[0])


def is_cordoned(node: object) -> object:
    spec = getattr(node, "spec", None)
    return node if spec is not None and spec.unschedulable else None


def hang_replica_1(ranks: Ranks) -> None:
    """Both ranks at collective #40; then rank 0 enters #41 and waits there, rank 1 never does."""
    ranks.advance("trainer-0", 40)
    ranks.advance("trainer-1", 40)
    ranks.by_replica["trainer-0"].enter_collective("allreduce")


def test_goodput_policy_grows_job_within_max_replicas(cluster, kube: builders.Kube) -> None:
    grower = Ranks("grow", gpus_per_replica=2, replicas=1)
    try:
        with start_operator(cluster, grower.port):
            start_goodput_job(kube, "grow", replicas=1, max_replicas=2, optimization=LONG)
            for step in range(1, 13):  # one replica, steady steps, a known noise scale
                grower.by_replica["trainer-0"].record_step(step, 0.8 + 0.01 * (step % 3), 0.1, 3.0,
                                                           1000.0, 40.0)
            resized = wait_for(lambda: decisions(kube, "grow", "resize"), what="a resize decision")
            wait_for(lambda: len(kube.pods(NS, "grow", "trainer")) == 2, what="a second trainer pod")
            assert "goodput allocator: grow to 2" in resized[-1]["reason"]
            wait_for(lambda: kube.has_event(NS, "grow", "Resize", contains="goodput"), what="Resize")
            # The allocator never goes past maxReplicas, and the reconcile keeps its choice.
            run_with_ips(kube, "grow", 2)
            assert kube.job_status(NS, "grow")["targetReplicas"] == 2
            assert len(decisions(kube, "grow", "resize")) == 1
    finally:
        grower.close()


def test_a_grown_gang_moves_to_where_the_allocator_placed_it(cluster, kube: builders.Kube) -> None:
    """The allocator prices a gang at the span of its own placement; the reconcile used to keep
    the running pods and put the new ones wherever they fitted. Here the grower's first replica
    shares a node with a filler, so one more replica beside it would span both nodes of the pool,
    while the allocator placed the gang of two on the empty node: the pod on the shared node goes,
    and both replicas run on the other one."""
    grower = Ranks("grow", gpus_per_replica=2, replicas=1)
    try:
        with start_operator(cluster, grower.port):
            filler = builders.make_training_job("fill", "train", replicas=1, max_replicas=1, gpus=2)
            kube.create_job(NS, filler)
            wait_for(lambda: kube.pods(NS, "fill", "trainer"), what="the filler placed")
            start_goodput_job(kube, "grow", replicas=1, max_replicas=2, optimization=LONG)
            (shared,) = {pinned_node(p) for p in kube.pods(NS, "fill", "trainer")}
            assert [pinned_node(p) for p in kube.pods(NS, "grow", "trainer")] == [shared]  # the case
            for step in range(1, 13):
                grower.by_replica["trainer-0"].record_step(step, 0.8 + 0.01 * (step % 3), 0.1, 3.0,
                                                           1000.0, 40.0)
            resized = wait_for(lambda: decisions(kube, "grow", "resize"), what="a resize decision")
            assert "goodput allocator: grow to 2" in resized[-1]["reason"]

            def moved() -> list[str] | None:
                # NB: the state it ends in, not the first with two pods: the first successor may be
                # created on the empty node before the replica on the shared one is marked deleted
                pods = [p for p in kube.pods(NS, "grow", "trainer") if not p.metadata.deletion_timestamp]
                nodes = sorted(pinned_node(p) for p in pods)
                return nodes if len(nodes) == 2 and len(set(nodes)) == 1 and shared not in nodes else None

            wait_for(moved, what="both trainer pods on the node the allocator chose, none on the shared one")
    finally:
        grower.close()


def test_replicas_a_move_removed_go_while_their_successors_wait_for_gpus(cluster,
                                                                         kube: builders.Kube) -> None:
    """A move decided on GPUs that are gone by the reconcile (a race the arbiter's check cannot
    close): the replica it removed is deleted while the new ones wait, as a shrink's would be.
    Kept, it ran outside the graph: unseen by the monitor, the loans and the preemptions."""
    with start_operator(cluster, 9):  # no telemetry: the monitor never decides here
        elastic = {"minReplicas": 1, "maxReplicas": 2}  # goodput (the default): the count stands
        kube.create_job(NS, builders.make_training_job("mover", "train", gpus=4, elasticity=elastic))
        run_with_ips(kube, "mover", 1)
        (home,) = [pinned_node(p) for p in kube.pods(NS, "mover", "trainer")]
        other = "a1" if home == "a0" else "a0"
        # of a lower priority: it may be stopped for the mover, but not for GPUs the mover frees itself
        filler = builders.make_training_job("fill", "train", replicas=1, max_replicas=1, gpus=4, priority=10)
        kube.create_job(NS, filler)
        wait_for(lambda: [pinned_node(p) for p in kube.pods(NS, "fill", "trainer")] == [other], what="filler")
        # the move, as the monitor writes it: off `home`, two replicas onto `other`, which is full

        def moved() -> bool:
            """Patched into status, again if a reconcile that read the job before wrote its graph
            over it (under a loaded suite that happened)."""
            g = serialise.from_status(kube.job_status(NS, "mover")["graph"])
            if any(m.reason.endswith("(a test's move)") for m in g.log):
                return True
            mutate.resize(g, "trainer", 2, reason="goodput allocator: grow to 2 (a test's move)",
                          remove=["trainer-0"], nodes=[other, other])
            kube.custom.patch_namespaced_custom_object_status(
                builders.GROUP, builders.VERSION, NS, "trainingjobs", "mover",
                {"status": {"graph": serialise.to_status(g)}})
            return False

        wait_for(moved, what="the move in status")
        # the new replicas found no room (an Event: the status message lasts only until the
        # removed replica's GPUs free, the emulator deleting pods at once)
        wait_for(lambda: kube.has_event(NS, "mover", "Unplaceable", contains="needs 8 GPUs"),
                 what="the new replicas waiting for GPUs")

        def instances() -> list[str]:
            return sorted(p.metadata.labels["huorn.io/instance"] for p in kube.pods(NS, "mover", "trainer")
                          if not p.metadata.deletion_timestamp)

        wait_for(lambda: "trainer-0" not in instances(), what="the removed replica deleted")
        # its GPUs freed, the gang of two fits (home, and 4 borrowed): placed wherever it fits
        wait_for(lambda: instances() == ["trainer-0-g1", "trainer-1"], what="the new replicas placed")
        # the removed replica's GPUs were the mover's own: no gang was stopped for them
        assert [p.metadata.deletion_timestamp for p in kube.pods(NS, "fill", "trainer")] == [None]
        assert not [d for d in kube.job_status(NS, "fill").get("decisions") or [] if d["action"] != "resize"
                    and "preempt" in d["reason"]]


def test_another_job_is_placed_while_a_removed_replica_s_delete_waits_on_the_api(
        cluster, kube: builders.Kube) -> None:
    """Every job's placement takes the operator's placement lock. The delete of a replica a move
    removed used to be awaited under it, so while the API server held that delete (throttling,
    a slow etcd), no job anywhere could be placed. Here the delete is held until a job on another
    virtual cluster has its pod: it must not wait for it."""
    release = threading.Event()
    held: list[str] = []

    async def hold(request: kmock.Request) -> None:
        if request.name == "mover-trainer-0":
            held.append(request.name)
            for _ in range(600):  # at most 30 s, released by the test
                if release.is_set():
                    break
                await asyncio.sleep(0.05)
        raise NotImplementedError  # answered by the emulator

    assert cluster.kmock is not None
    cluster.kmock["delete", kmock.resource("", "v1", "pods")] << hold
    try:
        with start_operator(cluster, 9):  # no telemetry: the monitor never decides here
            elastic = {"minReplicas": 1, "maxReplicas": 2}
            kube.create_job(NS, builders.make_training_job("mover", "train", gpus=4, elasticity=elastic))
            run_with_ips(kube, "mover", 1)
            (home,) = [pinned_node(p) for p in kube.pods(NS, "mover", "trainer")]
            other = "a1" if home == "a0" else "a0"
            filler = builders.make_training_job("fill", "train", replicas=1, max_replicas=1, gpus=4,
                                                priority=10)
            kube.create_job(NS, filler)
            wait_for(lambda: [pinned_node(p) for p in kube.pods(NS, "fill", "trainer")] == [other],
                     what="filler")
            g = serialise.from_status(kube.job_status(NS, "mover")["graph"])
            mutate.resize(g, "trainer", 2, reason="goodput allocator: grow to 2 (a test's move)",
                          remove=["trainer-0"], nodes=[other, other])
            kube.custom.patch_namespaced_custom_object_status(
                builders.GROUP, builders.VERSION, NS, "trainingjobs", "mover",
                {"status": {"graph": serialise.to_status(g)}})
            wait_for(lambda: held, what="the removed replica's delete reaching the API")
            kube.create_job(NS, builders.make_training_job("elsewhere", "serve", replicas=1,
                                                           max_replicas=1, gpus=4))
            # (the hold lasts up to 30 s: with the delete awaited under the lock this times out)
            wait_for(lambda: kube.pods(NS, "elsewhere", "trainer"), timeout=10.0,
                     what="a job on another cluster placed while the delete is held")
            release.set()
            wait_for(lambda: all(p.metadata.labels["huorn.io/instance"] != "trainer-0"
                                 for p in kube.pods(NS, "mover", "trainer")),
                     what="the removed replica deleted once the API answers")
    finally:
        release.set()


def test_training_progress_and_the_last_checkpoint_reach_status(cluster, kube: builders.Kube,
                                                                ranks: Ranks) -> None:
    """What `kubectl get tj` prints (Step, Loss; Batch with -o wide) comes from the ranks'
    telemetry, and a landed checkpoint reaches status.lastCheckpoint at once, even between
    progress writes."""
    for step in range(1, 8):  # all before the pods run: the first poll sees all seven
        for replica in IPS:
            ranks.by_replica[replica].record_step(step, 0.5, 0.1, 3.0 - 0.1 * step, 2000.0 + step, None,
                                                  global_batch=48 + step, learning_rate=0.001 * step)
    with start_operator(cluster, ranks.port, progress_seconds=3600.0):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=2, max_replicas=2, gpus=2))
        run_with_ips(kube, "llm", 2)
        status = wait_for(lambda: (s := kube.job_status(NS, "llm")).get("step") == 7 and s,
                          what="status.step 7")
        assert status["loss"] == pytest.approx(2.3) and status["tokensPerSecond"] == pytest.approx(2007.0)
        assert (status["batchSize"], status["learningRate"]) == (55, pytest.approx(0.007))
        # 7 of the 100 declared steps; the first write's rate is the step's own 0.5 s: 93 × 0.5 s.
        assert (status["progressPercent"], status["estimatedRemainingSeconds"]) == (7, 46)
        assert status["estimatedRemaining"] == "46s"
        checkpoint = {"step": 7, "path": "/checkpoints/step-00000007", "time": "2026-11-30T11:00:00Z"}
        for replica in IPS:
            ranks.by_replica[replica].set_parameter("checkpoint", dict(checkpoint))
        landed = wait_for(lambda: kube.job_status(NS, "llm").get("lastCheckpoint"), what="lastCheckpoint")
        assert landed == checkpoint
        assert kube.job_status(NS, "llm")["phase"] == "Running"


def test_injected_hang_ends_in_s4_cordon_and_replacement(cluster, kube: builders.Kube, ranks: Ranks) -> None:
    with start_operator(cluster, ranks.port):
        kube.create_job(NS, builders.make_training_job(
            "llm", "train", replicas=2, max_replicas=2, gpus=2, remediation={"hangTimeout": "2s"}))
        run_with_ips(kube, "llm", 2)
        culprit = kube.core.read_namespaced_pod("llm-trainer-1", NS)
        node = culprit.metadata.annotations["huorn.io/node"]
        hang_replica_1(ranks)
        replaced = wait_for(lambda: decisions(kube, "llm", "replace"), what="an S4 decision", timeout=60)
        assert "remediation S4" in replaced[0]["reason"] and "rank(s) [1]" in replaced[0]["reason"]
        cordoned = wait_for(lambda: is_cordoned(kube.core.read_node(node)), what=f"node {node} cordoned")
        assert [(t.key, t.effect) for t in cordoned.spec.taints] == [("huorn.io/cordoned", "NoSchedule")]
        wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "llm", "trainer")]
                 == ["llm-trainer-0", "llm-trainer-1-g1"], what="the replacement pod")
        new = kube.core.read_namespaced_pod("llm-trainer-1-g1", NS)
        assert new.metadata.annotations["huorn.io/node"] != node, "the replacement avoids the cordoned node"
        reasons = {e.reason for e in kube.events(NS, "llm")}
        assert {"Remediate", "Cordoned"} <= reasons
        assert kube.job_status(NS, "llm")["cordonedVersion"] >= 2


def test_max_mitigation_caps_the_ladder(cluster, kube: builders.Kube, ranks: Ranks) -> None:
    with start_operator(cluster, ranks.port):
        kube.create_job(NS, builders.make_training_job(
            "llm", "train", replicas=2, max_replicas=2, gpus=2,
            remediation={"hangTimeout": "2s", "maxMitigation": "rebalance"}))
        run_with_ips(kube, "llm", 2)
        hang_replica_1(ranks)
        capped = wait_for(lambda: decisions(kube, "llm", "set-param"), what="a capped decision", timeout=60)
        assert "capped" in capped[0]["reason"] and "maxMitigation is rebalance" in capped[0]["reason"]
        graph = kube.job_status(NS, "llm")["graph"]
        trainer = next(v for v in graph["vertices"] if v["name"] == "trainer")
        assert trainer["params"]["mitigation"]["action"] == "capped"
        wait_for(lambda: kube.has_event(NS, "llm", "Remediation", kind="Warning"), what="Remediation")
        # Capped means nothing is replaced and no node is cordoned, however long the hang lasts.
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Running", what="still Running")
        assert decisions(kube, "llm", "replace") == []
        assert not any(is_cordoned(n) for n in kube.core.list_node().items)
        names = [p.metadata.name for p in kube.pods(NS, "llm", "trainer")]
        assert names == ["llm-trainer-0", "llm-trainer-1"]
        assert len(decisions(kube, "llm", "set-param")) == 1


def test_operator_killed_after_write_ahead_finishes_s4_once(
    cluster, kube: builders.Kube, ranks: Ranks
) -> None:
    """The state an operator leaves when it dies right after writing its S4 decision: the decision is
    in status, nothing else happened. The next operator cordons and replaces once, and its own monitor
    does not decide again although the old rank's telemetry still shows the hang."""
    with start_operator(cluster, ranks.port):
        kube.create_job(NS, builders.make_training_job(
            "llm", "train", replicas=2, max_replicas=2, gpus=2, remediation={"hangTimeout": "2s"}))
        run_with_ips(kube, "llm", 2)
    node = kube.core.read_namespaced_pod("llm-trainer-1", NS).metadata.annotations["huorn.io/node"]
    hang_replica_1(ranks)
    status = kube.job_status(NS, "llm")
    g = serialise.from_status(status["graph"])
    m = mutate.replace_instance(g, "trainer-1", reason="remediation S4 (cordon-replace-restart): rank 1 hung")
    m.detail[cordon.DETAIL_KEY] = node
    kube.custom.patch_namespaced_custom_object_status(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", "llm",
        {"status": {"graph": serialise.to_status(g), "decisions": training.build_decisions(g)}})
    with start_operator(cluster, ranks.port) as op:
        wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "llm", "trainer")]
                 == ["llm-trainer-0", "llm-trainer-1-g1"], what="the replacement pod")
        wait_for(lambda: is_cordoned(kube.core.read_node(node)), what="cordon")
        run_with_ips(kube, "llm", 2)
        settle = kube.job_status(NS, "llm")["graph"]["version"]
        watch_past_hang_timeout(op)
        assert kube.job_status(NS, "llm")["graph"]["version"] == settle
    assert len(decisions(kube, "llm", "replace")) == 1
    assert len([e for e in kube.events(NS, "llm") if e.reason == "Cordoned"]) == 1
    assert kube.job_status(NS, "llm")["cordonedVersion"] == m.version


def test_operator_killed_mid_remediation_never_decides_twice(
    cluster, kube: builders.Kube, ranks: Ranks
) -> None:
    op = start_operator(cluster, ranks.port).__enter__()
    try:
        kube.create_job(NS, builders.make_training_job(
            "llm", "train", replicas=2, max_replicas=2, gpus=2, remediation={"hangTimeout": "2s"}))
        run_with_ips(kube, "llm", 2)
        hang_replica_1(ranks)
        wait_for(lambda: decisions(kube, "llm", "replace"), what="an S4 decision", timeout=60)
    finally:
        op.__exit__(None, None, None)  # stopped wherever it was: cordoning, deleting or placing
    with start_operator(cluster, ranks.port) as second:
        wait_for(lambda: [p.metadata.name for p in kube.pods(NS, "llm", "trainer")]
                 == ["llm-trainer-0", "llm-trainer-1-g1"], what="the replacement pod")
        run_with_ips(kube, "llm", 2)
        watch_past_hang_timeout(second)
        (replace,) = decisions(kube, "llm", "replace")
        status = kube.job_status(NS, "llm")
        cordoned = [n.metadata.name for n in kube.core.list_node().items if is_cordoned(n)]
        assert len(cordoned) == 1 and status["cordonedVersion"] == replace["graphVersion"]
        # NB: at most one Event: kopf posts Events in the background, so one queued when the
        # first operator stopped may be lost (Events are best-effort); a second cordon would
        # post a second one
        assert len([e for e in kube.events(NS, "llm") if e.reason == "Cordoned"]) <= 1



def watch_past_hang_timeout(op: operator_mod.OperatorThread) -> None:
    """Wait until the running monitor has polled telemetry for longer than the 2 s hang timeout
    (10 polls of 0.3 s), with the old rank's hang still served, so a second decision would show."""
    def polls() -> int:
        state = op.ctx.monitors.get((NS, "llm"))
        return state.polls if state is not None else 0

    start = wait_for(lambda: polls() or None, what="the monitor polling")
    wait_for(lambda: polls() >= start + 10, what="10 monitor polls", timeout=60)


def test_a_restarted_operator_finds_a_hang_that_began_before_it_at_its_first_polls(
    cluster, kube: builders.Kube, ranks: Ranks
) -> None:
    """The ranks' telemetry says when their sequence numbers last changed, so a detector that
    starts late times the stall from there. Before, a restarted operator timed it from its own
    first poll, and a job hung before the restart waited a whole hangTimeout more."""
    with start_operator(cluster, ranks.port):
        kube.create_job(NS, builders.make_training_job(
            "llm", "train", replicas=2, max_replicas=2, gpus=2, remediation={"hangTimeout": "3s"}))
        run_with_ips(kube, "llm", 2)
    hang_replica_1(ranks)  # with no operator watching
    hung_at = time.time()
    wait_for(lambda: time.time() - hung_at > 3.5, what="the hang outlasting hangTimeout")
    with start_operator(cluster, ranks.port) as second:
        wait_for(lambda: decisions(kube, "llm", "replace"), what="the S4 decision", timeout=60)
        state = second.ctx.monitors[(NS, "llm")]
        # 3 s of 0.3 s polls would be 10 polls from its own first one; the ranks' clock needs one
        assert state.polls <= 3, state.polls


def test_a_goodput_batch_rule_job_gets_the_allocators_batch_in_its_config_map(
        cluster, kube: builders.Kube) -> None:
    """batchRule goodput through the operator: the monitor learns from the trainers' telemetry that
    a larger batch costs little (a step is mostly fixed cost) and loses nothing statistically (a
    large noise scale), and hands the gang the allocator's batch: a `batch` set-param in the graph,
    written to the job's ConfigMap as batch.json, with no pod replaced."""
    import json

    from huorn.backends.kubernetes import manifests

    ranks = Ranks("gb", gpus_per_replica=2)
    try:
        with start_operator(cluster, ranks.port):
            # two replicas, as the ranks' telemetry reports (2 × 2 GPUs), held there
            start_goodput_job(kube, "gb", replicas=2, max_replicas=2, min_replicas=2,
                              optimization={"steps": 100_000, "globalBatch": 48, "microBatch": 4,
                                            "batchRule": "goodput"})
            pods = [p.metadata.name for p in kube.pods(NS, "gb", "trainer")]
            step = 0
            for batch in (48, 96, 192):
                for _ in range(5):
                    step += 1
                    ranks.by_replica["trainer-0"].record_step(step, 0.95 + 0.001 * batch, 0.1, 3.0,
                                                              1000.0, 1e5, global_batch=batch)
            (setting,) = wait_for(lambda: [d for d in kube.job_status(NS, "gb").get("decisions") or []
                                           if d["action"] == "set-param"], what="the batch decision")
            assert "goodput allocator: global batch 48 ->" in setting["reason"]
            ref = manifests.JobRef.from_body(kube.get_job(NS, "gb"))
            name = manifests.config_map_name(ref)
            delivered = wait_for(lambda: (kube.core.read_namespaced_config_map(name, NS).data or {})
                                 .get(manifests.BATCH_KEY), what="batch.json in the ConfigMap")
            chosen = json.loads(delivered)["globalBatch"]
            assert chosen == 2 * 8 * 48  # the cap: 8 × globalBatch a replica, nearly free here
            assert [p.metadata.name for p in kube.pods(NS, "gb", "trainer")] == pods
    finally:
        ranks.close()
