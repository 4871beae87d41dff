"""Which nodes and GPUs placement may use: nodes that take no new pods (not Ready, tainted), GPUs
other controllers' pods hold, and nodes that two VirtualClusters' selectors both match.

The unit tests read the operator's mirror (huorn.operator.index) directly; the others run real
kopf against the KMock emulator, as tests/test_operator_lifecycle.py does.
"""

from __future__ import annotations

import dataclasses
import time
import types
from typing import Any

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

from huorn.backends.kubernetes import manifests
from huorn.operator import context, index, loans, serving, training
from huorn.scheduler import placement

pytest_plugins = ["kube.fixtures"]

NS = "team"
UNREACHABLE = {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"}


def _node(name: str, gpus: int, *, ready: str | None = None, taints: list[dict[str, str]] | None = None,
          **labels: str) -> dict[str, Any]:
    body = builders.make_node(name, gpus, **labels)
    if taints is not None:
        body["spec"] = {"taints": taints}
    if ready is not None:
        body["status"]["conditions"] = [{"type": "Ready", "status": ready, "reason": "NodeStatusUnknown"}]
    return body


def _pinned_node(pod: Any) -> str:
    terms = pod.spec.affinity.node_affinity.required_during_scheduling_ignored_during_execution
    return str(terms.node_selector_terms[0].match_expressions[0].values[0])


# ---------------------------------------------------------------- 1. nodes that take no new pods
def test_node_not_ready_or_tainted_takes_no_new_pods() -> None:
    """Before, only spec.unschedulable kept a node out of placement."""
    assert index.build_node_record(_node("n", 4)).unschedulable is False
    unknown = index.build_node_record(_node("n", 4, ready="Unknown"))
    assert unknown.unschedulable and unknown.why == "not Ready (Unknown: NodeStatusUnknown)"
    tainted = index.build_node_record(_node("n", 4, taints=[UNREACHABLE]))
    assert tainted.unschedulable and tainted.why == "taint node.kubernetes.io/unreachable:NoSchedule"
    no_execute = index.build_node_record(_node("n", 4, taints=[{"key": "maint", "effect": "NoExecute"}]))
    assert no_execute.unschedulable
    # What Huorn's pods tolerate, and a mere preference, leave the node usable.
    for taint in ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                  {"key": "spot", "effect": "PreferNoSchedule"}):
        assert not index.build_node_record(_node("n", 4, taints=[taint])).unschedulable, taint
    # A NoExecute taint on the GPU key is not tolerated: the pods tolerate NoSchedule only.
    gpu_execute = {"key": "nvidia.com/gpu", "effect": "NoExecute"}
    assert index.build_node_record(_node("n", 4, taints=[gpu_execute])).unschedulable
    assert index.build_node_record(_node("n", 4, ready="True")).unschedulable is False


def test_snapshot_places_nothing_on_a_node_not_ready_but_counts_its_pods() -> None:
    ctx = context.Context(client=None, post_event=lambda *_: None)  # type: ignore[arg-type]
    ctx.index.nodes["a0"] = index.build_node_record(_node("a0", 4, ready="Unknown", pool="a"))
    ctx.index.nodes["a1"] = index.build_node_record(_node("a1", 4, pool="a"))
    ctx.index.vcs["train"] = {"members": {"nodeSelector": {"matchLabels": {"pool": "a"}}}}
    ctx.index.pods[(NS, "old-trainer-0")] = index.PodRecord(
        NS, "old-trainer-0", "old", "trainer", "trainer-0", "a0", 2, 0, "train", phase="Running")
    snap = ctx.index.build_snapshot()
    assert snap.capacity("train") == 4 and snap.free("train") == 4
    where = snap.place("train", 1, 4)
    assert isinstance(where, placement.Placement) and where.assignments == ["a1"]
    blocked = snap.place("train", 2, 4)
    assert isinstance(blocked, placement.Unplaceable)
    assert "a0: not Ready (Unknown: NodeStatusUnknown)" in blocked.reason, blocked.reason
    assert isinstance(snap.place_at("train", ["a0"], 1), placement.Unplaceable)


