"""Remediation S2 in a cluster: a `microbatches` set-param in the job's graph reaches the running
pods through their ConfigMap volume (real kopf against KMock), once, and survives reconciles;
the trainer reads its counts from that volume (`controlDir`)."""

from __future__ import annotations

import json
from pathlib import Path

from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for

from huorn.backends.kubernetes import manifests
from huorn.graph import mutate, serialise
from huorn.operator import training
from huorn.runtime import batch_control, microbatches

pytest_plugins = ["kube.fixtures"]

NS = "team"


def config_map(kube: builders.Kube, job: str) -> object:
    ref = manifests.JobRef.from_body(kube.get_job(NS, job))
    return kube.core.read_namespaced_config_map(manifests.config_map_name(ref), NS)


def decide_s2(kube: builders.Kube, job: str, counts: list[int], why: str) -> int:
    """What the monitor writes for an S2 decision: the set-param in the graph, in status."""
    g = serialise.from_status(kube.job_status(NS, job)["graph"])
    m = mutate.set_param(g, "trainer", "microbatches", counts, reason=why)
    assert m is not None
    kube.custom.patch_namespaced_custom_object_status(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", job,
        {"status": {"graph": serialise.to_status(g), "decisions": training.build_decisions(g)}})
    return m.version


def start(cluster: EmulatedCluster) -> operator_mod.OperatorThread:
    return operator_mod.OperatorThread(cluster.api_client(), operator_mod.FAST)


def test_s2_counts_reach_the_config_map_once_and_survive_reconciles(cluster, kube: builders.Kube) -> None:
    with start(cluster):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=2, max_replicas=2, gpus=2))
        wait_for(lambda: len(kube.pods(NS, "llm", "trainer")) == 2, what="2 trainer pods")
        kube.run_all_pods(NS, "llm")
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Running", what="Running")
        run_config = json.loads(config_map(kube, "llm").data[manifests.CONFIG_FILE])
        assert run_config["controlDir"] == manifests.CONFIG_DIR
        assert manifests.MICROBATCHES_KEY not in config_map(kube, "llm").data

        version = decide_s2(kube, "llm", [5, 3], "remediation S2: rank 1 is 1.7× slower")
        delivered = wait_for(lambda: (config_map(kube, "llm").data or {}).get(manifests.MICROBATCHES_KEY),
                             what="the counts in the ConfigMap")
        assert json.loads(delivered) == {"counts": [5, 3], "version": version,
                                         "reason": "remediation S2: rank 1 is 1.7× slower"}
        wait_for(lambda: kube.job_status(NS, "llm").get("controlVersion") == version, what="controlVersion")
        stamp = config_map(kube, "llm").metadata.resource_version

        # Another reconcile (a pod event) keeps the counts in the graph and writes nothing again.
        kube.set_pod_phase(NS, "llm-trainer-0", "Running")
        kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                                   "llm", {"metadata": {"annotations": {"poke": "1"}}})
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Running", what="still Running")
        graph = kube.job_status(NS, "llm")["graph"]
        trainer = next(v for v in graph["vertices"] if v["name"] == "trainer")
        assert trainer["params"]["microbatches"] == [5, 3]
        assert config_map(kube, "llm").metadata.resource_version == stamp

        # A new decision replaces the counts; a spec change rewrites the config but keeps them.
        newer = decide_s2(kube, "llm", [4, 4], "remediation S2: the slow rank recovered")
        wait_for(lambda: json.loads(config_map(kube, "llm").data[manifests.MICROBATCHES_KEY])["counts"]
                 == [4, 4], what="the new counts")
        wait_for(lambda: kube.job_status(NS, "llm").get("controlVersion") == newer, what="new controlVersion")
        kube.custom.patch_namespaced_custom_object(builders.GROUP, builders.VERSION, NS, "trainingjobs",
                                                   "llm", {"spec": {"env": [{"name": "X", "value": "1"}]}})
        wait_for(lambda: "X" in config_map(kube, "llm").data[manifests.CONFIG_FILE], what="spec rewritten")
        assert json.loads(config_map(kube, "llm").data[manifests.MICROBATCHES_KEY])["counts"] == [4, 4]


def test_the_config_map_key_is_the_trainers_control_file(tmp_path: Path) -> None:
    """The operator writes the key the trainer reads, in the format it reads."""
    assert manifests.MICROBATCHES_KEY == microbatches.CONTROL_FILE
    ref = manifests.JobRef(kind="TrainingJob", name="llm", namespace=NS, uid="u1")
    control = manifests.MicroBatchControl((5, 3), "S2", 7)
    data = manifests.build_config_map(ref, {}, control)["data"]
    (tmp_path / manifests.MICROBATCHES_KEY).write_text(data[manifests.MICROBATCHES_KEY])
    plan, stamp = microbatches.read_control_file(tmp_path)
    assert plan == microbatches.MicroBatchPlan((5, 3), "S2", 7) and stamp > 0


def test_the_goodput_batch_reaches_the_config_map_beside_the_counts(cluster, kube: builders.Kube) -> None:
    """batchRule goodput: the monitor's `batch` set-param reaches the pods as the ConfigMap's
    batch.json, with S2's counts kept beside it, and status.controlVersion follows the newer."""
    assert manifests.BATCH_KEY == batch_control.CONTROL_FILE
    with start(cluster):
        kube.create_job(NS, builders.make_training_job("llm", "train", replicas=2, max_replicas=2, gpus=2))
        wait_for(lambda: len(kube.pods(NS, "llm", "trainer")) == 2, what="2 trainer pods")
        kube.run_all_pods(NS, "llm")
        wait_for(lambda: kube.job_status(NS, "llm").get("phase") == "Running", what="Running")
        counts = decide_s2(kube, "llm", [5, 3], "remediation S2: rank 1 is 1.7× slower")
        wait_for(lambda: kube.job_status(NS, "llm").get("controlVersion") == counts, what="the counts")
        g = serialise.from_status(kube.job_status(NS, "llm")["graph"])
        m = mutate.set_param(g, "trainer", "batch", 64, reason="goodput allocator: 16 -> 64", stamp=True)
        assert m is not None
        kube.custom.patch_namespaced_custom_object_status(
            builders.GROUP, builders.VERSION, NS, "trainingjobs", "llm",
            {"status": {"graph": serialise.to_status(g), "decisions": training.build_decisions(g)}})
        delivered = wait_for(lambda: (config_map(kube, "llm").data or {}).get(manifests.BATCH_KEY),
                             what="the batch in the ConfigMap")
        assert json.loads(delivered) == {"globalBatch": 64, "reason": "goodput allocator: 16 -> 64",
                                         "version": m.version}
        wait_for(lambda: kube.job_status(NS, "llm").get("controlVersion") == m.version, what="controlVersion")
        assert json.loads(config_map(kube, "llm").data[manifests.MICROBATCHES_KEY])["counts"] == [5, 3]
        names = [p.metadata.name for p in kube.pods(NS, "llm", "trainer")]
        assert names == ["llm-trainer-0", "llm-trainer-1"]  # no pod replaced for it
