"""Several installs of Huorn on one cluster, each serving its own namespaces (`watchNamespaces`).

Each install's watches see only its namespaces, while VirtualClusters and nodes are shared. A
cluster lends only through the install that serves every namespace that may use it, so the
install that places a borrower is the one that hears its lender's InferenceJobs and reclaims; and
a reclaim never writes the graph of a job another install serves, whose own reconciles would write
their older graph back over it.
"""

from __future__ import annotations

import kmock
from kube import builders
from kube.cluster import wait_for

from huorn.backends.kubernetes import client as kube_client
from huorn.backends.kubernetes import manifests
from huorn.graph import compiler, mutate, serialise
from huorn.operator import allocation, context, index, loans, training, validation, virtualclusters
from huorn.scheduler import placement

pytest_plugins = ["kube.fixtures"]

POOL_A = {"members": {"nodeSelector": {"matchLabels": {"pool": "a"}}}, "borrowing": {"maxGPUsBorrowed": 8}}
LENDS = {"lendable": True, "maxGPUsLent": 8, "reclaimGraceSeconds": 45}


def serving_cluster(namespaces: list[str] | None) -> dict:
    spec = {"members": {"nodeSelector": {"matchLabels": {"pool": "b"}}}, "purpose": "inference",
            "lending": LENDS}
    return spec | ({"namespaces": namespaces} if namespaces else {})


def build_ctx(served: set[str], client: kube_client.KubeClient | None = None,
              serve_namespaces: list[str] | None = None) -> context.Context:
    ctx = context.Context(client=client, post_event=lambda *_: None,  # type: ignore[arg-type]
                          namespaces=frozenset(served))
    ctx.index.nodes["a0"] = index.NodeRecord("a0", 4, {"pool": "a"})
    ctx.index.nodes["b0"] = index.NodeRecord("b0", 8, {"pool": "b"})
    ctx.index.vcs["train"] = POOL_A
    ctx.index.vcs["serve"] = serving_cluster(serve_namespaces)
    return ctx


def running_borrower(kube: builders.Kube) -> None:
    """team/elastic, two replicas of 4 GPUs running as its status records (its pods are the
    test's to place)."""
    kube.create_job("team", builders.make_training_job("elastic", "train", replicas=2, max_replicas=2, gpus=4,
                                                       elasticity={"minReplicas": 1, "maxReplicas": 2}))
    graph = compiler.compile(validation.load_job(kube.get_job("team", "elastic")))
    mutate.resize(graph, "trainer", 2, reason="start")
    status = {"phase": "Running", "graph": serialise.to_status(graph), "decisions": []}
    kube.custom.patch_namespaced_custom_object_status(builders.GROUP, builders.VERSION, "team",
                                                      "trainingjobs", "elastic", {"status": status})


def test_a_cluster_lends_only_through_an_install_that_serves_every_namespace_that_may_use_it() -> None:
    assert build_ctx(set()).index.build_snapshot().lend_left("serve") == 8  # one install: all
    # "serve" admits every namespace: an install of "team" alone would never hear of the
    # InferenceJobs of the others, so it does not lend it to its jobs
    partial = build_ctx({"team"})
    assert not partial.index.serves_all_of("serve")
    assert partial.index.build_snapshot().lend_left("serve") == 0
    gang = ["trainer-0", "trainer-1"]
    where = allocation.place_missing(partial.index.build_snapshot(), "train", gang, 4, {})
    assert not isinstance(where, placement.Placement)  # a0's 4 GPUs only: the gang of 8 waits
    assert build_ctx({"team"}, serve_namespaces=["team"]).index.build_snapshot().lend_left("serve") == 8
    assert build_ctx({"team", "serving"}, serve_namespaces=["team", "serving"]).index.serves_all_of("serve")
    assert not build_ctx({"team"}, serve_namespaces=["team", "serving"]).index.serves_all_of("serve")
    fitted = allocation.place_missing(build_ctx(set()).index.build_snapshot(), "train",
                                      ["trainer-0", "trainer-1"], 4, {})
    assert isinstance(fitted, placement.Placement) and sorted(fitted.assignments) == ["a0", "b0"]