def test_operator_keeps_new_pods_off_an_unreachable_node(cluster: EmulatedCluster) -> None:
    """The reviewer's case: a0 Ready=Unknown and tainted unreachable sorts first and has room;
    the trainer went there, and was put back there at each replacement until the job failed."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(_node("a0", 4, ready="Unknown", taints=[UNREACHABLE], pool="a"))
    kube.create_node(_node("a1", 4, pool="a"))
    kube.create_vc(builders.make_virtual_cluster("train", pool="a"))
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=1, max_replicas=1, gpus=4))
        pods = wait_for(lambda: kube.pods(NS, "llm", "trainer"), what="a trainer pod")
        assert [_pinned_node(p) for p in pods] == ["a1"]
        # What the pods tolerate is what the mirror assumes they tolerate.
        for pod in pods:
            for t in pod.spec.tolerations or []:
                assert index.tolerated({"key": t.key, "value": t.value, "effect": t.effect}), t
        ready = wait_for(lambda: _vc_ready(kube, "train"), what="the cluster's Ready condition")
        assert ready["message"].startswith(
            "2 nodes, 8 GPUs, 4 allocated; 4 GPUs take new pods, "
            "1 node(s) take none: a0 (not Ready (Unknown: NodeStatusUnknown))"), ready


def _vc_ready(kube: builders.Kube, vc: str) -> dict[str, Any] | None:
    status = kube.get_vc(vc).get("status") or {}
    ready = [c for c in status.get("conditions") or [] if c["type"] == "Ready"]
    return ready[0] if ready and "allocated" in ready[0]["message"] and status.get("allocated") else None


# ---------------------------------------------------------------- 3. overlapping members
def _vc(name: str, created: str, pool: str = "a") -> dict[str, Any]:
    body = builders.make_virtual_cluster(name, pool=pool)
    body["metadata"]["creationTimestamp"] = created
    return body


def test_the_oldest_cluster_owns_a_node_two_select() -> None:
    """Before, the first by name did: team-a, created later, took team-b's nodes."""
    idx = index.ClusterIndex()
    for name in ("a0", "a1"):
        idx.nodes[name] = index.build_node_record(_node(name, 4, pool="a"))
    idx.observe_vc(_vc("team-b", "2026-01-01T10:00:00Z"))
    idx.observe_vc(_vc("team-a", "2026-01-01T10:05:00Z"))
    assert [n.name for n in idx.members_of("team-b")] == ["a0", "a1"] and idx.members_of("team-a") == []
    assert idx.claimed_from("team-a") == {"team-b": ["a0", "a1"]} and idx.claimed_from("team-b") == {}
    assert idx.claimants(idx.nodes["a0"]) == ["team-b", "team-a"]
    # The same second: by name, as before.
    idx.observe_vc(_vc("team-a", "2026-01-01T10:00:00Z"))
    assert [n.name for n in idx.members_of("team-a")] == ["a0", "a1"]
    idx.forget_vc("team-a")
    assert [n.name for n in idx.members_of("team-b")] == ["a0", "a1"] and "team-a" not in idx.vc_created


