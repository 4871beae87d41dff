"""Unit tests of the operator's parts that need no API: backoff (in fake time), manifests,
the cluster mirror's GPU accounting, validation messages and kstatus conditions."""

from __future__ import annotations

import asyncio
import datetime
import random
import time
import types
from pathlib import Path

import kubernetes
import pytest
import urllib3
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.api import training, virtualcluster
from huorn.backends.kubernetes import client as kube
from huorn.backends.kubernetes import manifests, retry
from huorn.graph import compiler
from huorn.graph.model import Instance
from huorn.operator import conditions, handlers, index, leadership, validation, virtualclusters
from huorn.operator.context import Context


def _api_error(status: int, retry_after: str | None = None) -> kubernetes.client.ApiException:
    exc = kubernetes.client.ApiException(status=status, reason="injected")
    exc.headers = {"Retry-After": retry_after} if retry_after else {}
    return exc


class Flaky:
    def __init__(self, *errors: BaseException) -> None:
        self.errors = list(errors)
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "done"


@pytest.mark.looptime
async def test_backoff_retries_429_and_5xx_with_full_jitter_in_fake_time(looptime) -> None:
    policy = retry.RetryPolicy(attempts=5, base_delay=1.0, max_delay=8.0)
    call = Flaky(_api_error(429), _api_error(500), _api_error(503))
    assert await retry.call_with_retry(call, policy, rng=random.Random(7)) == "done"
    # Full jitter, written out here rather than through policy.delay: uniform in [0, 1·2^attempt].
    draws = random.Random(7)
    expected = draws.uniform(0, 1) + draws.uniform(0, 2) + draws.uniform(0, 4)
    assert call.calls == 4
    assert float(looptime) == pytest.approx(expected, abs=1e-3)


def test_a_full_jitter_delay_spans_zero_to_the_capped_exponential() -> None:
    policy = retry.RetryPolicy(attempts=10, base_delay=0.5, max_delay=5.0)
    rng = random.Random(3)
    for attempt, cap in ((0, 0.5), (1, 1.0), (3, 4.0), (4, 5.0), (9, 5.0)):
        delays = [policy.delay(attempt, rng) for _ in range(2000)]
        assert all(0 <= d <= cap for d in delays), attempt
        assert max(delays) > 0.95 * cap and min(delays) < 0.05 * cap, attempt


@pytest.mark.looptime
async def test_backoff_honours_retry_after_but_caps_it(looptime) -> None:
    policy = retry.RetryPolicy(attempts=3, base_delay=0.1, max_delay=5.0)
    call = Flaky(_api_error(429, retry_after="3"), _api_error(429, retry_after="120"))
    assert await retry.call_with_retry(call, policy) == "done"
    assert float(looptime) == pytest.approx(3 + 5, abs=1e-3)


@pytest.mark.looptime
@pytest.mark.parametrize(
    ("status", "conflicts", "calls"), [(422, True, 1), (404, True, 1), (409, False, 1), (409, True, 2)]
)
async def test_refusals_are_not_retried(looptime, status: int, conflicts: bool, calls: int) -> None:
    policy = retry.RetryPolicy(attempts=2, base_delay=0.5, max_delay=1.0, retry_conflicts=conflicts)
    call = Flaky(_api_error(status), _api_error(status))
    with pytest.raises(kubernetes.client.ApiException):
        await retry.call_with_retry(call, policy)
    assert call.calls == calls


@pytest.mark.looptime
async def test_connection_errors_the_kubernetes_client_raises_are_retried(looptime) -> None:
    """The client lets urllib3's errors through unwrapped, and they are no OSError: a reset or a
    read timeout (the API server failing over) had ended the reconcile at once."""
    policy = retry.RetryPolicy(attempts=4, base_delay=0.1, max_delay=0.5)
    pool = urllib3.HTTPConnectionPool("api", 443)
    call = Flaky(urllib3.exceptions.ProtocolError("Connection aborted."),
                 urllib3.exceptions.ReadTimeoutError(pool, "/api/v1/pods", "Read timed out."),
                 urllib3.exceptions.MaxRetryError(pool, "/api/v1/pods"))
    assert await retry.call_with_retry(call, policy, rng=random.Random(1)) == "done"
    assert call.calls == 4


def test_every_api_call_has_a_deadline() -> None:
    seen: dict = {}

    def read_node(name: str, **kwargs: object) -> dict:
        seen.update(kwargs)
        return {"metadata": {"name": name}}

    client = kube.KubeClient(kubernetes.client.ApiClient())
    asyncio.run(client._call(read_node, "n1"))
    assert seen["_request_timeout"] == kube.REQUEST_TIMEOUT and all(0 < t <= 60 for t in kube.REQUEST_TIMEOUT)


def test_retry_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="attempts"):
        retry.RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="base_delay"):
        retry.RetryPolicy(base_delay=2, max_delay=1)


