"""A restarted operator takes up the S2 plan it finds in the job's graph: real kopf against KMock,
real `/telemetry` servers from the runtime's own code (tests/kube/ranks.py).

Before, the new operator's ladder started at rest. The trainers kept the counts a slowdown had
called for, and once the slow rank recovered nothing gave the even split back: a balanced step
time shows a fresh detector no change point, so the recovered rank idled for the rest of the job.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator

import pytest
from kube import builders
from kube import operator as operator_mod
from kube.cluster import EmulatedCluster, wait_for
from kube.ranks import IPS, Ranks

from huorn.graph import mutate, serialise
from huorn.operator import training

pytest_plugins = ["kube.fixtures"]

NS = "team"
MICROBATCH_SECONDS = 0.1  # both ranks healthy again


@pytest.fixture()
def ranks() -> Iterator[Ranks]:
    r = Ranks("llm")
    yield r
    r.close()


def start_operator(cluster: EmulatedCluster, port: int) -> operator_mod.OperatorThread:
    settings = dataclasses.replace(operator_mod.FAST, monitor_seconds=0.3, telemetry_port=port,
                                   telemetry_timeout_seconds=1.0)
    return operator_mod.OperatorThread(cluster.api_client(), settings)


def run_with_ips(kube: builders.Kube, name: str) -> None:
    wait_for(lambda: len(kube.pods(NS, name, "trainer")) == 2, what="2 trainer pods")
    for pod in kube.pods(NS, name):
        instance = pod.metadata.labels["huorn.io/instance"]
        kube.core.patch_namespaced_pod_status(pod.metadata.name, NS, {
            "status": {"phase": "Running", "podIP": IPS.get(instance, "127.0.0.9")}})
    wait_for(lambda: kube.job_status(NS, name).get("phase") == "Running", what="phase Running")


def train(ranks: Ranks, counts: list[int], stop: threading.Event) -> None:
    """The two ranks' steps as the trainer records them, 20 at a time: rank r computes counts[r]
    micro-batches of MICROBATCH_SECONDS each and waits for the slower one in the all-reduce."""
    step = 0
    while not stop.is_set():
        for _ in range(20):
            step += 1
            seconds = max(counts) * MICROBATCH_SECONDS
            for rank, t in enumerate(ranks.by_replica.values()):
                t.set_parameter("micro_batches", {"total": sum(counts), "mine": counts[rank]})
                compute = counts[rank] * MICROBATCH_SECONDS
                t.record_step(step, seconds, seconds - compute, loss=2.0, tokens_per_second=1000.0,
                              noise_scale=None, microbatch_seconds=MICROBATCH_SECONDS)
        stop.wait(0.2)


def trainer_counts(kube: builders.Kube) -> object:
    graph = serialise.from_status(kube.job_status(NS, "llm")["graph"])
    return graph.vertex("trainer").params.get("microbatches")


def test_a_restarted_operator_gives_back_the_even_split_it_finds_in_force(
        cluster, kube: builders.Kube, ranks: Ranks) -> None:
    with start_operator(cluster, ranks.port):
        kube.create_job(NS, builders.make_training_job(
            "llm", "train", replicas=2, max_replicas=2, gpus=1,
            remediation={"maxMitigation": "rebalance"}))
        run_with_ips(kube, "llm")
    # what the previous operator left, once rank 1 had been slow: S2's counts in the graph
    g = serialise.from_status(kube.job_status(NS, "llm")["graph"])
    reason = "remediation S2 (rebalance-microbatches): lost 31.0s since observe"
    decided = {"level": "rebalance", "action": "rebalance-microbatches", "ranks": [1],
               "plan": {"microbatches": [7, 1]}}
    mutate.set_param(g, "trainer", "mitigation", decided, reason=reason)
    mutate.set_param(g, "trainer", "microbatches", [7, 1], reason=reason)
    kube.custom.patch_namespaced_custom_object_status(
        builders.GROUP, builders.VERSION, NS, "trainingjobs", "llm",
        {"status": {"graph": serialise.to_status(g), "decisions": training.build_decisions(g)}})
    assert trainer_counts(kube) == [7, 1]
    stop = threading.Event()
    # rank 1 recovered: both ranks compute a micro-batch in 0.1 s, and [7, 1] costs 0.7 s a step
    # against [4, 4]'s 0.4 s, so 100 steps on the plan pay S2's 30 s cost of re-planning
    steps = threading.Thread(target=train, args=(ranks, [7, 1], stop), daemon=True)
    with start_operator(cluster, ranks.port):
        steps.start()
        try:
            wait_for(lambda: trainer_counts(kube) == [4, 4], what="the even split back", timeout=60)
        finally:
            stop.set()
            steps.join()
    restored = [d for d in kube.job_status(NS, "llm")["decisions"] if "restore-even" in d["reason"]]
    assert restored and "the fail-slow is over" in restored[-1]["reason"], restored