def test_a_younger_overlapping_cluster_is_not_ready_and_warned(cluster: EmulatedCluster) -> None:
    """The reviewer's case: team-b (older) and team-a both select pool a; team-a took both nodes
    by name, and team-b reported 0 nodes, 0 GPUs and Ready=True."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(builders.make_node("a0", 4, pool="a"))
    kube.create_node(builders.make_node("a1", 4, pool="a"))
    kube.create_vc(builders.make_virtual_cluster("team-b", pool="a"))
    # creationTimestamp has whole seconds: team-a must be created in a later one to be younger
    born = kube.get_vc("team-b")["metadata"]["creationTimestamp"]
    wait_for(lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()) > born, what="the next second")
    kube.create_vc(builders.make_virtual_cluster("team-a", pool="a"))
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, builders.make_training_job("bjob", "team-b", replicas=2, max_replicas=2, gpus=4))
        pods = wait_for(lambda: len(found := kube.pods(NS, "bjob", "trainer")) == 2 and found,
                        what="team-b's job placed on its nodes")
        assert sorted(_pinned_node(p) for p in pods) == ["a0", "a1"]
        loser = wait_for(lambda: _ready_of(kube, "team-a", "NodesClaimed"), what="team-a NodesClaimed")
        assert loser["status"] == "False"
        assert loser["message"].startswith("2 node(s) it selects belong to the older virtual cluster "
                                           "team-b (a0, a1)"), loser
        winner = wait_for(lambda: _ready_of(kube, "team-b", "Tracking"), what="team-b Ready")
        assert winner["status"] == "True"
        capacity = [kube.get_vc(vc)["status"]["capacity"] for vc in ("team-b", "team-a")]
        assert capacity == [8, 0]
        warned = wait_for(lambda: [e for ns in ("default", NS) for e in kube.events(ns, "team-a")
                                   if e.reason == "NodesClaimed"], what="a NodesClaimed event")
        assert warned[0].type == "Warning" and "team-b (a0, a1)" in warned[0].message


def _ready_of(kube: builders.Kube, vc: str, reason: str) -> dict[str, Any] | None:
    status = kube.get_vc(vc).get("status") or {}
    ready = [c for c in status.get("conditions") or [] if c["type"] == "Ready" and c["reason"] == reason]
    return ready[0] if ready else None


# ---------------------------------------------------------------- 2. other controllers' GPUs
def _foreign_pod(name: str, node: str, gpus: int, phase: str = "Running") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NS},
            "spec": {"nodeName": node, "containers": [
                {"name": "c", "image": "x", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def test_gpus_of_other_controllers_pods_are_not_free() -> None:
    idx = index.ClusterIndex()
    for name in ("a0", "a1"):
        idx.nodes[name] = index.build_node_record(_node(name, 4, pool="a"))
    idx.observe_vc(_vc("train", "2026-01-01T10:00:00Z"))
    assert idx.observe_foreign_pod(_foreign_pod("kueue-0", "a0", 3)) is False
    snap = idx.build_snapshot()
    assert snap.free("train") == 5
    assert isinstance(snap.place("train", 2, 4), placement.Unplaceable)
    # A Huorn pod placed there before (the overlap this used to allow) stays bound to its job.
    idx.pods[(NS, "old-trainer-0")] = index.PodRecord(NS, "old-trainer-0", "old", "trainer", "trainer-0",
                                                      "a0", 2, 0, "train", phase="Running")
    snap = idx.build_snapshot()
    assert snap.free("train") == 4 and "t/old" not in snap.bindings() and f"{NS}/old" in snap.bindings()
    # An ended or deleted pod gives them back; one not bound to a node, or without GPUs, holds none.
    assert idx.observe_foreign_pod(_foreign_pod("kueue-0", "a0", 3, phase="Succeeded")) is True
    idx.observe_foreign_pod(_foreign_pod("pending", "", 4))
    idx.observe_foreign_pod(_foreign_pod("cpu-only", "a1", 0))
    assert idx.foreign == {}
    # init containers count when they ask for more than the containers together
    spec = {"containers": [{"resources": {"requests": {"nvidia.com/gpu": "1"}}}],
            "initContainers": [{"resources": {"limits": {"nvidia.com/gpu": "2"}}}]}
    assert index.requested_gpus(spec) == 2


def test_operator_places_around_pods_of_another_controller(cluster: EmulatedCluster) -> None:
    """The reviewer's case: a Kueue job's pod holds a0's 4 GPUs; Huorn placed its gang there."""
    kube = builders.Kube(cluster.api_client())
    for node in ("a0", "a1", "a2"):
        kube.create_node(builders.make_node(node, 4, pool="a"))
    kube.create_vc(builders.make_virtual_cluster("train", pool="a"))
    kube.core.create_namespaced_pod(NS, _foreign_pod("kueue-job-0", "a0", 4))
    kube.core.patch_namespaced_pod_status("kueue-job-0", NS, {"status": {"phase": "Running"}})
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=1, max_replicas=1, gpus=4))
        pods = wait_for(lambda: kube.pods(NS, "llm", "trainer"), what="llm's trainer")
        (taken,) = [_pinned_node(p) for p in pods]
        assert taken in ("a1", "a2")
        # The watch, not only the startup listing: another one fills the last node.
        last = "a2" if taken == "a1" else "a1"
        kube.core.create_namespaced_pod(NS, _foreign_pod("kueue-job-1", last, 4))
        ready = wait_for(lambda: _allocated(kube, "train", 12), what="the cluster's status")
        assert "(8 by pods Huorn does not manage)" in ready["message"], ready
        kube.create_job(NS, builders.make_training_job("next", "train", replicas=1, max_replicas=1, gpus=4))
        wait_for(lambda: "needs 4 GPUs" in str(kube.job_status(NS, "next").get("message")),
                 what="next waiting")
        assert kube.pods(NS, "next", "trainer") == []
        kube.core.delete_namespaced_pod("kueue-job-0", NS)
        nxt = wait_for(lambda: kube.pods(NS, "next", "trainer"), what="next's trainer, once a0 is free")
        assert [_pinned_node(p) for p in nxt] == ["a0"]


