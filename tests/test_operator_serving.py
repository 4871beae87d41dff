"""InferenceJobs run by the operator: real kopf against KMock, real serving replicas.

Each replica pod is the serving runtime itself (`python -m huorn.runtime.serve`, a tiny saved
model) at the loopback address the test reports as the pod's IP; the operator scrapes their
/metrics as in a cluster, and real completions load them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import kmock
import pytest
from kube import builders, serving
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.kubelet import Kubelet

from huorn.backends.kubernetes import manifests
from huorn.graph.model import Instance
from huorn.runtime import serve

pytest_plugins = ["kube.fixtures"]

NS = "team"
IJ = "inferencejobs"
IPS = {"server-0": "127.0.0.2", "server-1": "127.0.0.3", "server-2": "127.0.0.4"}


def status(kube: builders.Kube, name: str) -> dict:
    return kube.job_status(NS, name, IJ)


def servers(kube: builders.Kube, name: str) -> dict[str, object]:
    return {p.metadata.labels["huorn.io/instance"]: p for p in kube.pods(NS, name, "server")
            if not p.metadata.deletion_timestamp}


def run_pod(kube: builders.Kube, pod: object, ip: str = "") -> None:
    """What the kubelet reports once the container runs and /healthz answers."""
    body = {"status": {"phase": "Running", "podIP": ip,
                       "conditions": [{"type": "Ready", "status": "True"}]}}
    kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, body)


def scaled(kube: builders.Kube, name: str, reason: str) -> list:
    return [e for e in kube.events(NS, name) if e.reason == reason]


@pytest.fixture()
def replicas(tmp_path: Path) -> Iterator[serving.Replicas]:
    r = serving.Replicas(serving.save_tiny_model(tmp_path / "ckpt"), tmp_path / "run")
    yield r
    r.close()


def test_an_inference_job_scales_on_real_load_and_takes_back_lent_gpus(
    cluster: EmulatedCluster, kube: builders.Kube, replicas: serving.Replicas
) -> None:
    """b0 (8 GPUs, cluster "serve") lends 4 to an elastic trainer; two InferenceJobs take the
    other 4. Load on "chat" makes its autoscaler ask for a second replica; those 2 GPUs are lent,
    so the cluster shrinks the borrower and the replica lands on them. Quiet again, chat goes
    back to one replica once its scale-down window has passed."""
    settings = dataclasses.replace(operator_mod.FAST, autoscale_seconds=0.5, serve_port=replicas.port)
    kube.custom.patch_cluster_custom_object(
        builders.GROUP, builders.VERSION, "virtualclusters", "serve",
        {"spec": {"purpose": "inference", "lending": {
            "lendable": True, "maxGPUsLent": 4, "reclaimGraceSeconds": 30, "reclaimPolicy": "Shrink"}}})
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        serving.borrow_four_gpus_of_b0(kube, NS)
        kube.custom.patch_namespaced_custom_object(
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "elastic",
            {"spec": {"elasticity": {"minReplicas": 1}}})  # room to shrink
        kube.create_job(NS, serving.make_inference_job("batch", "serve"), plural=IJ)
        kube.create_job(NS, serving.make_inference_job(
            "chat", "serve",
            autoscaling={"minReplicas": 1, "maxReplicas": 2, "targetUtilization": 0.25,
                         "scaleDownDelaySeconds": 3},
            slo={"p99LatencyMs": 60000}), plural=IJ)

        # One replica each, pinned to b0, behind a Service, configured from the job's ConfigMap.
        wait_for(lambda: len(servers(kube, "chat")) == 1 and len(servers(kube, "batch")) == 1,
                 what="one replica of each InferenceJob")
        pod = servers(kube, "chat")["server-0"]
        assert pod.metadata.annotations["huorn.io/node"] == "b0"
        assert pod.metadata.annotations["huorn.io/gpus"] == "2"
        assert pod.spec.containers[0].command == [
            "python", "-m", "huorn.runtime.serve", "--config", "/etc/huorn/config.json"]
        config = kube.core.read_namespaced_config_map("chat-config", NS).data["config.json"]
        served = serve.ServeConfig.model_validate(json.loads(config))  # what the replica will load
        assert served.port == manifests.SERVE_PORT and served.spec.autoscaling.max_replicas == 2
        service = kube.core.read_namespaced_service("chat", NS)
        assert service.spec.selector == {"huorn.io/job": "chat", "huorn.io/vertex": "server"}
        assert status(kube, "chat").get("phase") == "Pending"
        replicas.start(IPS["server-0"])
        run_pod(kube, pod, IPS["server-0"])
        run_pod(kube, servers(kube, "batch")["server-0"])
        wait_for(lambda: status(kube, "chat").get("readyReplicas") == 1, what="chat serving")
        assert status(kube, "chat")["phase"] == "Running" and status(kube, "chat")["desiredReplicas"] == 1

        # Load: three clients back to back keep 3 requests in flight on replica 0, of its 8 slots;
        # at a target of 0.25 that is two replicas' worth.
        replicas.load(IPS["server-0"])
        (up, *_) = wait_for(lambda: scaled(kube, "chat", "ScaledUp"), what="chat scaled up")
        assert "in flight" in up.message and "1 → 2" in up.message
        now = wait_for(lambda: (s := status(kube, "chat")).get("requestsPerSecond", 0) > 0 and s,
                       what="the load in status")
        assert now["desiredReplicas"] == 2 and now["utilization"] > 0.25
        # the load repeats three prompts: all but the first of each finds its whole block cached
        assert 0 < now["cachedPromptShare"] < 1
        resizes = [d["reason"] for d in now["decisions"] if d["action"] == "resize"]
        assert resizes[-1].startswith("autoscaler: ")
        # The second replica's GPUs are on loan: the borrower gives back one replica of 2 GPUs.
        wait_for(lambda: serving.nodes_of(kube, NS, "elastic") == ["b0"], what="the borrower shrunk")
        (shrink,) = serving.resize_decisions(kube, NS, "elastic")
        assert "serve reclaims 2 GPU(s)" in shrink["reason"]
        wait_for(lambda: "server-1" in servers(kube, "chat"), what="chat's second replica placed")
        assert servers(kube, "chat")["server-1"].metadata.annotations["huorn.io/node"] == "b0"
        replicas.start(IPS["server-1"])
        run_pod(kube, servers(kube, "chat")["server-1"], IPS["server-1"])
        wait_for(lambda: status(kube, "chat").get("readyReplicas") == 2, what="two replicas serving")

        # Quiet: back to one replica after the 3 s window, the newest one going.
        replicas.quiet()
        (down, *_) = wait_for(lambda: scaled(kube, "chat", "ScaledDown"), what="chat scaled down", timeout=60)
        assert "2 → 1" in down.message
        wait_for(lambda: list(servers(kube, "chat")) == ["server-0"], what="replica 1 deleted")
        assert status(kube, "chat")["desiredReplicas"] == 1
        assert scaled(kube, "batch", "ScaledUp") == []  # an idle job at its floor stays there


def fronts(kube: builders.Kube, name: str) -> dict[str, object]:
    """The job's front pods (routers, activators) that are not being deleted, by name."""
    return {p.metadata.name: p for p in kube.pods(NS, name, "activator") if not p.metadata.deletion_timestamp}