def _job(**spec: object) -> dict:
    body = {
        "apiVersion": "huorn.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "llm", "namespace": "team", "uid": "u-1", "generation": 1},
        "spec": {
            "virtualCluster": "train",
            "image": "mirror.example/huorn:1",  # resolved already (huorn.operator.images.pin)
            "elasticity": {"minReplicas": 2, "maxReplicas": 3},
            "optimization": {"steps": 5},
            **spec,
        },
    }
    return body


def test_store_pod_runs_the_runtimes_store_on_the_service_port() -> None:
    body = _job()
    ref = manifests.JobRef.from_body(body)
    pod = manifests.build_store_pod(ref, Instance("rendezvous", 0), body["spec"])
    assert pod["spec"]["containers"][0]["command"] == [
        "python", "-m", "huorn.runtime.store", "--host", "0.0.0.0", "--port", "29400"]
    service = manifests.build_store_service(ref)
    assert service["spec"]["selector"] == {"huorn.io/job": "llm", "huorn.io/vertex": "rendezvous"}
    assert [(p["port"], p["targetPort"]) for p in service["spec"]["ports"]] == [(29400, 29400)]
    assert service["spec"]["clusterIP"] == "None"  # headless: agents reach the store pod itself
    assert manifests.rendezvous_endpoint(ref) == "llm-rdzv.team.svc:29400"


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 5)), min_size=1, max_size=30, unique=True))
def test_pod_names_are_unique_dns_labels_per_instance_generation(instances: list[tuple[int, int]]) -> None:
    ref = manifests.JobRef("TrainingJob", "a-job", "ns", "uid")
    names = [manifests.pod_name(ref, Instance("trainer", o, g)) for o, g in instances]
    assert len(set(names)) == len(names)
    assert all(len(n) <= 63 and n.replace("-", "").isalnum() and n.islower() for n in names)


def test_trainer_pod_pins_the_node_and_mounts_config_and_checkpoints() -> None:
    body = _job(
        checkpoint={"volume": "ckpt", "path": "/ckpt"}, resources={"gpus": 0, "cpu": "1", "memory": "1Gi"}
    )
    ref = manifests.JobRef.from_body(body)
    graph = compiler.compile(validation.load_job(body))
    pod = manifests.build_trainer_pod(ref, graph, Instance("trainer", 1), "node-7", body["spec"], "train")
    term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["nodeSelectorTerms"][0]["matchExpressions"][0]["values"] == ["node-7"]
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert manifests.GPU_RESOURCE not in limits, "a CPU-only replica asks for no GPU"
    # torch's agent would SIGKILL its workers 30 s after SIGTERM whatever the deletion's grace
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    most = virtualcluster.Lending.model_fields["reclaim_grace_seconds"].metadata
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) >= next(m.le for m in most if hasattr(m, "le"))
    # One process per replica, so `auto` resizes in place: the pod runs the trainer, no agent.
    command = pod["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "huorn.runtime.train"] and "--in-place" in command
    assert pod["spec"]["restartPolicy"] == "Never"
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["spec"]["volumes"]
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u-1"


@pytest.mark.parametrize("resources", [{"gpus": 0}, {"gpus": 1}, {"gpus": 4}, None])
def test_the_run_config_of_a_replica_with_gpus_demands_cuda(resources: dict | None) -> None:
    """A replica given GPUs must train on them: with `device: auto` a trainer whose image has a
    CPU-only torch trained on the CPU unnoticed. The run config says `cuda` exactly when the pod
    asks for GPUs (a spec without resources asks for the default one), `auto` otherwise."""
    from huorn.runtime import config as run_config

    body = _job(**({"resources": resources} if resources is not None else {}))
    ref = manifests.JobRef.from_body(body)
    graph = compiler.compile(validation.load_job(body))
    pod = manifests.build_trainer_pod(ref, graph, Instance("trainer", 0), "node-1", body["spec"], "train")
    wants_gpus = manifests.GPU_RESOURCE in pod["spec"]["containers"][0]["resources"]["limits"]
    assert wants_gpus is (resources is None or resources["gpus"] > 0)
    cfg = run_config.RunConfig.model_validate(manifests.build_run_config(ref, body["spec"]))
    assert cfg.device == ("cuda" if wants_gpus else "auto")
    # ... and the ConfigMap the pods mount carries the same
    config_map = manifests.build_config_map(ref, body["spec"])
    mounted = run_config.RunConfig.model_validate_json(config_map["data"][manifests.CONFIG_FILE])
    assert mounted.device == cfg.device


def test_a_gpu_replica_whose_torch_has_no_cuda_fails_at_start(tmp_path) -> None:
    """What `device: cuda` buys: the trainer refuses to start on a CPU-only torch."""
    torch = pytest.importorskip("torch")
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA: the CPU-only image is what is tested")
    from huorn.runtime import config as run_config
    from huorn.runtime import train

    body = _job(resources={"gpus": 1})
    config = manifests.build_run_config(manifests.JobRef.from_body(body), body["spec"])
    cfg = run_config.RunConfig.model_validate(config | {"runDir": str(tmp_path / "run")})
    with pytest.raises((AssertionError, AttributeError, RuntimeError)):
        train.Trainer(cfg)
    assert not (tmp_path / "run").exists(), "it failed before doing anything"


def _pod(name: str, node: str, gpus: int, vc: str, phase: str = "Running") -> dict:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {"huorn.io/job": name.split("-")[0], "huorn.io/vertex": "trainer"},
            "annotations": {
                "huorn.io/node": node,
                "huorn.io/gpus": str(gpus),
                "huorn.io/virtual-cluster": vc,
            },
        },
        "spec": {"containers": [{"resources": {"limits": {"cpu": "1"}}}]},
        "status": {"phase": phase},
    }


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a0", "a1", "b0", "c0"]),
            st.integers(1, 4),
            st.sampled_from(["a", "b"]),
            st.sampled_from(["Running", "Failed", "Pending"]),
        ),
        max_size=12,
    )
)
def test_lent_equals_borrowed_and_allocation_counts_only_live_pods(pods: list) -> None:
    ctx = Context(client=None, post_event=lambda *a: None)  # type: ignore[arg-type]
    for name, gpus, pool in (("a0", 16, "a"), ("a1", 16, "a"), ("b0", 16, "b"), ("c0", 16, "none")):
        ctx.index.nodes[name] = index.NodeRecord(name, gpus, {"pool": pool})
    ctx.index.vcs = {vc: {"members": {"nodeSelector": {"matchLabels": {"pool": vc}}}} for vc in ("a", "b")}
    for i, (node, gpus, vc, phase) in enumerate(pods):
        ctx.index.observe_pod(_pod(f"j{i}-trainer-0", node, gpus, vc, phase))
    usage = {vc: virtualclusters.compute_usage(ctx, vc) for vc in ("a", "b")}
    assert usage["a"]["lent"] + usage["b"]["lent"] == usage["a"]["borrowed"] + usage["b"]["borrowed"]
    live_on = {vc: sum(g for n, g, _, p in pods if p != "Failed" and n[0] == vc) for vc in ("a", "b")}
    assert {vc: u["allocated"] for vc, u in usage.items()} == live_on
    assert usage["a"]["capacity"] == 32 and usage["b"]["capacity"] == 16