def _allocated(kube: builders.Kube, vc: str, gpus: int) -> dict[str, Any] | None:
    ready = _ready_of(kube, vc, "Tracking")
    return ready if ready and f"{gpus} allocated" in ready["message"] else None


def test_a_serving_replica_is_not_placed_on_gpus_another_controllers_pod_holds() -> None:
    """InferenceJob replicas are placed from serving.free_gpus, not the snapshot: it counted only
    Huorn's pods, and a replica went to a node whose GPUs a Kueue job's pod held (Pending)."""
    idx = index.ClusterIndex()
    for name in ("a0", "a1"):
        idx.nodes[name] = index.build_node_record(_node(name, 4, pool="a"))
    idx.observe_vc(_vc("train", "2026-01-01T10:00:00Z"))
    idx.observe_foreign_pod(_foreign_pod("kueue-0", "a0", 3))
    ctx = types.SimpleNamespace(index=idx)
    assert serving.free_gpus(ctx, "train") == {"a0": 1, "a1": 4}  # type: ignore[arg-type]
    assert serving.choose_nodes(serving.free_gpus(ctx, "train"), 2, 2) == ["a1", "a1"]  # type: ignore[arg-type]


def test_a_lender_counts_free_only_what_nodes_taking_pods_have_left() -> None:
    """What a lender reclaims is what its demand needs beyond its free GPUs. Pods on a node that
    takes no new pods were counted as using capacity that node no longer adds, and other
    controllers' pods as using nothing: it read 4 free GPUs here where 7 are."""
    idx = index.ClusterIndex()
    idx.nodes["a0"] = index.build_node_record(_node("a0", 4, pool="a"))
    idx.nodes["a1"] = index.build_node_record(_node("a1", 4, pool="a", ready="False"))
    idx.nodes["a2"] = index.build_node_record(_node("a2", 4, pool="a"))
    idx.observe_vc(_vc("train", "2026-01-01T10:00:00Z"))
    idx.pods[(NS, "old-trainer-0")] = index.PodRecord(NS, "old-trainer-0", "old", "trainer", "trainer-0",
                                                      "a1", 4, 0, "train", phase="Running")
    idx.observe_foreign_pod(_foreign_pod("kueue-0", "a0", 1))
    ctx = types.SimpleNamespace(index=idx)
    assert loans.free_gpus(ctx, "train") == 7  # type: ignore[arg-type]
    # and a training lender's line keeps its need unlent in placement's snapshot
    idx.line_reserve["train"] = 3
    assert idx.build_snapshot().virtual_cluster("train").reserved_gpus == 3
    idx.forget_vc("train")
    assert idx.line_reserve == {}