def routed_to(kube: builders.Kube, name: str) -> str:
    return kube.core.read_namespaced_service(name, NS).spec.selector["huorn.io/vertex"]


def test_an_inference_job_scales_to_zero_and_a_held_request_wakes_a_replica(
    cluster: EmulatedCluster, kube: builders.Kube, replicas: serving.Replicas, tmp_path: Path
) -> None:
    """minReplicas 0: the job starts with one replica and an activator beside it; a quiet window
    takes it to zero, the Service then points at the activator, and a request sent meanwhile is
    held, wakes a replica through the autoscaler, and is answered by it."""
    settings = dataclasses.replace(operator_mod.FAST, autoscale_seconds=0.5, serve_port=replicas.port)
    activator_ip = "127.0.0.6"
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        kube.create_job(NS, serving.make_inference_job(
            "chat", "serve", autoscaling={"minReplicas": 0, "maxReplicas": 2, "scaleDownDelaySeconds": 2,
                                          "activationTimeoutSeconds": 120}), plural=IJ)
        wait_for(lambda: len(servers(kube, "chat")) == 1 and kube.pods(NS, "chat", "activator"),
                 what="one replica and the activator")
        (pod,) = kube.pods(NS, "chat", "activator")
        container = pod.spec.containers[0]
        assert pod.metadata.name == "chat-activator" and "nvidia.com/gpu" not in container.resources.limits
        assert container.command[-1] == "http://chat-replicas.team.svc:80"
        assert routed_to(kube, "chat-replicas") == "server"
        assert routed_to(kube, "chat") == "activator"  # no replica ready yet
        activator = serving.Activator(tmp_path / "activator", activator_ip,
                                      f"http://{IPS['server-0']}:{replicas.port}", port=replicas.port)
        try:
            run_pod(kube, pod, activator_ip)
            replicas.start(IPS["server-0"])
            run_pod(kube, servers(kube, "chat")["server-0"], IPS["server-0"])
            wait_for(lambda: routed_to(kube, "chat") == "server", what="the Service on the replica")
            assert status(kube, "chat")["routing"] == "replicas"

            # quiet for the 2 s window: to zero, the Service back on the activator first
            (down, *_) = wait_for(lambda: scaled(kube, "chat", "ScaledDown"), what="to zero", timeout=60)
            assert "1 → 0" in down.message
            wait_for(lambda: not servers(kube, "chat"), what="the replica deleted")
            replicas.stop(IPS["server-0"])
            assert routed_to(kube, "chat") == "activator"
            wait_for(lambda: status(kube, "chat").get("message", "").startswith("scaled to zero"),
                     what="status says scaled to zero")
            now = status(kube, "chat")
            assert now["phase"] == "Running" and now["desiredReplicas"] == 0 and now["routing"] == "activator"

            # a request meanwhile: held, read by the autoscaler, a replica placed and started
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                answer = pool.submit(serving.complete, activator.url)
                (up, *_) = wait_for(lambda: scaled(kube, "chat", "ScaledUp"), what="woken from zero")
                assert "held by the activator" in up.message and "0 → 1" in up.message
                # a new name on ordinal 0: the old replica's pod may still have been going
                wait_for(lambda: "server-0-g1" in servers(kube, "chat"), what="a replica placed")
                assert not answer.done()
                replicas.start(IPS["server-0"])
                run_pod(kube, servers(kube, "chat")["server-0-g1"], IPS["server-0"])
                status_code, body = answer.result(timeout=120)
            assert status_code == 200 and body["tokens"] > 0
            wait_for(lambda: routed_to(kube, "chat") == "server", what="the Service on the replica again")
        finally:
            activator.close()


def test_lost_replicas_are_replaced_and_a_spec_change_rolls_one_replica_at_a_time(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    job = serving.make_inference_job("chat", "serve", min_replicas=2, max_replicas=2)
    kube.create_job(NS, job, plural=IJ)
    wait_for(lambda: len(servers(kube, "chat")) == 2, what="two replicas")
    for pod in servers(kube, "chat").values():
        run_pod(kube, pod)
    wait_for(lambda: status(kube, "chat").get("readyReplicas") == 2, what="both ready")

    # A replica pod evicted: a new generation replaces it, with the reason in the decisions.
    kube.set_pod_phase(NS, "chat-server-1", "Failed")
    wait_for(lambda: "server-1-g1" in servers(kube, "chat"), what="replica 1 replaced")
    (replaced,) = [d for d in status(kube, "chat")["decisions"] if d["action"] == "replace"]
    assert replaced["reason"].startswith("replica pod chat-server-1 Failed")
    run_pod(kube, servers(kube, "chat")["server-1-g1"])

    # A new checkpoint: one replica is rolled, the other waits until the new one is ready.
    kube.custom.patch_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, IJ, "chat",
        {"spec": {"model": {"checkpoint": "/checkpoints/v2"}}})
    wait_for(lambda: "server-0-g1" in servers(kube, "chat"), what="the first replica rolled")
    assert "server-1-g1" in servers(kube, "chat")  # still serving the old checkpoint
    config = json.loads(kube.core.read_namespaced_config_map("chat-config", NS).data["config.json"])
    assert config["spec"]["model"]["checkpoint"] == "/checkpoints/v2"
    run_pod(kube, servers(kube, "chat")["server-0-g1"])
    wait_for(lambda: "server-1-g2" in servers(kube, "chat"), what="the second rolled")
    run_pod(kube, servers(kube, "chat")["server-1-g2"])
    wait_for(lambda: sorted(servers(kube, "chat")) == ["server-0-g1", "server-1-g2"],
             what="the second's predecessor gone once it is ready")
    rolls = [d for d in status(kube, "chat")["decisions"] if d["reason"].startswith("rolling update")]
    assert len(rolls) == 2
    # Scaling bounds are not a rolled field: a new maxReplicas restarts nothing.
    kube.custom.patch_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, IJ, "chat", {"spec": {"autoscaling": {"maxReplicas": 4}}})
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 3, what="the new bounds seen")
    assert sorted(servers(kube, "chat")) == ["server-0-g1", "server-1-g2"]