def test_a_borrower_another_install_serves_gives_back_its_pods_but_its_graph_is_left_alone(
        cluster, kube: builders.Kube) -> None:
    """The install serving the lender's namespace reclaims from a borrower of "team", which it
    does not serve (placed before the other install stopped borrowing there, say): the pod on the
    lender goes with the lender's grace; its job's status, the other install's to write, does not
    change. The reclaim used to shrink it through a reconcile of its own, racing the owner's."""
    running_borrower(kube)
    before = kube.job_status("team", "elastic")
    ctx = build_ctx({"serving"}, kube_client.KubeClient(cluster.api_client()), serve_namespaces=["serving"])
    for instance in ("trainer-0", "trainer-1"):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"elastic-{instance}", "namespace": "team",
                            "labels": {manifests.LABEL_JOB: "elastic", manifests.LABEL_VERTEX: "trainer",
                                       manifests.LABEL_INSTANCE: instance},
                            "annotations": {manifests.ANNOTATION_NODE: "b0", manifests.ANNOTATION_GPUS: "4",
                                            manifests.ANNOTATION_VC: "train"}},
               "spec": {"containers": [{"name": "trainer", "image": "x"}]}}
        kube.core.create_namespaced_pod("team", pod)
        ctx.index.observe_pod({**pod, "status": {"phase": "Running"}})  # as the watch reports it
    # the lender's InferenceJob, in the namespace this install serves, needs 4 of b0's 8 GPUs
    ctx.index.observe_inference_job({"metadata": {"namespace": "serving", "name": "chat"},
                                     "spec": {"virtualCluster": "serve", "resources": {"gpus": 4},
                                              "autoscaling": {"minReplicas": 1}}})
    vc_body = {"metadata": {"name": "serve"}, "spec": ctx.index.vcs["serve"]}
    marked: list[tuple[str, dict]] = []

    async def note(request: kmock.Request) -> None:
        marked.append((request.name, (request.data or {}).get("metadata", {}).get("annotations", {})))
        raise NotImplementedError  # answered by the emulator

    assert cluster.kmock is not None
    cluster.kmock["patch", kmock.resource("", "v1", "pods")] << note
    (applied,) = cluster.call(loans.reclaim(ctx, vc_body))
    assert applied.replicas_released == 1 and applied.job == "team/elastic"
    # marked before it goes, so that its owner replaces it as a preemption, not a failure
    assert marked == [("elastic-trainer-1", {manifests.ANNOTATION_RECLAIMED: "serve"})]
    wait_for(lambda: [p.metadata.name for p in kube.pods("team", "elastic")
                      if not p.metadata.deletion_timestamp] == ["elastic-trainer-0"],
             what="the newest replica's pod deleted")
    after = kube.job_status("team", "elastic")
    assert after["graph"] == before["graph"] and after.get("decisions") == []


def test_only_an_install_that_serves_all_of_a_cluster_writes_its_waiting_line(cluster,
                                                                              kube: builders.Kube) -> None:
    """Each install knows only its own jobs waiting in line: two that both wrote a cluster's
    waitingJobs flipped it between their two counts at every tick."""
    kube.custom.patch_cluster_custom_object(builders.GROUP, builders.VERSION, "virtualclusters", "serve",
                                            {"spec": {"namespaces": ["serving"]}})  # the fixture's, b0
    head = {"position": 1, "job": "serving/big", "kind": "TrainingJob", "priority": 50, "gpus": 4}
    kube.custom.patch_cluster_custom_object_status(builders.GROUP, builders.VERSION, "virtualclusters",
                                                   "serve", {"status": {"waitingJobs": 3, "waitingGPUs": 12,
                                                                        "line": [head]}})
    client = kube_client.KubeClient(cluster.api_client())
    for served, expected in (({"team"}, (3, 12, [head])), ({"serving"}, (0, 0, []))):
        ctx = build_ctx(served, client, serve_namespaces=["serving"])
        body = kube.get_vc("serve")
        cluster.call(virtualclusters.reconcile(ctx, body))
        status = kube.get_vc("serve")["status"]
        assert (status["waitingJobs"], status["waitingGPUs"], status.get("line")) == expected, served
        assert status["capacity"] == 8  # the rest of the usage, every install's alike