def test_snapshot_places_around_pods_and_reservations() -> None:
    ix = index.ClusterIndex()
    ix.nodes = {
        "a0": index.NodeRecord("a0", 4, {"pool": "a"}),
        "a1": index.NodeRecord("a1", 4, {"pool": "a"}),
    }
    ix.vcs = {"a": {"members": {"nodeSelector": {"matchLabels": {"pool": "a"}}}}}
    ix.observe_pod(_pod("x-trainer-0", "a0", 3, "a"))
    ix.reserve([index.PodRecord("ns", "y-trainer-0", "y", "trainer", "trainer-0", "a1", 2, 0, "a")])
    snap = ix.build_snapshot()
    assert snap.free("a") == 3
    assert snap.place("a", 2, 2).reason.startswith("needs 4 GPUs")  # 1 free on a0, 2 on a1
    assert snap.place("a", 1, 2).assignments == ["a1"]


def test_validation_names_fields() -> None:
    with pytest.raises(validation.InvalidSpec, match=r"^spec\.resources\.gpus"):
        validation.load_job(_job(resources={"gpus": -1}))
    with pytest.raises(validation.InvalidSpec, match=r"spec\.model\.width"):
        validation.load_job(_job(model={"width": 130, "heads": 4}))
    with pytest.raises(validation.InvalidSpec, match=r"spec\.optimization"):
        validation.load_job(_job(optimization={"globalBatch": 8, "microBatch": 4}))
    with pytest.raises(validation.InvalidSpec, match=r"spec\.virtualCluster.*team"):
        validation.check_namespace("team", "train", {"namespaces": ["other"]})