def test_replicas_go_on_the_selected_nodes_and_a_new_selector_rolls_none(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """The serving cluster's only node is b0: replicas that select it are placed there, and ones
    that select a node outside the cluster wait and say that no node of it matches. An edit of
    the selector replaces no running replica."""
    kube.create_job(NS, serving.make_inference_job("chat", "serve", nodeSelector={"pool": "b"}), plural=IJ)
    wait_for(lambda: len(servers(kube, "chat")) == 1, what="one replica")
    assert {p.metadata.annotations["huorn.io/node"] for p in servers(kube, "chat").values()} == {"b0"}
    run_pod(kube, servers(kube, "chat")["server-0"])
    wait_for(lambda: status(kube, "chat").get("readyReplicas") == 1, what="ready")
    outside = serving.make_inference_job("elsewhere", "serve", nodeSelector={"pool": "a"})
    kube.create_job(NS, outside, plural=IJ)
    cond = wait_for(lambda: (c := kube.condition(NS, "elsewhere", "Reconciling", IJ)).get("reason")
                    == "WaitingForGPUs" and c, what="waiting")
    assert ("on virtual cluster 'serve' on its nodes labelled pool=a (spec.nodeSelector), of which it has "
            "none: label nodes so, or change the selector") in cond["message"]
    assert servers(kube, "elsewhere") == {}
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"nodeSelector": {"pool": "b", "zone": "z1"}}})
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 2, what="the edit seen")
    assert sorted(servers(kube, "chat")) == ["server-0"]


def test_a_one_replica_job_keeps_serving_through_a_rolling_update(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """Make before break: the replica a rolling update replaces serves until its successor is
    ready. Before, it was deleted as its successor was created, and a one-replica job answered
    nothing for a whole model load at every update. Where the successor finds no GPUs, the old
    replica goes first (the update goes on, one replica down)."""
    kube.create_job(NS, serving.make_inference_job("chat", "serve", gpus=4), plural=IJ)
    wait_for(lambda: len(servers(kube, "chat")) == 1, what="one replica")
    run_pod(kube, servers(kube, "chat")["server-0"])
    wait_for(lambda: status(kube, "chat").get("readyReplicas") == 1, what="ready")
    update = {"spec": {"model": {"checkpoint": "/checkpoints/v2"}}}
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat", update)
    wait_for(lambda: "server-0-g1" in servers(kube, "chat"), what="the successor placed")
    assert "server-0" in servers(kube, "chat")  # the old replica still serves
    wait_for(lambda: status(kube, "chat").get("readyReplicas") == 1, what="counted as serving")
    def reconciling() -> dict:
        return kube.condition(NS, "chat", "Reconciling", IJ)

    rolling = wait_for(lambda: reconciling().get("reason") == "RollingUpdate" and reconciling(),
                       what="the rollout in the conditions")
    assert rolling["status"] == "True" and "1 of an older spec" in rolling["message"]
    assert kube.condition(NS, "chat", "Ready", IJ).get("status") == "True"  # it answers meanwhile
    assert status(kube, "chat")["surgingReplicas"] == 1  # its GPUs in the cluster's demand
    # A second edit while the successor loads replaces it at once (it serves no one): the old
    # replica waits for the end of the line, not for the successor it was first given.
    update = {"spec": {"model": {"checkpoint": "/checkpoints/v2b"}}}
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat", update)
    wait_for(lambda: "server-0-g2" in servers(kube, "chat"), what="the successor's successor placed")
    assert "server-0" in servers(kube, "chat") and "server-0-g1" not in servers(kube, "chat")
    run_pod(kube, servers(kube, "chat")["server-0-g2"])
    wait_for(lambda: sorted(servers(kube, "chat")) == ["server-0-g2"], what="the old replica gone once")
    wait_for(lambda: status(kube, "chat").get("surgingReplicas") == 0, what="its GPUs out of the demand")
    # No room for a successor beside it (8 GPUs, 4 each, and a filler of 4): the old one goes first.
    kube.create_job(NS, serving.make_inference_job("fill", "serve", gpus=4), plural=IJ)
    wait_for(lambda: len(servers(kube, "fill")) == 1, what="the filler placed")
    update = {"spec": {"model": {"checkpoint": "/checkpoints/v3"}}}
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat", update)
    wait_for(lambda: "server-0-g2" not in servers(kube, "chat"), what="the old replica deleted")
    wait_for(lambda: "server-0-g3" in servers(kube, "chat"), what="its successor placed on its GPUs")


def test_a_replica_that_never_starts_is_replaced(cluster: EmulatedCluster, kube: builders.Kube) -> None:
    """A replica pod Pending for good (its image not pulled) held its GPUs and the job's capacity
    while serving no one, and was never placed again; past --pod-start-seconds it is replaced
    like a failed one, naming why."""
    settings = dataclasses.replace(operator_mod.FAST, trainer_start_seconds=3.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        kube.create_job(NS, serving.make_inference_job("chat", "serve"), plural=IJ)
        (pod,) = wait_for(lambda: list(servers(kube, "chat").values()), what="the replica")
        waiting = {"phase": "Pending", "containerStatuses": [
            {"name": "server", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
             "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image"}}}]}
        kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, {"status": waiting})
        wait_for(lambda: sorted(servers(kube, "chat")) == ["server-0-g1"], what="the replica replaced")
        (replaced,) = [d for d in status(kube, "chat")["decisions"] if d["action"] == "replace"]
        why = "replica pod chat-server-0 did not start within 3 s (ImagePullBackOff"
        assert replaced["reason"].startswith(why)