def test_the_owner_replaces_a_pod_another_install_reclaimed_without_spending_its_restarts(
        cluster, kube: builders.Kube) -> None:
    """The reclaimed trainer exits 143 on SIGTERM and its pod ends Failed: replaced as any failed
    pod, it spent one of maxRestarts (3 by default) per reclaim, and the fourth failed the job."""
    body = builders.make_training_job("elastic", "train", replicas=2, max_replicas=2, gpus=2,
                                      elasticity={"minReplicas": 2, "maxReplicas": 2})
    kube.create_job("team", body)
    ctx = build_ctx({"team"}, kube_client.KubeClient(cluster.api_client()), serve_namespaces=["serving"])
    cluster.call(training.reconcile(ctx, kube.get_job("team", "elastic")))  # places the gang
    trainers = wait_for(lambda: len(kube.pods("team", "elastic", "trainer")) == 2
                        and kube.pods("team", "elastic", "trainer"), what="the gang")
    for pod in kube.pods("team", "elastic"):
        ctx.index.observe_pod(kube.api.sanitize_for_serialization(pod) | {"status": {"phase": "Running"}})
    victim = kube.api.sanitize_for_serialization(trainers[-1])
    victim["metadata"].setdefault("annotations", {})[manifests.ANNOTATION_RECLAIMED] = "serve"
    victim["status"] = {"phase": "Failed", "containerStatuses": [
        {"name": "trainer", "ready": False, "restartCount": 0, "image": "x", "imageID": "x",
         "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}]}
    ctx.index.observe_pod(victim)  # as the watch reports it once the trainer has exited
    cluster.call(training.reconcile(ctx, kube.get_job("team", "elastic")))
    status = kube.job_status("team", "elastic")
    (replaced,) = [d for d in status["decisions"] if d["action"] == "replace"]
    assert "virtual cluster serve reclaimed its GPUs" in replaced["reason"]
    assert status.get("restartsUsed", 0) == 0 and status.get("phase") != "Failed"


def test_an_install_that_no_longer_lends_a_cluster_gives_back_its_borrowers_there(
        cluster, kube: builders.Kube) -> None:
    """"serve" admits every namespace and this install serves only "team": it lends it nothing.
    Its borrower there, placed before (when it served every namespace, say), is one that no
    install would ever reclaim for a demand it sees, so this install gives it back itself."""
    running_borrower(kube)
    ctx = build_ctx({"team"}, kube_client.KubeClient(cluster.api_client()))  # serve: every namespace
    for instance, node in (("trainer-0", "a0"), ("trainer-1", "b0")):
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"elastic-{instance}", "namespace": "team",
                            "labels": {manifests.LABEL_JOB: "elastic", manifests.LABEL_VERTEX: "trainer",
                                       manifests.LABEL_INSTANCE: instance},
                            "annotations": {manifests.ANNOTATION_NODE: node, manifests.ANNOTATION_GPUS: "4",
                                            manifests.ANNOTATION_VC: "train"}},
               "spec": {"containers": [{"name": "trainer", "image": "x"}]}}
        kube.core.create_namespaced_pod("team", pod)
        ctx.index.observe_pod({**pod, "status": {"phase": "Running"}})
    assert not ctx.index.serves_all_of("serve") and ctx.index.demand_of("serve") == 0
    vc_body = {"metadata": {"name": "serve"}, "spec": ctx.index.vcs["serve"]}
    (applied,) = cluster.call(loans.reclaim(ctx, vc_body))
    assert applied.job == "team/elastic" and applied.gpus_released == 4
    decisions = kube.job_status("team", "elastic")["decisions"]
    (shrink,) = [d for d in decisions if d["reason"].startswith("reclaim")]
    assert shrink["action"] == "resize" and "does not serve every namespace serve admits" in shrink["reason"]
    assert "elastic-trainer-1" not in [p.metadata.name for p in kube.pods("team", "elastic", "trainer")
                                       if not p.metadata.deletion_timestamp]  # the replica on the lender
