"""Remediation S3 in a cluster: a `stageLayers` set-param in the job's graph (what the monitor
writes for an S3 decision) reaches the run config in the job's ConfigMap, and the gang is rolled
once: the old trainer pods are deleted gracefully and hold their GPUs until they are gone (they
checkpoint on SIGTERM), and only then do their successors start on the new split. Real kopf
against KMock; the test plays the kubelet, which lets a deleted pod linger while it checkpoints.
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest
from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.kubelet import Kubelet

from huorn.backends.kubernetes import manifests, observe
from huorn.graph import mutate, serialise
from huorn.operator import training
from huorn.runtime import config as run_config
from huorn.runtime import telemetry as runtime_telemetry
from huorn.scheduler.remediation import policy

pytest_plugins = ["kube.fixtures"]

NS = "team"
PIPELINE_IPS = {"trainer-0": "127.0.0.2", "trainer-1": "127.0.0.3"}


def make_job(name: str, max_restarts: int | None = None) -> dict[str, Any]:
    body = builders.make_training_job(name, "train", replicas=2, max_replicas=2, gpus=4,
                                      parallelism={"pipelineStages": 2}, model={"layers": 4})
    if max_restarts is not None:
        body["spec"]["remediation"] = {"maxRestarts": max_restarts}
    return body


def decide_s3(kube: builders.Kube, job: str, split: list[int], why: str) -> int:
    """What the monitor writes for an S3 decision: the set-param in the graph, in status."""
    g = serialise.from_status(kube.job_status(NS, job)["graph"])
    m = mutate.set_param(g, "trainer", "stageLayers", split, reason=why)
    assert m is not None
    kube.custom.patch_namespaced_custom_object_status(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", job,
        {"status": {"graph": serialise.to_status(g), "decisions": training.build_decisions(g)}})
    return m.version


def run_config_of(kube: builders.Kube, job: str, tmp_path: Path) -> run_config.RunConfig:
    """The ConfigMap's run config as the trainer loads it (the runtime's own model and checks)."""
    ref = manifests.JobRef.from_body(kube.get_job(NS, job))
    data = kube.core.read_namespaced_config_map(manifests.config_map_name(ref), NS).data
    path = tmp_path / "config.json"
    path.write_text(data[manifests.CONFIG_FILE])
    return run_config.load_run_config(path)


def trainers(kube: builders.Kube, job: str) -> list[str]:
    return [p.metadata.name for p in kube.pods(NS, job, "trainer")]


def test_s3_split_reaches_the_config_and_the_gang_rolls_once(
        cluster: EmulatedCluster, kube: builders.Kube, tmp_path: Path) -> None:
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, make_job("pp", max_restarts=1))
        wait_for(lambda: len(trainers(kube, "pp")) == 2, what="2 trainer pods")
        kube.run_all_pods(NS, "pp")
        kubelet.hold(trainers(kube, "pp"))
        wait_for(lambda: kube.job_status(NS, "pp").get("phase") == "Running", what="Running")
        assert run_config_of(kube, "pp", tmp_path).stage_layers is None
        # Both nodes of VC "train" are full (4 GPUs each): a successor placed beside a draining
        # pod would have to borrow, or fail, which is why successors wait for their predecessors.

        why = "remediation S3 (resplit): stage 1 is 1.8x slower per layer"
        version = decide_s3(kube, "pp", [3, 1], why)
        wait_for(lambda: len(kubelet.deletes()) >= 2, what="both trainer pods deleted")
        assert sorted({n for n, _ in kubelet.deletes()}) == ["pp-trainer-0", "pp-trainer-1"]
        # Graceful: no grace override, so the pod's own 30 s (SIGTERM, checkpoint, exit) applies.
        assert all("gracePeriodSeconds" not in params for _, params in kubelet.deletes())
        assert kube.core.read_namespaced_pod("pp-trainer-0", NS).spec.termination_grace_period_seconds == 30
        status = wait_for(lambda: (s := kube.job_status(NS, "pp")).get("resplitVersion") == version and s,
                          what="resplitVersion")
        assert run_config_of(kube, "pp", tmp_path).stage_layers == [3, 1], "the split is in the ConfigMap"
        replaced = [d for d in status["decisions"] if d["action"] == "replace"]
        assert len(replaced) == 2 and all("remediation S3: restart on stage layers [3, 1]" in d["reason"]
                                          for d in replaced)
        # The old pods are still checkpointing: no successor yet, the job says why.
        cond = wait_for(lambda: (c := kube.condition(NS, "pp", "Reconciling")).get("reason") == "Draining"
                        and c, what="Draining")
        assert "waiting for 2 trainer pods to checkpoint and exit" in cond["message"]
        assert kube.job_status(NS, "pp")["phase"] == "Remediating"
        assert trainers(kube, "pp") == ["pp-trainer-0", "pp-trainer-1"]
        wait_for(lambda: kube.has_event(NS, "pp", "Resplit", contains="[3, 1]"), what="the Resplit event")

        # They exit: the successors start on the new split, on the GPUs just freed.
        kubelet.release(["pp-trainer-0", "pp-trainer-1"])
        wait_for(lambda: trainers(kube, "pp") == ["pp-trainer-0-g1", "pp-trainer-1-g1"], what="successors")
        kube.run_all_pods(NS, "pp")
        wait_for(lambda: kube.job_status(NS, "pp").get("phase") == "Running", what="Running again")
        assert run_config_of(kube, "pp", tmp_path).stage_layers == [3, 1]

        # Once per decision: more reconciles (a pod event, a spec change the gang follows live)
        # roll nothing again, the restart budget is untouched, and the spec change keeps the split.
        kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                                   "pp", {"spec": {"priority": 61}})
        wait_for(lambda: run_config_of(kube, "pp", tmp_path).spec.priority == 61, what="spec rewritten")
        kube.set_pod_phase(NS, "pp-trainer-0-g1", "Running")
        assert run_config_of(kube, "pp", tmp_path).stage_layers == [3, 1]
        status = kube.job_status(NS, "pp")
        assert [d["action"] for d in status["decisions"]].count("replace") == 2
        assert status["resplitReplacements"] == 2
        assert trainers(kube, "pp") == ["pp-trainer-0-g1", "pp-trainer-1-g1"]

        # A real failure afterwards is still replaced: the roll's two replacements did not spend
        # the budget of one (spec.remediation.maxRestarts: 1).
        kube.set_pod_phase(NS, "pp-trainer-1-g1", "Failed", exit_code=1)
        wait_for(lambda: "pp-trainer-1-g2" in trainers(kube, "pp"), what="failure replacement")
        assert kube.job_status(NS, "pp")["phase"] != "Failed"


def test_a_restarted_operator_finishes_a_roll_it_decided(
        cluster: EmulatedCluster, kube: builders.Kube, tmp_path: Path) -> None:
    """The decision (replacements and resplitVersion) is in status before any pod is touched;
    an operator stopped with the old pods still draining finishes the roll, exactly once."""
    assert cluster.kmock is not None
    kubelet = Kubelet(kube, cluster.kmock, NS)
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        kube.create_job(NS, make_job("pp"))
        wait_for(lambda: len(trainers(kube, "pp")) == 2, what="2 trainer pods")
        kube.run_all_pods(NS, "pp")
        kubelet.hold(trainers(kube, "pp"))
        wait_for(lambda: kube.job_status(NS, "pp").get("phase") == "Running", what="Running")
        version = decide_s3(kube, "pp", [1, 3], "remediation S3 (resplit): stage 0 is slow")
        wait_for(lambda: kube.job_status(NS, "pp").get("resplitVersion") == version, what="decided")
        wait_for(lambda: len(kubelet.deletes()) >= 2, what="deletes sent")
    # No operator: the old pods finish checkpointing and go.
    kubelet.release(["pp-trainer-0", "pp-trainer-1"])
    with operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST):
        wait_for(lambda: trainers(kube, "pp") == ["pp-trainer-0-g1", "pp-trainer-1-g1"], what="successors")
        kube.run_all_pods(NS, "pp")
        wait_for(lambda: kube.job_status(NS, "pp").get("phase") == "Running", what="Running again")
        assert run_config_of(kube, "pp", tmp_path).stage_layers == [1, 3]
    status = kube.job_status(NS, "pp")
    assert [d["action"] for d in status["decisions"]].count("replace") == 2
    assert status["resplitVersion"] == version


class PipelineRanks:
    """2 pods × 2 local ranks, as torchrun starts them: rank = 2 × replica + local rank, local
    rank r serving on port + r of its pod's IP, stage = rank % 2 (the runtime's layout)."""

    def __init__(self, job: str) -> None:
        self.all: list[runtime_telemetry.Telemetry] = []
        for _ in range(20):  # find a port whose successor is free on both addresses too
            try:
                self.port = self._serve(job)
                return
            except OSError:
                self.close()
        raise AssertionError("no two consecutive free ports on 127.0.0.2 and 127.0.0.3")

    def _serve(self, job: str) -> int:
        port = 0
        for replica_index, (replica, ip) in enumerate(PIPELINE_IPS.items()):
            for local in range(2):
                t = runtime_telemetry.Telemetry(job, 2 * replica_index + local, 4, replica)
                self.all.append(t)
                bound = t.serve(ip, port + local if port else 0)
                port = port or bound
        return port

    def record(self, steps: int, compute_by_stage: list[float], split: list[int]) -> None:
        for t in self.all:
            t.set_parameter("pipeline", {"stages": 2, "stage_layers": split})
            compute = compute_by_stage[t.rank % 2]
            for step in range(1, steps + 1):
                t.record_step(step, compute + 0.1, 0.1, 2.0, 1000.0, None)

    def close(self) -> None:
        for t in self.all:
            t.close()
        self.all = []


def test_every_local_rank_is_polled_so_s3_sees_every_stage() -> None:
    """The operator reads each rank of a pod (port + local rank): with stages inside a pod, the
    pods' first ranks are all stage 0, and S3's view of the stages would never be complete."""
    ranks = PipelineRanks("pp")
    try:
        ranks.record(6, compute_by_stage=[0.2, 0.6], split=[2, 2])  # stage 1 is 3x slower per layer
        first_only = observe.fetch_snapshots(observe.build_targets(PIPELINE_IPS, ranks.port), 2.0)
        assert {s["rank"] for s in first_only.values()} == {0, 2}
        assert policy.build_pipeline_shape(first_only) is None
        every = observe.fetch_snapshots(observe.build_targets(PIPELINE_IPS, ranks.port, 2), 2.0)
        assert sorted(every) == ["trainer-0", "trainer-0/1", "trainer-1", "trainer-1/1"]
        assert {s["rank"] for s in every.values()} == {0, 1, 2, 3}
        shape = policy.build_pipeline_shape(every)
        assert shape is not None and shape.stage_speeds == pytest.approx([1.0, 1 / 3])
        obs = observe.build_observation(1.0, every, after_step=0, gpus_per_replica=2)
        assert obs.steps[-1]["step"] == 6 and obs.steps[-1]["world_size"] == 2
    finally:
        ranks.close()


def run_pipeline_pods(kube: builders.Kube, job: str, names: list[str], rolled: bool = False) -> None:
    """Pods Running with their pod's telemetry address, as the kubelet reports them; then the job
    Running, or (`rolled`) already past it: its first monitor tick may see the whole slowdown in
    the telemetry and roll the gang before a 0.1 s poll catches the Running in between (missed
    once in a full run on a loaded host)."""
    wait_for(lambda: trainers(kube, job) == names, what=f"trainer pods {names}")
    for pod in kube.pods(NS, job):
        ordinal = pod.metadata.labels["huorn.io/instance"].split("-")[1]
        ip = PIPELINE_IPS.get(f"trainer-{ordinal}", "127.0.0.9")
        status = {"status": {"phase": "Running", "podIP": ip}}
        kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, status)

    def settled() -> bool:
        status = kube.job_status(NS, job)
        resplit = any(d["action"] == "set-param" and "stage layers" in d["reason"]
                      for d in status.get("decisions") or [])
        return status.get("phase") == "Running" or (rolled and resplit)

    wait_for(settled, what="Running" + (" or rolled" if rolled else ""))


def test_s3_from_pipeline_telemetry_to_a_rolled_gang(cluster: EmulatedCluster, kube: builders.Kube,
                                                      tmp_path: Path) -> None:
    """End to end in a cluster: the ranks' telemetry (rank 3, stage 1 of the second pod, turns
    slow) → fail-slow S1 → S3 in the operator's monitor → `set-param stageLayers` → the split in
    the ConfigMap and the gang rolled onto it, once."""
    ranks = PipelineRanks("pp")
    rng = random.Random(7)
    try:
        settings = dataclasses.replace(operator_mod.FAST, monitor_seconds=0.3, telemetry_port=ranks.port,
                                       telemetry_timeout_seconds=1.0, progress_seconds=0.5)
        # Every rank's steps are there before the pods run, so the first poll sees all of them: a
        # poll between ranks would read rank 0's 50 steps and rank 3's first few, and no later
        # step would come to show rank 3's slowdown (seen once in a full run on two workers).
        for t in ranks.all:
            t.set_parameter("pipeline", {"stages": 2, "stage_layers": [2, 2]})
            for step in range(1, 51):
                seconds = (30.0 if t.rank == 3 and step >= 25 else 1.0) + rng.uniform(-0.02, 0.02)
                t.record_step(step, seconds, 0.1, 2.0, 1000.0, None)
        with operator_mod.OperatorThread(cluster.api_client(), settings):
            body = builders.make_training_job("pp", "train", replicas=2, max_replicas=2, gpus=2,
                                              parallelism={"pipelineStages": 2}, model={"layers": 4},
                                              remediation={"maxMitigation": "resplit"})
            kube.create_job(NS, body)
            run_pipeline_pods(kube, "pp", ["pp-trainer-0", "pp-trainer-1"], rolled=True)
            run_pipeline_pods(kube, "pp", ["pp-trainer-0-g1", "pp-trainer-1-g1"])
            assert run_config_of(kube, "pp", tmp_path).stage_layers == [3, 1], "stage 1 keeps one layer"
            status = kube.job_status(NS, "pp")
            settings_made = [d["reason"] for d in status["decisions"] if d["action"] == "set-param"]
            assert any(r.startswith("remediation S3 (resplit-stages)") and "stage layers [3, 1]" in r
                       for r in settings_made)
            assert [d["action"] for d in status["decisions"]].count("replace") == 2
            assert status["resplitVersion"] > 0
            wait_for(lambda: kube.has_event(NS, "pp", "Resplit"), what="the Resplit event")
            # The successors run (on the same addresses, resuming at step 51) and are polled; the
            # ticks over their telemetry decide nothing new.
            version = status["graph"]["version"]
            for t in ranks.all:
                t.set_parameter("pipeline", {"stages": 2, "stage_layers": [3, 1]})
                t.record_step(51, 1.0, 0.1, 1.9, 1000.0, None)
            wait_for(lambda: kube.job_status(NS, "pp").get("step") == 51, what="progress from the new pods")
            assert kube.job_status(NS, "pp")["graph"]["version"] == version
            assert trainers(kube, "pp") == ["pp-trainer-0-g1", "pp-trainer-1-g1"]
    finally:
        ranks.close()