def test_replicas_that_serve_no_one_are_rolled_without_waiting_for_the_others(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """Two replicas crash-looping on a broken image (running, never ready): the fixed image rolls
    them without waiting for the others to be ready, which they never will be (each waited for
    the other, and the fix never reached them)."""
    job = serving.make_inference_job("chat", "serve", min_replicas=2, max_replicas=2)
    kube.create_job(NS, job, plural=IJ)
    wait_for(lambda: len(servers(kube, "chat")) == 2, what="two replicas")
    crashing = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}}
    for pod in servers(kube, "chat").values():
        kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, crashing)
    wait_for(lambda: status(kube, "chat").get("replicas") == 2, what="both running")
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"image": "ghcr.io/huorn-io/huorn:0.1.1"}})
    rolled = wait_for(lambda: (now := servers(kube, "chat")) and sorted(now) == ["server-0-g1", "server-1-g1"]
                      and now, what="both rolled")
    assert all(p.spec.containers[0].image == "ghcr.io/huorn-io/huorn:0.1.1" for p in rolled.values())
    reasons = [d["reason"] for d in status(kube, "chat")["decisions"] if d["action"] == "replace"]
    assert len(reasons) == 2 and all(r.endswith("and is not ready") for r in reasons)


def test_an_inference_job_on_a_checkpoint_off_its_volume_is_refused_naming_the_field(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    kube.create_job(NS, serving.make_inference_job(
        "chat", "serve", checkpoint={"volume": "models", "path": "/models"}), plural=IJ)
    cond = wait_for(lambda: kube.condition(NS, "chat", "Stalled", IJ).get("status") == "True"
                    and kube.condition(NS, "chat", "Stalled", IJ), what="Stalled")
    assert cond["reason"] == "InvalidSpec" and cond["message"].startswith("spec.model.checkpoint:")
    assert "/models" in cond["message"] and kube.pods(NS, "chat") == []


def test_an_inference_job_converges_through_api_errors_and_a_restarted_operator_changes_nothing(
    cluster: EmulatedCluster, kube: builders.Kube
) -> None:
    """Injected 500/503/429 on the writes the serving path makes: no duplicate pod, no decision;
    then a fresh operator (nothing in memory) resumes the job and finds nothing to do."""
    km = cluster.kmock
    km["post", kmock.resource("", "v1", "pods")][:2].override << 500
    km["post", kmock.resource("", "v1", "configmaps")][:1].override << 503
    km["post", kmock.resource("", "v1", "services")][:1].override << 500
    km["patch", kmock.resource("huorn.io", "v1alpha1", IJ)][:3].override << 429
    job = serving.make_inference_job("chat", "serve", min_replicas=2, max_replicas=2)
    with operator_mod.OperatorThread(cluster.api_client()) as first:
        kube.create_job(NS, job, plural=IJ)
        wait_for(lambda: len(servers(kube, "chat")) == 2, what="two replicas")
        for pod in servers(kube, "chat").values():
            run_pod(kube, pod)
        wait_for(lambda: status(kube, "chat").get("readyReplicas") == 2, what="both ready")
        assert first.ctx.client.retries >= 3, "the injected errors were answered and retried"
        desired = {"namespace": NS, "job": "chat", "state": "desired"}
        assert first.ctx.metrics.value("huorn_inferencejob_replicas", desired) == 2

    def state() -> tuple:
        s = status(kube, "chat")
        return (sorted(p.metadata.name for p in kube.pods(NS, "chat")), kube.children(NS, "chat"),
                s["graph"]["version"], s.get("decisions"), s["desiredReplicas"])

    before = state()
    assert before[0] == ["chat-server-0", "chat-server-1"] and before[3] == []
    with operator_mod.OperatorThread(cluster.api_client()) as second:
        ready = {"namespace": NS, "job": "chat", "state": "ready"}
        wait_for(lambda: second.ctx.metrics.value("huorn_inferencejob_replicas", ready) == 2,
                 what="the job resumed by the new operator")
        assert state() == before


def test_a_lower_max_replicas_keeps_the_replicas_that_serve(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """Before, the replicas a lower spec.autoscaling.maxReplicas removed were the highest
    ordinals, even when they were the only ones ready and a lower one was still loading."""
    job = serving.make_inference_job("chat", "serve", min_replicas=3, max_replicas=3)
    kube.create_job(NS, job, plural=IJ)
    wait_for(lambda: len(servers(kube, "chat")) == 3, what="three replicas")
    for instance in ("server-1", "server-2"):  # server-0 still loads its model
        run_pod(kube, servers(kube, "chat")[instance])
    wait_for(lambda: status(kube, "chat").get("readyReplicas") == 2, what="two ready")
    kube.custom.patch_namespaced_custom_object(
        builders.GROUP, builders.VERSION, NS, IJ, "chat", {"spec": {"autoscaling": {"minReplicas": 1,
                                                                                   "maxReplicas": 2}}})
    kept = wait_for(lambda: len(servers(kube, "chat")) == 2 and sorted(servers(kube, "chat")),
                    what="the shrink to two")
    assert kept == ["server-1", "server-2"], "the replica still loading goes, the serving ones stay"


def test_prefix_routing_puts_the_router_in_front_once_ready_and_a_policy_change_replaces_it(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """routing.policy prefix: a router pod finds the ready replicas through a headless Service;
    the job's Service selects the replicas until the router is ready, then the router; a new
    loadFactor replaces the router and no replica; back to `service`, the router goes and the
    Service selects the replicas again."""
    job = serving.make_inference_job("chat", "serve", min_replicas=2, max_replicas=2,
                                     routing={"policy": "prefix"})
    kube.create_job(NS, job, plural=IJ)
    wait_for(lambda: len(servers(kube, "chat")) == 2 and kube.pods(NS, "chat", "activator"),
             what="two replicas and the router")
    (router,) = kube.pods(NS, "chat", "activator")
    command = router.spec.containers[0].command
    assert command[command.index("--replicas-dns") + 1] == f"chat-endpoints.{NS}.svc:{manifests.SERVE_PORT}"
    endpoints = kube.core.read_namespaced_service("chat-endpoints", NS).spec
    assert endpoints.cluster_ip == "None" and endpoints.selector["huorn.io/vertex"] == "server"
    assert not endpoints.publish_not_ready_addresses
    for pod in servers(kube, "chat").values():
        run_pod(kube, pod)
    wait_for(lambda: status(kube, "chat").get("readyReplicas") == 2, what="both ready")
    assert routed_to(kube, "chat") == "server" and status(kube, "chat")["routing"] == "replicas"

    run_pod(kube, router)
    wait_for(lambda: routed_to(kube, "chat") == "activator", what="the Service on the router")
    wait_for(lambda: status(kube, "chat").get("routing") == "router", what="status says router")

    # a new loadFactor: the router is replaced (it reads it once), the replicas are not
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"routing": {"loadFactor": 2.0}}})
    wait_for(lambda: routed_to(kube, "chat") == "server", what="the replicas again while it restarts")
    wait_for(lambda: [p for p in kube.pods(NS, "chat", "activator") if not p.metadata.deletion_timestamp
                      and p.metadata.uid != router.metadata.uid], what="a new router")
    assert sorted(servers(kube, "chat")) == ["server-0", "server-1"]

    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"routing": {"policy": "service"}}})
    wait_for(lambda: not [p for p in kube.pods(NS, "chat", "activator") if not p.metadata.deletion_timestamp],
             what="the router gone")
    wait_for(lambda: "chat-endpoints" not in {s.metadata.name for s in
                                              kube.core.list_namespaced_service(NS).items},
             what="its headless Service gone")
    assert routed_to(kube, "chat") == "server" and sorted(servers(kube, "chat")) == ["server-0", "server-1"]