def test_checkpoints_a_pod_reads_must_be_on_its_checkpoint_volume() -> None:
    def spec(path: str, volume: str | None = "ckpt", kind: str = "distill") -> training.TrainingJobSpec:
        task = ({"kind": "distill", "teacher": {"checkpoint": path}} if kind == "distill"
                else {"kind": "cpt", "initCheckpoint": path})
        job = validation.load_job(_job(task=task, checkpoint={"volume": volume, "path": "/checkpoints/run"}))
        assert isinstance(job.spec, training.TrainingJobSpec)
        return job.spec

    validation.check_mounted_paths(spec("/checkpoints/run/teacher/step-100"))
    validation.check_mounted_paths(spec("/checkpoints/run/base", kind="cpt"))
    validation.check_mounted_paths(spec("/models/teacher", volume=None))  # baked into the image
    with pytest.raises(validation.InvalidSpec, match=r"^spec.task.teacher.checkpoint: .*'/checkpoints/run"):
        validation.check_mounted_paths(spec("/models/teacher"))
    with pytest.raises(validation.InvalidSpec, match=r"^spec\.task\.initCheckpoint"):
        validation.check_mounted_paths(spec("/checkpoints/run/../other", kind="cpt"))
    with pytest.raises(validation.InvalidSpec, match=r"^spec\.task\.teacher\.checkpoint"):
        validation.check_mounted_paths(spec("teacher/step-100"))  # relative: the pod's cwd is not the volume


@pytest.mark.parametrize(("gpus", "stages", "refused"), [
    (1, 2, True), (4, 3, True), (6, 4, True),  # a pod would hold part of a pipeline
    (0, 2, False), (2, 2, False), (8, 4, False), (3, 1, False),
])
def test_a_pod_whose_gpus_do_not_hold_whole_pipelines_is_refused_naming_the_fix(
        gpus: int, stages: int, refused: bool) -> None:
    """A pod runs a process per GPU and each pipeline lies inside one replica, so 1 GPU with 2
    stages, which a local run accepts (it starts a process per stage), cannot run in a cluster:
    its gang failed only in the trainers, after placement (world size not a multiple of the
    stages). The operator and `huorn validate` refuse it before anything is created."""
    job = validation.load_job(_job(resources={"gpus": gpus}, parallelism={"pipelineStages": stages},
                                   model={"layers": 8}))
    if not refused:
        validation.check_spec_alone(job)
        return
    with pytest.raises(validation.InvalidSpec) as caught:
        validation.check_spec_alone(job)
    message = str(caught.value)
    assert message.startswith(f"spec.resources.gpus: a pod runs one pipeline stage on each of its GPUs, so "
                              f"its {gpus} GPU(s) must be a multiple of spec.parallelism.pipelineStages "
                              f"({stages})")
    assert str(list(range(stages, 17, stages))) in message and f"a divisor of {gpus}" in message