def test_a_lender_counts_other_controllers_gpus_beside_huorn_pods_being_deleted() -> None:
    """The pods being deleted are left out of a lender's use; capping other controllers' GPUs by
    what those same pods leave on the node under-counted them while they terminated."""
    idx = index.ClusterIndex()
    idx.nodes["a0"] = index.build_node_record(_node("a0", 4, pool="a"))
    idx.observe_vc(_vc("train", "2026-01-01T10:00:00Z"))
    idx.pods[(NS, "old-trainer-0")] = index.PodRecord(NS, "old-trainer-0", "old", "trainer", "trainer-0",
                                                      "a0", 3, 0, "train", phase="Running", deleting=True)
    idx.observe_foreign_pod(_foreign_pod("kueue-0", "a0", 2))
    assert loans.free_gpus(types.SimpleNamespace(index=idx), "train") == 2  # type: ignore[arg-type]


def test_a_node_back_to_ready_wakes_the_line_before_its_resync(cluster: EmulatedCluster) -> None:
    """A job waiting only for a not-Ready node placed at its resync timer (a minute and more in a
    cluster): the node's return wakes the line, as GPUs freed by a job do."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(_node("a0", 4, ready="Unknown", taints=[UNREACHABLE], pool="a"))
    kube.create_vc(builders.make_virtual_cluster("train", pool="a"))
    slow = dataclasses.replace(operator_mod.FAST, resync_seconds=120.0, mirror_resync_seconds=120.0)
    with operator_mod.OperatorThread(cluster.api_client(), slow):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=1, max_replicas=1, gpus=4))
        wait_for(lambda: (kube.job_status(NS, "llm") or {}).get("phase") == "Pending", what="llm waiting")
        assert kube.pods(NS, "llm", "trainer") == []
        kube.core.patch_node("a0", {"spec": {"taints": []}})
        kube.core.patch_node_status("a0", {"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady"}]}})
        pods = wait_for(lambda: kube.pods(NS, "llm", "trainer"), timeout=20, what="llm placed on a0")
        assert [_pinned_node(p) for p in pods] == ["a0"]


def test_labelling_a_node_wakes_the_jobs_that_select_it_before_their_resync(cluster: EmulatedCluster) -> None:
    """A job that selects gpu=a100 waits, its message saying to label nodes so; labelling a0 so
    placed it only at its resync timer (30 s by default), where editing the selector placed it
    at once (a review). A node's new labels wake the line, as its return to Ready does."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(builders.make_node("a0", 4, pool="a", gpu="t4"))
    kube.create_vc(builders.make_virtual_cluster("train", pool="a"))
    slow = dataclasses.replace(operator_mod.FAST, resync_seconds=120.0, mirror_resync_seconds=120.0)
    with operator_mod.OperatorThread(cluster.api_client(), slow):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=1, max_replicas=1, gpus=4,
                                                       nodeSelector={"gpu": "a100"}))
        wait_for(lambda: "carries gpu=a100" in kube.condition(NS, "llm", "Reconciling").get("message", ""),
                 what="llm waiting for a node labelled gpu=a100")
        kube.core.patch_node("a0", {"metadata": {"labels": {"gpu": "a100"}}})
        pods = wait_for(lambda: kube.pods(NS, "llm", "trainer"), timeout=20, what="llm placed on a0")
        assert [_pinned_node(p) for p in pods] == ["a0"]