def test_two_front_pods_keep_the_router_in_front_through_a_pods_loss_and_roll_one_at_a_time(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """routing.frontReplicas 2: two router pods that prefer different nodes; one lost, the Service
    stays on the other while it is replaced; a new setting replaces them one at a time, the second
    only once the first's successor is ready; back to one, the second goes."""
    job = serving.make_inference_job("chat", "serve", min_replicas=2, max_replicas=2,
                                     routing={"policy": "prefix", "frontReplicas": 2})
    kube.create_job(NS, job, plural=IJ)

    wait_for(lambda: len(servers(kube, "chat")) == 2 and len(fronts(kube, "chat")) == 2,
             what="two replicas, two routers")
    assert sorted(fronts(kube, "chat")) == ["chat-activator", "chat-activator-1"]
    for pod in fronts(kube, "chat").values():
        term = pod.spec.affinity.pod_anti_affinity.preferred_during_scheduling_ignored_during_execution[0]
        assert term.pod_affinity_term.topology_key == "kubernetes.io/hostname"
        assert term.pod_affinity_term.label_selector.match_labels["huorn.io/vertex"] == "activator"
    for pod in [*servers(kube, "chat").values(), *fronts(kube, "chat").values()]:
        run_pod(kube, pod)
    wait_for(lambda: status(kube, "chat").get("routing") == "router", what="the Service on the routers")

    lost = fronts(kube, "chat")["chat-activator-1"]
    kube.core.delete_namespaced_pod("chat-activator-1", NS)
    wait_for(lambda: (p := fronts(kube, "chat").get("chat-activator-1")) is not None
             and p.metadata.uid != lost.metadata.uid, what="the lost router replaced")
    assert routed_to(kube, "chat") == "activator" and status(kube, "chat")["routing"] == "router"
    run_pod(kube, fronts(kube, "chat")["chat-activator-1"])

    # a new loadFactor: one router at a time, and no replica
    first = {name: p.metadata.uid for name, p in fronts(kube, "chat").items()}
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"routing": {"loadFactor": 2.0}}})
    uids = set(first.values())
    wait_for(lambda: len(now := fronts(kube, "chat")) == 2 and {p.metadata.uid for p in now.values()} != uids,
             what="one router replaced")
    now = fronts(kube, "chat")
    renewed = [name for name, pod in now.items() if pod.metadata.uid != first[name]]
    assert len(renewed) == 1 and len(now) == 2  # the other one still serves
    kept = next(name for name in now if name not in renewed)
    assert now[kept].metadata.uid == first[kept]
    run_pod(kube, now[renewed[0]])
    wait_for(lambda: (p := fronts(kube, "chat").get(kept)) is not None and p.metadata.uid != first[kept],
             what="the second replaced once the first's successor was ready")
    assert sorted(servers(kube, "chat")) == ["server-0", "server-1"]

    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"routing": {"frontReplicas": 1}}})
    wait_for(lambda: sorted(fronts(kube, "chat")) == ["chat-activator"], what="back to one router")


def test_front_pods_that_serve_no_one_are_replaced_at_once_by_a_new_image(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """Two routers crash-looping on a broken image (running, never ready): the fixed image
    replaces them without waiting for either to be ready, which they never will be (each waited
    for the other, and the fix never reached them)."""
    job = serving.make_inference_job("chat", "serve", min_replicas=1, max_replicas=1,
                                     routing={"policy": "prefix", "frontReplicas": 2})
    kube.create_job(NS, job, plural=IJ)

    wait_for(lambda: len(servers(kube, "chat")) == 1 and len(fronts(kube, "chat")) == 2,
             what="a replica, two routers")
    for pod in servers(kube, "chat").values():
        run_pod(kube, pod)
    crashing = {"status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}}
    for name in fronts(kube, "chat"):
        kube.core.patch_namespaced_pod_status(name, NS, crashing)
    wait_for(lambda: status(kube, "chat").get("readyReplicas") == 1, what="the replica ready")
    broken = {name: p.metadata.uid for name, p in fronts(kube, "chat").items()}
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"image": "ghcr.io/huorn-io/huorn:0.1.1"}})
    replaced = wait_for(lambda: len(now := fronts(kube, "chat")) == 2
                        and all(p.metadata.uid != broken[name] for name, p in now.items()) and now,
                        what="both routers replaced")
    assert all(p.spec.containers[0].image == "ghcr.io/huorn-io/huorn:0.1.1" for p in replaced.values())


def test_leaving_scale_to_zero_removes_the_activator_and_its_replicas_service(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """minReplicas 0 → 1: the activator and `<job>-replicas`, which only it used, go (the latter
    was left behind before, until the job was deleted), but only once the new replica is ready:
    they went at the edit, and nothing answered while the replica loaded its model."""
    kube.create_job(NS, serving.make_inference_job("chat", "serve", min_replicas=0), plural=IJ)

    def services() -> set[str]:
        return {s.metadata.name for s in kube.core.list_namespaced_service(NS).items}

    wait_for(lambda: "chat-replicas" in services() and kube.pods(NS, "chat", "activator"),
             what="the activator and its Service")
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"autoscaling": {"minReplicas": 1}}})
    wait_for(lambda: "server-0" in servers(kube, "chat"), what="the replica placed")
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 2, what="the edit reconciled")
    # loading: the activator holds what comes, and the job's Service stays on it
    assert fronts(kube, "chat") and routed_to(kube, "chat") == "activator"
    assert "chat-replicas" in services()
    run_pod(kube, servers(kube, "chat")["server-0"])
    wait_for(lambda: "chat-replicas" not in services(), what="`chat-replicas` deleted")
    wait_for(lambda: not [p for p in kube.pods(NS, "chat", "activator") if not p.metadata.deletion_timestamp],
             what="the activator gone")
    assert "chat" in services() and routed_to(kube, "chat") == "server"