def test_conditions_keep_transition_time_until_status_changes() -> None:
    first = conditions.build_conditions(
        None, 1, ready=(False, "Placing", "0/2"), reconciling=(True, "Placing", "")
    )
    for c in first:
        c["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    second = conditions.build_conditions(first, 2, ready=(True, "Running", "2/2"))
    by_type = {c["type"]: c for c in second}
    assert by_type["Stalled"]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    assert by_type["Ready"]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    assert all(c["observedGeneration"] == 2 for c in second)
    assert conditions.is_true(second, "Ready") and not conditions.is_true(second, "Reconciling")


def test_the_suspended_condition_appears_with_the_first_suspension_and_stays() -> None:
    plain = conditions.build_conditions(None, 1, ready=(True, "Running", "2/2"))
    assert [c["type"] for c in plain] == ["Ready", "Reconciling", "Stalled"]
    held = conditions.build_conditions(plain, 2, ready=(False, "Suspended", "s"),
                                       suspended=(True, "Suspended", "s"))
    assert conditions.is_true(held, "Suspended")
    # Once written, it stays: False with reason Resumed when the job runs again.
    back = conditions.build_conditions(held, 3, ready=(True, "Running", "2/2"))
    suspended = next(c for c in back if c["type"] == "Suspended")
    assert (suspended["status"], suspended["reason"]) == ("False", "Resumed")
    assert suspended["observedGeneration"] == 3


def test_kubeclient_apply_is_create_or_patch(tmp_path) -> None:
    """Against the emulator: a second apply of the same ConfigMap patches it instead of failing."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from kube.cluster import EmulatedCluster

    from huorn.backends.kubernetes import client as kube

    with EmulatedCluster(tmp_path) as cluster:
        client = kube.KubeClient(cluster.api_client())
        ref = manifests.JobRef("TrainingJob", "llm", "team", "uid")

        async def scenario() -> tuple[dict, dict, bool, bool, list]:
            first = await client.apply(manifests.build_config_map(ref, {"a": 1}))
            second = await client.apply(manifests.build_config_map(ref, {"a": 2}))
            gone = await client.delete("ConfigMap", "team", "llm-config")
            again = await client.delete("ConfigMap", "team", "llm-config")
            left = await client.list("ConfigMap", "team", {"huorn.io/job": "llm"})
            return first, second, gone, again, left

        first, second, gone, again, left = asyncio.run(scenario())
    assert '"a": 1' in first["data"]["config.json"] and '"a": 2' in second["data"]["config.json"]
    assert (gone, again, left) == (True, False, [])


def test_a_pod_create_that_meets_409_keeps_the_existing_pod_as_it_is(tmp_path) -> None:
    """A reconcile whose mirror missed a pod (a create that landed while every retry failed, or
    a pod created just before) creates it again, elsewhere. A pod cannot move: the existing one is
    returned untouched, so the mirror records the node it runs on. Its metadata used to be patched
    with the new placement's annotations, and every mirror counted its GPUs on the wrong node."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from kube import serving as serving_jobs
    from kube.cluster import EmulatedCluster

    from huorn.backends.kubernetes import client as kube
    from huorn.graph.model import Instance

    ref = manifests.JobRef("InferenceJob", "chat", "team", "uid")
    spec = {**serving_jobs.make_inference_job("chat", "serve")["spec"], "image": "mirror.example/huorn:1"}
    with EmulatedCluster(tmp_path) as cluster:
        client = kube.KubeClient(cluster.api_client())

        async def scenario() -> tuple[dict, dict]:
            replica = Instance("server", 0)
            first = await client.apply(manifests.build_serve_pod(ref, replica, "b0", spec, "serve"))
            again = await client.apply(manifests.build_serve_pod(ref, replica, "b1", spec, "serve"))
            return first, again

        first, again = asyncio.run(scenario())
    assert index.build_pod_record(first).node == "b0"
    assert again["kind"] == "Pod" and again["metadata"]["uid"] == first["metadata"]["uid"]
    # through the operator's own writer, the mirror that missed it records it where it runs
    (tmp_path / "again").mkdir()
    with EmulatedCluster(tmp_path / "again") as cluster:
        ctx = Context(client=kube.KubeClient(cluster.api_client()), post_event=lambda *_: None)
        replica = Instance("server", 0)
        asyncio.run(ctx.client.apply(manifests.build_serve_pod(ref, replica, "b0", spec, "serve")))
        moved = manifests.build_serve_pod(ref, replica, "b1", spec, "serve")
        ctx.index.reserve([index.build_pod_record(moved)])
        asyncio.run(ctx.apply_all([moved]))
    record = ctx.index.pods[("team", moved["metadata"]["name"])]
    assert record.node == "b0" and not ctx.index.reservations
    assert index.build_pod_record(again).node == "b0", "the mirror records where it runs"
    assert again["metadata"]["annotations"][manifests.ANNOTATION_NODE] == "b0"


def _pod_body(name: str, phase: str = "Running") -> dict:
    labels = {"huorn.io/job": "j", "huorn.io/vertex": "trainer", "huorn.io/instance": name}
    return {"metadata": {"namespace": "team", "name": name, "labels": labels},
            "spec": {"nodeName": "a0", "containers": [{"resources": {"limits": {"nvidia.com/gpu": "1"}}}]},
            "status": {"phase": phase}}


def test_a_mirror_resync_drops_only_what_the_watch_missed() -> None:
    mirror = index.ClusterIndex()
    for name in ("kept", "gone", "changed"):
        mirror.observe_pod(_pod_body(name))
    mark = mirror.observations
    # The list began here; the watch then saw a new pod and a phase change before it answered.
    mirror.observe_pod(_pod_body("new"))
    mirror.observe_pod(_pod_body("changed", "Succeeded"))
    listed = [_pod_body("kept", "Failed"), _pod_body("changed")]  # "gone" was deleted unseen
    dropped = mirror.resync_pods(listed, mark)
    assert [p.name for p in dropped] == ["gone"]
    assert sorted(name for _, name in mirror.pods) == ["changed", "kept", "new"]
    assert mirror.pods[("team", "kept")].phase == "Failed", "the list is newer than the watch here"
    assert mirror.pods[("team", "changed")].phase == "Succeeded", "the watch is newer than the list here"


def test_pod_creation_times_read_the_same_from_a_watch_and_from_a_list() -> None:
    assert index.parse_time("2026-12-01T06:00:00Z") == index.parse_time("2026-12-01T06:00:00+00:00") > 0
    assert index.parse_time(None) == index.parse_time("yesterday") == 0.0


def test_the_operator_starts_without_scikit_learn() -> None:
    """scikit-learn is ~50 MiB of the operator's footprint; only a forecasting inference cluster
    or a performance model that fits a residual needs it (it crept back in once, via the board)."""
    import subprocess
    import sys

    probe = "import sys, huorn.cli.operator, huorn.operator.handlers; print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _front_pod(deleted: str | None, grace: int | None = None, kind: str = "InferenceJob") -> dict:
    labels = {"huorn.io/job": "chat", "huorn.io/vertex": "activator", "huorn.io/instance": "activator-0",
              "huorn.io/kind": kind}
    meta: dict = {"namespace": "team", "name": "chat-activator-0", "labels": labels}
    if deleted:
        meta["deletionTimestamp"] = deleted
        if grace is not None:
            meta["deletionGracePeriodSeconds"] = grace
    return {"metadata": meta, "spec": {"terminationGracePeriodSeconds": 90}, "status": {"phase": "Running"}}


def test_a_terminating_pod_records_its_kind_and_when_its_grace_is_surely_over() -> None:
    stamp = index.parse_time("2026-12-05T10:00:00Z")
    record = index.build_pod_record(_front_pod("2026-12-05T10:00:00Z", grace=30))
    assert record is not None and record.kind == "InferenceJob" and record.grace_ends == stamp + 30
    assert not record.past_grace(stamp + 29) and record.past_grace(stamp + 31)
    # no deletionGracePeriodSeconds (KMock sets none): the pod's own grace
    assert index.build_pod_record(_front_pod("2026-12-05T10:00:00Z")).grace_ends == stamp + 90
    running = index.build_pod_record(_front_pod(None, kind="RLJob"))
    assert running.kind == "RLJob" and running.grace_ends == 0 and not running.past_grace(stamp + 10**6)


def test_a_retiring_service_waits_for_a_terminating_front_pod_but_not_past_its_grace() -> None:
    """routing.policy back to `service`: `<job>-endpoints` stays while the old router drains,
    and goes once the router's grace is surely over, the pod still there (its node stopped
    answering: it would stay until someone removed it, and the Service with it)."""
    from huorn.operator import serving

    ref = manifests.JobRef("InferenceJob", "chat", "team", "uid-1")
    deleted: list[str] = []

    class Client:
        async def delete(self, kind: str, namespace: str, name: str) -> bool:
            deleted.append(name)
            return True

    ctx = types.SimpleNamespace(client=Client())

    def retire(stamp: str) -> list[str]:
        pod = index.build_pod_record(_front_pod(stamp, grace=30))
        return asyncio.run(serving._retire_front_services(  # type: ignore[arg-type]
            ctx, ref, {"frontServices": ["endpoints"]}, [pod], {}, False, False))

    recent = _iso(time.time() - 5)  # the operator reads the wall clock
    assert retire(recent) == ["endpoints"] and deleted == []
    long_ago = _iso(time.time() - 3600)
    assert retire(long_ago) == [] and deleted == ["chat-endpoints"]


def _iso(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).isoformat()


def test_a_resync_wakes_each_dropped_pods_job_by_its_kind() -> None:
    """ctx.wake reconciles TrainingJobs: an InferenceJob woken through it was looked up as a
    TrainingJob and left as it was."""
    from huorn.operator import handlers

    woken: list[tuple[str, str, str]] = []
    ctx = types.SimpleNamespace(**{name: (lambda tag: lambda ns, job: woken.append((tag, ns, job)))(name)
                                   for name in ("wake", "wake_serving", "wake_rl")})
    pods = [index.build_pod_record(_front_pod(None, kind=kind)) for kind in ("InferenceJob", "RLJob")]
    pods.append(index.build_pod_record(_pod_body("t0")))  # a trainer: no kind label, a TrainingJob
    handlers.wake_jobs_of(ctx, pods)  # type: ignore[arg-type]
    assert sorted(woken) == [("wake", "team", "j"), ("wake_rl", "team", "chat"),
                             ("wake_serving", "team", "chat")]


def test_leadership_follows_kopfs_rule_over_the_peering_status() -> None:
    now = datetime.datetime(2026, 12, 6, 12, 0, tzinfo=datetime.UTC)

    def peer(priority: int, seconds_ago: float = 1, lifetime: int = 60) -> dict:
        seen = now - datetime.timedelta(seconds=seconds_ago)
        return {"priority": priority, "lifetime": lifetime, "lastseen": seen.isoformat()}

    assert leadership.leads_in({"me": peer(5), "other": peer(3)}, "me", 5, now)
    assert not leadership.leads_in({"me": peer(5), "other": peer(9)}, "me", 5, now)
    assert not leadership.leads_in({"me": peer(5), "twin": peer(5)}, "me", 5, now), "kopf pauses both"
    assert leadership.leads_in({"me": peer(5), "gone": peer(9, seconds_ago=61)}, "me", 5, now), "dead"
    assert not leadership.leads_in({"other": peer(1)}, "me", 5, now), "not announced yet"
    naive = {"me": peer(5), "other": {"priority": 9, "lastseen": "2026-12-06T11:59:59"}}
    assert not leadership.leads_in(naive, "me", 5, now)


async def test_a_wake_reconciles_only_in_a_served_namespace_and_only_when_leading() -> None:
    """The wakes and the mirror's re-list run outside kopf's handlers, which the namespaces served
    and the peering pause only filter; the startup listing holds every namespace's jobs."""

    class Client:
        def __init__(self) -> None:
            self.reads: list[str] = []

        async def get_custom(self, plural: str, namespace: str, name: str) -> None:
            self.reads.append(f"{namespace}/{name}")  # absent: the reconcile ends here

        async def get_peering(self, name: str) -> dict:
            return {"status": {"them": {"priority": 9, "lifetime": 60,
                                        "lastseen": datetime.datetime.now(datetime.UTC).isoformat()},
                               "me": {"priority": 5, "lifetime": 60,
                                      "lastseen": datetime.datetime.now(datetime.UTC).isoformat()}}}

    client = Client()
    ctx = Context(client=client, post_event=lambda *a: None,  # type: ignore[arg-type]
                  namespaces=frozenset({"team"}))
    wake = handlers._waker(ctx)
    wake("other", "a")
    wake("team", "b")
    for _ in range(5):
        await asyncio.sleep(0)
    assert client.reads == ["team/b"]
    ctx.leadership = leadership.Leadership("huorn", "me", 5)  # "them" outranks it: a standby
    wake("team", "c")
    for _ in range(5):
        await asyncio.sleep(0)
    assert client.reads == ["team/b"]


def test_a_cordon_that_lost_a_race_reads_the_taints_again_and_keeps_the_other_controllers() -> None:
    """The taint list is written whole: a taint the node controller added between the read and
    the patch must make the patch fail (409 on its resourceVersion) and be read again, not erased."""
    unreachable = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    node = {"metadata": {"name": "n1", "resourceVersion": "1"}, "spec": {"taints": []}}
    patches: list[dict] = []

    class Core:
        def read_node(self, name: str, **_: object) -> dict:
            return node

        def patch_node(self, name: str, body: dict, **_: object) -> dict:
            patches.append(body)
            if body["metadata"]["resourceVersion"] != node["metadata"]["resourceVersion"]:
                raise kubernetes.client.ApiException(status=409, reason="Conflict")
            if len(patches) == 1:  # the node controller wins the race
                node["spec"]["taints"] = [unreachable]
                node["metadata"]["resourceVersion"] = "2"
                raise kubernetes.client.ApiException(status=409, reason="Conflict")
            node["spec"].update(body["spec"])
            return node

    client = kube.KubeClient(kubernetes.client.ApiClient())
    client.core = Core()  # type: ignore[assignment]
    cordon = {"key": "huorn.io/cordoned", "effect": "NoSchedule"}
    done = asyncio.run(client.cordon_node("n1", cordon))
    assert [p["metadata"]["resourceVersion"] for p in patches] == ["1", "2"]
    assert done["spec"]["taints"] == [unreachable, cordon] and done["spec"]["unschedulable"] is True


async def test_a_partly_failed_gang_create_keeps_the_created_pods_counted() -> None:
    """One failed create of a concurrent gang write: the caller releases its reservations, so the
    pods created beside it must already be in the mirror, or their GPUs look free to the next
    placement until the watch reports them."""
    body = _job()
    ref = manifests.JobRef.from_body(body)
    made = manifests.build_store_pod(ref, Instance("rendezvous", 0), body["spec"])
    refused = {**made, "metadata": {**made["metadata"], "name": "llm-refused"}}

    class Client:
        async def apply(self, manifest: dict) -> dict:
            if manifest["metadata"]["name"] == "llm-refused":
                raise kubernetes.client.ApiException(status=500, reason="etcd leader changed")
            return {**manifest, "kind": "Pod"}

    ctx = Context(client=Client(), post_event=lambda *a: None)  # type: ignore[arg-type]
    with pytest.raises(kubernetes.client.ApiException):
        await ctx.apply_all([made, refused])
    assert [name for _, name in ctx.index.pods] == [made["metadata"]["name"]]
    assert await ctx.apply_all([made]) == [{**made, "kind": "Pod"}]


async def test_the_autoscalers_window_ignores_a_wall_clock_step(monkeypatch) -> None:
    """The scale-down window runs on the monotonic clock: a wall-clock step (NTP) longer than
    scaleDownDelaySeconds had emptied the window, so one quiet scrape scaled a loaded service
    down at once."""
    from huorn.backends import replica_metrics
    from huorn.graph import mutate, serialise
    from huorn.operator import autoscaling, serving

    body = {"apiVersion": "huorn.io/v1alpha1", "kind": "InferenceJob",
            "metadata": {"name": "chat", "namespace": "team", "uid": "u-2", "generation": 1},
            "spec": {"virtualCluster": "serve", "resources": {"gpus": 1},
                     "model": {"checkpoint": "/checkpoints/chat"}, "serving": {"maxBatch": 4},
                     "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "scaleDownDelaySeconds": 60}}}
    graph = compiler.compile(validation.load_job(body))
    mutate.resize(graph, serving.SERVER, 2, reason="two replicas run")
    stored = {**body, "status": {"phase": "Running", "graph": serialise.to_status(graph)}}
    patches: list[dict] = []

    class Client:
        async def get_custom(self, plural: str, namespace: str, name: str) -> dict:
            return stored

        async def patch_status(self, plural: str, namespace: str, name: str, patch: dict) -> None:
            patches.append(patch)

    ctx = Context(client=Client(), post_event=lambda *a: None)  # type: ignore[arg-type]
    ref = manifests.JobRef.from_body(body)
    for i, instance in enumerate(graph.vertex(serving.SERVER).instances):
        ctx.index.observe_pod({
            "metadata": {"namespace": "team", "name": manifests.pod_name(ref, instance),
                         "labels": {"huorn.io/job": "chat", "huorn.io/vertex": serving.SERVER,
                                    "huorn.io/instance": instance.name}},
            "spec": {"nodeName": f"s{i}"}, "status": {"phase": "Running", "podIP": f"10.0.0.{i + 1}"}})
    busy = {"seconds": 0.0}

    def scrape(targets: dict, timeout: float) -> dict:
        text = (f"huorn_serve_busy_seconds_total {busy['seconds']}\n"
                'huorn_serve_requests_total{outcome="ok"} 0\n')
        return {replica: text for replica in targets}

    clock = {"wall": 1_800_000_000.0, "monotonic": 500.0}
    monkeypatch.setattr(replica_metrics, "fetch_all", scrape)
    monkeypatch.setattr(autoscaling.time, "time", lambda: clock["wall"])
    monkeypatch.setattr(autoscaling.time, "monotonic", lambda: clock["monotonic"])

    async def tick_after(seconds: float, busy_share: float, wall_step: float = 0.0) -> int:
        clock["wall"] += seconds + wall_step
        clock["monotonic"] += seconds
        busy["seconds"] += busy_share * seconds
        rec = await autoscaling.tick(ctx, "team", "chat")
        assert rec is not None
        return rec.replicas

    await tick_after(10, 1.0)  # the first scrape: nothing measured yet
    assert await tick_after(10, 1.0) == 2, "both replicas busy: the service keeps its two"
    # ten seconds later by the monotonic clock, a day by the wall clock, and idle
    assert await tick_after(10, 0.0, wall_step=86_400) == 2, "the busy reading is still in the window"
    assert "desiredReplicas" not in [k for p in patches for k in p]


def test_a_stored_job_with_fields_its_kind_no_longer_has_still_loads() -> None:
    """The CRDs before 2026-12-06 defaulted `priority: 50` (and elasticity, remediation) into
    every InferenceJob, elasticity into every RLJob. Helm never upgrades CRDs: an operator
    upgraded first read them back and Stalled each stored job as InvalidSpec."""
    import yaml

    from huorn.api import kinds as api_kinds
    from huorn.api import manifests as api_manifests

    root = Path(__file__).resolve().parents[1] / "examples"
    stored = yaml.safe_load((root / "inference-job.yaml").read_text())
    stored["metadata"]["namespace"] = "team"
    stored["spec"].update(priority=50, elasticity={"minReplicas": 1, "maxReplicas": 1},
                          remediation={"maxRestarts": 3})
    assert isinstance(validation.load_job(stored), api_kinds.InferenceJob)
    rl_job = yaml.safe_load((root / "rl-job.yaml").read_text())
    rl_job["spec"]["elasticity"] = {"minReplicas": 1, "maxReplicas": 1, "policy": "fixed"}
    assert isinstance(validation.load_job(rl_job), api_kinds.RLJob)
    # what a user applies is still judged as the API server with the new CRDs judges it
    with pytest.raises(api_manifests.ManifestError, match=r"spec\.priority"):
        api_manifests.load_manifest(stored)


def test_gpus_held_for_waiting_jobs_are_held_on_the_nodes_their_selectors_admit() -> None:
    """Two jobs wait on t0 (H100s) and t1 (T4s), 8 GPUs each: one for any 8, one for 8 H100s.
    Held in key order, the first took t0 and the H100 job's hold found no room, so a peer's
    growth could take t1 and one of them went on waiting (a review)."""
    from huorn.operator import allocation
    from huorn.scheduler import placement, snapshot

    nodes = [placement.NodeView("t0", 8, 8, labels={"gpu": "h100"}, virtual_cluster="train"),
             placement.NodeView("t1", 8, 8, labels={"gpu": "t4"}, virtual_cluster="train")]
    snap = snapshot.ClusterSnapshot(nodes, [snapshot.VirtualClusterView("train")])
    allocation.hold_for_waiting(snap, {("train", ()): 8, ("train", (("gpu", "h100"),)): 8})
    held = {key: dict(b.gpus_by_node) for key, b in snap.bindings().items()}
    assert held == {"waiting-in-line/train/gpu=h100": {"t0": 8}, "waiting-in-line/train": {"t1": 8}}
    assert all(v.gpus_free == 0 for v in snap.node_views())