# ---------------------------------------------------------------- 4. taints a cluster tolerates
DEDICATED = {"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}
TOLERATE_DEDICATED = {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}


def _tolerating(name: str, created: str, tolerations: list[dict[str, Any]]) -> dict[str, Any]:
    body = _vc(name, created)
    body["spec"]["members"]["tolerations"] = tolerations
    return body


def test_a_cluster_that_tolerates_its_nodes_taint_places_there() -> None:
    """A GPU pool tainted dedicated=gpu:NoSchedule took no Huorn pod at all: nothing let a
    platform team say its pods may go there."""
    idx = index.ClusterIndex()
    idx.observe_node(_node("a0", 4, taints=[DEDICATED], pool="a"))
    idx.observe_node(_node("b0", 4, taints=[DEDICATED], pool="b"))
    assert idx.nodes["a0"].why == "taint dedicated:NoSchedule"  # no cluster yet
    assert idx.observe_vc(_vc("team-a", "2026-01-01T10:00:00Z")) == []
    assert idx.nodes["a0"].unschedulable and idx.tolerations_on("a0") == []
    # The cluster names the taint: its node opens, and only its own (b0 is no member).
    assert idx.observe_vc(_tolerating("team-a", "2026-01-01T10:00:00Z", [TOLERATE_DEDICATED])) == ["a0"]
    assert not idx.nodes["a0"].unschedulable and idx.nodes["b0"].unschedulable
    assert idx.tolerations_on("a0") == [TOLERATE_DEDICATED] and idx.tolerations_on("b0") == []
    snap = idx.build_snapshot()
    assert isinstance(snap.place("team-a", 1, 4), placement.Placement)
    # A node seen again (a watch event) is judged with its owner's tolerations, not without.
    assert not idx.observe_node(_node("a0", 4, taints=[DEDICATED], pool="a")).unschedulable
    # Another value, or another effect, is another taint.
    other = {"key": "dedicated", "value": "infer", "effect": "NoSchedule"}
    assert idx.observe_node(_node("a0", 4, taints=[other], pool="a")).why == "taint dedicated:NoSchedule"
    execute = {"key": "dedicated", "value": "gpu", "effect": "NoExecute"}
    assert idx.observe_node(_node("a0", 4, taints=[execute], pool="a")).unschedulable
    # Cordoned or not Ready: no toleration helps.
    down = idx.observe_node(_node("a0", 4, ready="False", taints=[DEDICATED], pool="a"))
    assert down.why.startswith("not Ready")
    record = idx.observe_node(_node("a0", 4, taints=[DEDICATED], pool="a"))
    record.cordon()
    assert record.why == "cordoned"


def test_the_owners_tolerations_decide_and_follow_the_node_to_a_new_owner() -> None:
    """A younger cluster that also selects the node does not open it for the owner's pods; once
    the owner is gone, the node is judged by its new owner's tolerations."""
    idx = index.ClusterIndex()
    idx.observe_node(_node("a0", 4, taints=[DEDICATED], pool="a"))
    idx.observe_vc(_vc("owner", "2026-01-01T10:00:00Z"))
    assert idx.observe_vc(_tolerating("younger", "2026-01-01T10:05:00Z", [{"operator": "Exists"}])) == []
    assert idx.nodes["a0"].unschedulable and idx.tolerations_on("a0") == []
    assert idx.forget_vc("owner") == ["a0"]
    assert idx.tolerations_on("a0") == [{"operator": "Exists"}] and not idx.nodes["a0"].unschedulable


def test_pods_carry_the_tolerations_of_the_node_they_are_pinned_to() -> None:
    # none named: the list every pod had before (pods stay byte-identical across the upgrade)
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert manifests.pod_tolerations() == [gpu]
    stored = {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule", "extra": 1}
    everything = {"operator": "Exists", "key": "", "value": "", "effect": ""}
    lost = [{"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
            for key in manifests.NODE_LOST_TAINTS]  # (a wildcard's guard, below)
    assert manifests.pod_tolerations([stored, dict(manifests.GPU_TOLERATION), everything]) == [
        dict(manifests.GPU_TOLERATION), *lost, TOLERATE_DEDICATED, {"operator": "Exists"}]
    # what the pod carries is what the mirror judged the node by
    assert index.tolerated(DEDICATED, manifests.pod_tolerations([stored]))
    assert not index.tolerated(DEDICATED, manifests.pod_tolerations())


def test_operator_places_on_tainted_nodes_once_the_cluster_tolerates_them(cluster: EmulatedCluster) -> None:
    """A pool tainted dedicated=gpu:NoSchedule: the job waits and the cluster says why; once the
    cluster names the toleration, the waiting job is placed there at once (the change wakes the
    line) and its pod tolerates the taint, as the kube-scheduler will require."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(_node("a0", 4, taints=[DEDICATED], pool="a"))
    kube.create_vc(builders.make_virtual_cluster("train", pool="a"))
    slow = dataclasses.replace(operator_mod.FAST, resync_seconds=120.0, mirror_resync_seconds=120.0)
    with operator_mod.OperatorThread(cluster.api_client(), slow):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=1, max_replicas=1, gpus=4))
        waiting = wait_for(lambda: (c := kube.condition(NS, "llm", "Reconciling"))
                           .get("reason") == "Unplaceable" and c, what="the job waiting")
        assert "a0: taint dedicated:NoSchedule" in waiting["message"], waiting
        assert kube.pods(NS, "llm", "trainer") == []
        conditions = lambda: (kube.get_vc("train").get("status") or {}).get("conditions") or []  # noqa: E731
        ready = wait_for(lambda: next((c for c in conditions() if c["type"] == "Ready"
                                       and "take none" in c["message"]), None), what="the cluster's note")
        assert ready["message"].endswith(
            "1 node(s) take none: a0 (taint dedicated:NoSchedule); Huorn's pods tolerate a taint the "
            "cluster lists in spec.members.tolerations"), ready
        kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "train",
                                                {"spec": {"members": {"tolerations": [TOLERATE_DEDICATED]}}})
        pods = wait_for(lambda: kube.pods(NS, "llm", "trainer"), timeout=20, what="llm placed on a0")
        assert [_pinned_node(p) for p in pods] == ["a0"]
        tolerations = [{"key": t.key, "operator": t.operator, "value": t.value, "effect": t.effect}
                       for t in pods[0].spec.tolerations]
        assert tolerations == [{"key": "nvidia.com/gpu", "operator": "Exists", "value": None,
                                "effect": "NoSchedule"}, TOLERATE_DEDICATED]


LOST = [{"key": key, "effect": "NoExecute"} for key in manifests.NODE_LOST_TAINTS]


def _first_match(taint: dict[str, Any], tolerations: list[dict[str, Any]]) -> dict[str, Any]:
    """The toleration Kubernetes' taint manager reads for the taint (the first that matches)."""
    return next(t for t in tolerations if manifests.toleration_matches(t, taint))


def test_a_toleration_of_every_taint_keeps_kubernetes_300_s_on_a_lost_node() -> None:
    """Found by review: `{operator: Exists}` matched the lost node's NoExecute taints with no
    tolerationSeconds, so the admission gave no 300 s and the pods stayed Running on a dead node
    for ever, never replaced."""
    for everything in ({"operator": "Exists"}, {"operator": "Exists", "effect": "NoExecute"}):
        carried = manifests.pod_tolerations([everything])
        assert [_first_match(t, carried).get("tolerationSeconds") for t in LOST] == [300, 300], carried
        assert carried[-1] == everything  # the cluster's own still tolerates the rest
    # a NoSchedule wildcard does not match them: nothing added, as a cluster naming one by key
    assert manifests.pod_tolerations([{"operator": "Exists", "effect": "NoSchedule"}]) == [
        dict(manifests.GPU_TOLERATION), {"operator": "Exists", "effect": "NoSchedule"}]
    named = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": 60}
    # the cluster's own seconds for a key it names, in whichever order it lists them (found by a
    # second review: a wildcard listed first had matched first, and the pods stayed for ever)
    for listed in ([named, {"operator": "Exists"}], [{"operator": "Exists"}, named]):
        carried = manifests.pod_tolerations(listed)
        assert [_first_match(t, carried).get("tolerationSeconds") for t in LOST] == [300, 60], listed
    # a key named with another effect does not match the NoExecute taint: the wildcard would
    not_ready_no_schedule = {"key": "node.kubernetes.io/not-ready", "operator": "Exists",
                             "effect": "NoSchedule"}
    carried = manifests.pod_tolerations([not_ready_no_schedule, {"operator": "Exists"}])
    assert [_first_match(t, carried).get("tolerationSeconds") for t in LOST] == [300, 300]
    # a key-less toleration with seconds already bounds the stay: nothing in front of it
    bounded = {"operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 60}
    carried = manifests.pod_tolerations([bounded])
    assert carried == [dict(manifests.GPU_TOLERATION), bounded]
    assert [_first_match(t, carried).get("tolerationSeconds") for t in LOST] == [60, 60]
    # and the mirror keeps a node with a lost taint (Ready still True for a moment) out, whatever the order
    for listed in ([{"operator": "Exists"}, named], [not_ready_no_schedule, {"operator": "Exists"}]):
        for taint in LOST:
            assert not index.tolerated(taint, manifests.pod_tolerations(listed)), (listed, taint)


def test_a_no_execute_taint_tolerated_for_a_while_takes_no_new_pods() -> None:
    """Found by review: with tolerationSeconds 0 on a NoExecute taint the node was judged open, and
    each pod placed there was evicted at once and replaced on the same node."""
    drain = {"key": "maintenance", "value": "drain", "effect": "NoExecute"}
    for seconds, usable in ((0, False), (3600, False), (None, True)):
        toleration = {"key": "maintenance", "operator": "Equal", "value": "drain", "effect": "NoExecute",
                      **({} if seconds is None else {"tolerationSeconds": seconds})}
        idx = index.ClusterIndex()
        idx.observe_node(_node("a0", 4, taints=[drain], pool="a"))
        idx.observe_vc(_tolerating("train", "2026-01-01T10:00:00Z", [toleration]))
        assert idx.nodes["a0"].unschedulable is not usable, seconds
        assert isinstance(idx.build_snapshot().place("train", 1, 4), placement.Placement) is usable


def test_a_status_write_of_a_cluster_judges_no_node_again() -> None:
    """Most VirtualCluster events are its own status writes: each judged every node again (143 ms
    at 4,000 nodes and 50 clusters, measured by review)."""
    idx = index.ClusterIndex()
    idx.observe_node(_node("a0", 4, taints=[DEDICATED], pool="a"))
    body = _tolerating("team-a", "2026-01-01T10:00:00Z", [TOLERATE_DEDICATED])
    assert idx.observe_vc(body) == ["a0"]
    idx.nodes["a0"].unschedulable = True  # a marker: judging again would clear it
    assert idx.observe_vc({**body, "status": {"allocated": 4}}) == []
    assert idx.nodes["a0"].unschedulable
    assert idx.observe_vc(_tolerating("team-a", "2026-01-01T10:00:00Z", [])) == []  # spec changed
    assert idx.nodes["a0"].why == "taint dedicated:NoSchedule"


async def test_a_trainer_carries_the_tolerations_read_where_it_was_placed(cluster: EmulatedCluster) -> None:
    """Found by review: the pod's tolerations were read after the write-ahead status round trip;
    a cluster edit that landed meanwhile pinned the pod to a node it did not tolerate. Read under
    the placement lock now, with the judgement that chose the node."""
    kube = builders.Kube(cluster.api_client())
    kube.create_node(_node("a0", 4, taints=[DEDICATED], pool="a"))
    kube.create_vc(_tolerating("train", "2026-01-01T10:00:00Z", [TOLERATE_DEDICATED]))
    ctx = await operator_mod.direct_context(cluster.api_client())
    assert not ctx.index.nodes["a0"].unschedulable
    kube.create_job(NS, builders.make_training_job("llm", "train", replicas=1, max_replicas=1, gpus=4))
    real, edited = ctx.client.patch_status, []

    async def patch_status(plural: str, ns: Any, name: str, status: dict[str, Any]) -> Any:
        out = await real(plural, ns, name, status)
        if plural == training.PLURAL and "graph" in status and not edited:
            edited.append(name)  # the cluster's watch delivers an edit during the write-ahead
            fresh = await ctx.client.get_custom("virtualclusters", None, "train")
            fresh["spec"]["members"]["tolerations"] = []
            ctx.index.observe_vc(fresh)
        return out

    ctx.client.patch_status = patch_status  # type: ignore[method-assign]
    await training.reconcile(ctx, await ctx.client.get_custom(training.PLURAL, NS, "llm"))
    assert edited == ["llm"]
    (pod,) = kube.pods(NS, "llm", "trainer")
    assert _pinned_node(pod) == "a0"
    carried = [{k: v for k, v in (("key", t.key), ("operator", t.operator), ("value", t.value),
                                  ("effect", t.effect)) if v is not None} for t in pod.spec.tolerations]
    assert index.tolerated(DEDICATED, carried), carried