def test_a_terminating_router_keeps_its_headless_service_until_it_is_gone(
    cluster: EmulatedCluster, kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """routing.policy prefix → service: the router is deleted, and while its grace runs it
    still forwards the answers it holds and retries cut ones through `<job>-endpoints`. That
    Service stays until the router pod is gone (it was deleted once the router was only
    terminating, and those retries could no longer resolve a replica)."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    job = serving.make_inference_job("chat", "serve", min_replicas=1, max_replicas=1,
                                     routing={"policy": "prefix"})
    kube.create_job(NS, job, plural=IJ)

    def services() -> set[str]:
        return {s.metadata.name for s in kube.core.list_namespaced_service(NS).items}

    (router,) = wait_for(lambda: kube.pods(NS, "chat", "activator"), what="the router")
    wait_for(lambda: "chat-endpoints" in services(), what="its headless Service")
    kubelet.hold([router.metadata.name])  # its grace: the answers it holds finish
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"routing": {"policy": "service"}}})
    wait_for(lambda: any(name == router.metadata.name for name, _ in kubelet.deletes()),
             what="the router deleted")
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 2, what="the edit reconciled")
    # a reconcile while the router drains (an edit that changes no pod) must not take its Service
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"autoscaling": {"maxReplicas": 2}}})
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 3, what="a reconcile while it drains")
    assert [p.metadata.deletion_timestamp is not None for p in kube.pods(NS, "chat", "activator")] == [True]
    assert status(kube, "chat").get("frontServices") == ["endpoints"]
    assert "chat-endpoints" in services()
    kubelet.release([router.metadata.name])
    wait_for(lambda: "chat-endpoints" not in services(), what="the Service gone with the router")
    wait_for(lambda: status(kube, "chat").get("frontServices") == [], what="status forgets it")


def test_a_policy_switch_keeps_the_service_old_front_pods_read_until_the_last_is_replaced(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """Scaled to zero with two activators, routing.policy service → prefix: the routers replace
    them one at a time, and `<job>-replicas`, through which the activator still serving forwards
    what it holds, stays until that one is replaced too (it was deleted at the edit)."""
    job = serving.make_inference_job("chat", "serve", min_replicas=0, routing={"frontReplicas": 2})
    kube.create_job(NS, job, plural=IJ)

    def services() -> set[str]:
        return {s.metadata.name for s in kube.core.list_namespaced_service(NS).items}

    wait_for(lambda: len(fronts(kube, "chat")) == 2 and "chat-replicas" in services(), what="two activators")
    # the pods and Services are created before the status that records them is written: wait for it
    wait_for(lambda: status(kube, "chat").get("frontServices") == ["replicas"], what="status records it")
    for pod in fronts(kube, "chat").values():
        run_pod(kube, pod)
    activators = {name: p.metadata.uid for name, p in fronts(kube, "chat").items()}
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"routing": {"policy": "prefix"}}})
    wait_for(lambda: len(now := fronts(kube, "chat")) == 2
             and sum(p.metadata.uid not in activators.values() for p in now.values()) == 1,
             what="one activator replaced by a router")
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 2, what="the edit reconciled")
    assert {"chat-replicas", "chat-endpoints"} <= services()
    wait_for(lambda: status(kube, "chat").get("frontServices") == ["endpoints", "replicas"],
             what="status records both")
    (router,) = [p for p in fronts(kube, "chat").values() if p.metadata.uid not in activators.values()]
    run_pod(kube, router)
    wait_for(lambda: all(p.metadata.uid not in activators.values() for p in fronts(kube, "chat").values())
             and len(fronts(kube, "chat")) == 2, what="the second activator replaced")
    wait_for(lambda: "chat-replicas" not in services(), what="`chat-replicas` gone with the last activator")
    wait_for(lambda: status(kube, "chat").get("frontServices") == ["endpoints"], what="status forgets it")
    assert "chat-endpoints" in services()


def test_a_status_from_before_front_services_retires_them_once_and_records_it(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """A job whose status predates status.frontServices and that once had front pods (its
    status names a routing) but wants none now: both Services it may have had are deleted once,
    and the status says so (it said nothing, and every reconcile deleted them again)."""
    deletes: list[str] = []
    delete = operator.ctx.client.delete

    async def counted(kind: str, namespace: str, name: str, *args: object, **kwargs: object) -> bool:
        if kind == "Service":
            deletes.append(name)
        return await delete(kind, namespace, name, *args, **kwargs)

    operator.ctx.client.delete = counted  # type: ignore[method-assign]
    kube.create_job(NS, serving.make_inference_job("chat", "serve"), plural=IJ)
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 1, what="the job reconciled")
    assert "frontServices" not in status(kube, "chat") and not deletes
    kube.custom.patch_namespaced_custom_object_status(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                                      {"status": {"routing": "replicas"}})
    wait_for(lambda: len(deletes) >= 2, what="the Services it may have had deleted")
    wait_for(lambda: status(kube, "chat").get("frontServices") == [], what="the retired Services recorded")
    assert sorted(deletes) == ["chat-endpoints", "chat-replicas"]
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"slo": {"p99TimeToFirstTokenMs": 900}}})
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 2, what="the edit reconciled")
    assert sorted(deletes) == ["chat-endpoints", "chat-replicas"], "deleted again"


def test_fewer_front_pods_keep_the_ready_one_until_a_kept_one_is_ready(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """Scaled to zero, every request goes to a front pod: frontReplicas lowered from 2 to 1 while
    the pod it keeps is not ready leaves the ready second one serving until the first is."""
    job = serving.make_inference_job("chat", "serve", min_replicas=0, routing={"frontReplicas": 2})
    kube.create_job(NS, job, plural=IJ)
    wait_for(lambda: len(fronts(kube, "chat")) == 2, what="two activators")
    run_pod(kube, fronts(kube, "chat")["chat-activator-1"])
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"routing": {"frontReplicas": 1}}})
    wait_for(lambda: status(kube, "chat").get("observedGeneration") == 2, what="the edit reconciled")
    assert sorted(fronts(kube, "chat")) == ["chat-activator", "chat-activator-1"]
    run_pod(kube, fronts(kube, "chat")["chat-activator"])
    wait_for(lambda: sorted(fronts(kube, "chat")) == ["chat-activator"],
             what="the second gone once the first is ready")


def test_the_router_pod_lets_what_it_forwards_finish_as_a_replica_does() -> None:
    """A router replaced (a new loadFactor) is killed after its pod's grace: the answers it is
    forwarding need as long as the replicas' own requests get."""
    ref = manifests.JobRef("InferenceJob", "chat", NS, "uid")
    spec = {**serving.make_inference_job("chat", "serve", routing={"policy": "prefix"})["spec"],
            "image": "mirror.example/huorn:1"}  # resolved already (huorn.operator.images.pin)
    router = manifests.build_activator_pod(ref, spec)
    replica = manifests.build_serve_pod(ref, Instance("server", 0), "b0", spec, "serve")
    grace = "terminationGracePeriodSeconds"
    assert router["spec"][grace] >= replica["spec"][grace]


def test_a_new_image_replaces_the_router_as_it_rolls_the_replicas() -> None:
    spec = serving.make_inference_job("chat", "serve", routing={"policy": "prefix"})["spec"]
    newer = {**spec, "image": "ghcr.io/huorn-io/huorn:0.2.0"}
    assert manifests.serve_template_hash(newer) != manifests.serve_template_hash(spec)
    assert manifests.front_template_hash(newer) != manifests.front_template_hash(spec)



def _serve_container(**spec: object) -> tuple[dict, dict]:
    ref = manifests.JobRef("InferenceJob", "chat", NS, "uid")
    full = {**serving.make_inference_job("chat", "serve", **spec)["spec"], "image": "mirror.example/huorn:1"}
    pod = manifests.build_serve_pod(ref, Instance("server", 0), "b0", full, "serve")
    return pod, pod["spec"]["containers"][0]


def test_a_replica_keeps_listening_while_it_leaves_and_loads_as_long_as_the_activator_waits() -> None:
    """Found by review: SIGTERM closed the socket while kube-proxy still sent connections (no
    preStop), the grace (30 s) was shorter than the server's drain (60 s), and the startup probe
    killed any model load longer than 600 s, though activationTimeoutSeconds allows 3600."""
    from huorn.api import inference

    pod, server = _serve_container(autoscaling={"maxReplicas": 1, "activationTimeoutSeconds": 1800})
    pause, drain = inference.SERVE_PRESTOP_SECONDS, inference.SERVE_DRAIN_SECONDS
    assert server["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pause)]
    assert pod["spec"]["terminationGracePeriodSeconds"] > pause + drain
    probe = server["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 1800
    probe = _serve_container()[1]["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= inference.SERVE_STARTUP_SECONDS


def test_a_replica_with_gpus_is_told_to_serve_on_them() -> None:
    """A replica with GPUs whose image had a CPU-only torch served on the CPU unnoticed, holding
    GPUs it never used (found by the chart's review): its config now asks for cuda."""
    ref = manifests.JobRef("InferenceJob", "chat", NS, "uid")
    with_gpus = serving.make_inference_job("chat", "serve", gpus=2)["spec"]
    assert manifests.build_serve_config(ref, with_gpus)["device"] == "cuda"
    cpu_only = serving.make_inference_job("chat", "serve", gpus=0)["spec"]
    assert "device" not in manifests.build_serve_config(ref, cpu_only)


def test_one_successor_keeps_one_replica_of_an_older_spec_serving() -> None:
    """Chain server-0 → g1 → g2, an edit landing in the reconcile that first saw g1 ready, before
    server-0 was deleted: both server-0 and g1 serve and both were kept for g2 (readyReplicas 2
    against 1 desired). Only g1, the newest that serves, is kept now."""
    from huorn.graph import compiler, mutate
    from huorn.operator import index, validation
    from huorn.operator import serving as serving_op

    job = validation.load_job(serving.make_inference_job("chat", "serve"))
    graph = compiler.compile(job)
    mutate.replace_instance(graph, "server-0", reason="rolling update", drain=True, counted=False)
    mutate.replace_instance(graph, "server-0-g1", reason="rolling update", drain=True, counted=False)
    ref = manifests.JobRef("InferenceJob", "chat", NS, "uid")

    def pod(instance: str, ready: bool) -> index.PodRecord:
        return index.PodRecord(NS, f"chat-{instance}", "chat", "server", instance, "b0", 2, 0, "serve",
                               phase="Running", conditions=(("Ready", "True" if ready else "False"),))

    pods = [pod("server-0", True), pod("server-0-g1", True), pod("server-0-g2", False)]
    assert serving_op.surging(graph, ref, pods, set()) == {"chat-server-0-g1"}
    # g1 not ready yet (still loading when the edit came): server-0 is the one that serves
    pods[1] = pod("server-0-g1", False)
    assert serving_op.surging(graph, ref, pods, set()) == {"chat-server-0"}


async def test_the_autoscaler_reads_the_replica_a_rollout_keeps_serving(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The replica a rolling update keeps beside its loading successor takes its share of the
    traffic: the autoscaler scraped only the graph's instances, so that share went unmeasured and
    a rollout longer than scaleDownDelaySeconds scaled the job down under the same load."""
    from huorn.graph import compiler, mutate, serialise
    from huorn.operator import autoscaling, context, index, validation

    body = serving.make_inference_job("chat", "serve")
    body["metadata"].update({"namespace": NS, "uid": "u1", "generation": 2})
    graph = compiler.compile(validation.load_job(body))
    mutate.replace_instance(graph, "server-0", reason="rolling update", drain=True, counted=False)
    body["status"] = {"phase": "Running", "graph": serialise.to_status(graph)}

    class Api:
        async def get_custom(self, plural: str, namespace: str, name: str) -> dict:
            return body

        async def patch_status(self, *args: object) -> None:
            return None

    ctx = context.Context(client=Api(), post_event=lambda *_: None)  # type: ignore[arg-type]
    for instance, ready, ip in (("server-0", True, "10.0.0.1"), ("server-0-g1", False, "10.0.0.2")):
        ctx.index.pods[(NS, f"chat-{instance}")] = index.PodRecord(
            NS, f"chat-{instance}", "chat", "server", instance, "b0", 2, 0, "serve", phase="Running",
            ip=ip, conditions=(("Ready", "True" if ready else "False"),))
    scraped: list[dict[str, str]] = []
    monkeypatch.setattr(autoscaling.replica_metrics, "fetch_all",
                        lambda targets, timeout: scraped.append(dict(targets)) or {})
    await autoscaling.tick(ctx, NS, "chat")
    assert scraped == [{"server-0": f"http://10.0.0.1:{ctx.settings.serve_port}/metrics"}]


def test_a_job_whose_cluster_is_gone_drops_its_replica_gauges_and_the_cluster_counts_unusable_gpus(
    kube: builders.Kube, operator: operator_mod.OperatorThread
) -> None:
    """Found by review of the chart's alerts: a job that stopped being reconciled to the end (its
    cluster gone, or Stalled) kept its last desired/ready counts, which an alert reads as a job
    short of replicas for ever. And HuornLineWaitsOnUnusableNodes reads the GPUs of member nodes
    that take no new pods, per cluster."""
    job = serving.make_inference_job("chat", "serve", min_replicas=1, max_replicas=1)
    kube.create_job(NS, job, plural=IJ)
    desired = {"namespace": NS, "job": "chat", "state": "desired"}
    wait_for(lambda: operator.ctx.metrics.value("huorn_inferencejob_replicas", desired) == 1,
             what="the replica counted")
    unusable = {"virtual_cluster": "serve", "state": "unschedulable"}
    assert operator.ctx.metrics.registry.get_sample_value("huorn_virtualcluster_gpus", unusable) == 0
    kube.core.patch_node("b0", {"spec": {"taints": [{"key": "maint", "effect": "NoSchedule"}]}})
    wait_for(lambda: operator.ctx.metrics.value("huorn_virtualcluster_gpus", unusable) == 8,
             what="b0's 8 GPUs counted as taking no pods")
    kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, IJ, "chat",
                                               {"spec": {"virtualCluster": "gone"}})
    wait_for(lambda: operator.ctx.metrics.registry.get_sample_value("huorn_inferencejob_replicas", desired)
             is None, what="the gone cluster's job's gauges dropped")


def _not_ready(kube: builders.Kube, pod: object, ip: str) -> None:
    """Running, its readiness probe failing: a model still loading, a router knowing no replica."""
    body = {"status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "False"}]}}
    kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, body)


def test_a_readiness_change_without_a_phase_change_is_seen_at_once(
    cluster: EmulatedCluster, kube: builders.Kube
) -> None:
    """A replica is Running long before its model loads and it turns Ready; only a change of phase
    woke its job, so readyReplicas, a rollout's next step and an unready replica's traffic all
    waited for the resync (here a minute)."""
    settings = dataclasses.replace(operator_mod.FAST, resync_seconds=60.0)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        kube.create_job(NS, serving.make_inference_job("chat", "serve", gpus=4), plural=IJ)
        (pod,) = wait_for(lambda: kube.pods(NS, "chat", "server"), what="the replica")
        _not_ready(kube, pod, IPS["server-0"])
        wait_for(lambda: status(kube, "chat").get("replicas") == 1, what="the replica running, loading")
        assert status(kube, "chat").get("readyReplicas", 0) == 0
        run_pod(kube, pod, IPS["server-0"])
        wait_for(lambda: status(kube, "chat").get("readyReplicas") == 1, what="ready, seen", timeout=15)
        _not_ready(kube, pod, IPS["server-0"])
        wait_for(lambda: status(kube, "chat").get("readyReplicas") == 0, what="unready, seen", timeout=15)


def test_no_scale_to_zero_while_no_front_pod_is_ready_to_hold_requests(
    cluster: EmulatedCluster, kube: builders.Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At zero replicas only a ready activator (or router) answers and wakes the job: with none
    ready the last replica went, the Service pointed at a pod that was not ready, and nothing
    scaled the job up again (the held requests are read from ready front pods)."""
    from huorn.operator import autoscaling

    idle = "# TYPE huorn_serve_busy_seconds_total counter\nhuorn_serve_busy_seconds_total 0\n"
    ticks: list[int] = []

    def fetch_all(targets: dict, timeout: float) -> dict:
        ticks.append(1)
        return {k: idle for k in targets if not k.startswith("activator")}

    monkeypatch.setattr(autoscaling.replica_metrics, "fetch_all", fetch_all)
    settings = dataclasses.replace(operator_mod.FAST, autoscale_seconds=0.5)
    with operator_mod.OperatorThread(cluster.api_client(), settings):
        kube.create_job(NS, serving.make_inference_job(
            "chat", "serve", autoscaling={"minReplicas": 0, "maxReplicas": 1, "scaleDownDelaySeconds": 1}),
            plural=IJ)
        wait_for(lambda: servers(kube, "chat") and kube.pods(NS, "chat", "activator"), what="the pods")
        run_pod(kube, servers(kube, "chat")["server-0"], IPS["server-0"])
        (front,) = kube.pods(NS, "chat", "activator")
        _not_ready(kube, front, "127.0.0.6")
        wait_for(lambda: status(kube, "chat").get("readyReplicas") == 1, what="the replica ready")
        counted = len(ticks)
        wait_for(lambda: len(ticks) >= counted + 8, what="8 idle ticks, past the scale-down delay")
        assert list(servers(kube, "chat")) == ["server-0"] and not scaled(kube, "chat", "ScaledDown")
        run_pod(kube, front, "127.0.0.6")  # the activator ready: now the quiet job may go to zero
        (down, *_) = wait_for(lambda: scaled(kube, "chat", "ScaledDown"), what="to zero")
        assert "1 → 0" in down.message
        wait_for(lambda: not servers(kube, "chat"), what="the replica gone")
        # at zero, a front pod restarting (or rolled) is no reason to start a GPU replica
        _not_ready(kube, front, "127.0.0.6")
        counted = len(ticks)
        wait_for(lambda: len(ticks) >= counted + 6, what="6 ticks with the activator unready")
        assert not servers(kube, "chat") and not scaled(kube, "chat", "ScaledUp")
