"""High availability through kopf peering, against the emulator: one of two operators acts.

kopf peering is leader election, not sharding: both operators announce themselves in the
ClusterKopfPeering object, the one with the highest priority handles resources and the other
pauses. When the leader stops, it withdraws from the peering object and the standby resumes,
picking the job up from its status alone.

Both operators start as the Helm chart starts its replicas: with the same flags and no
`--priority`. kopf pauses every peer of the highest priority when several share it, so had they
shared a default, neither would act.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from kube import builders
from kube.cluster import EmulatedCluster, wait_for
from kube.operator import OperatorThread

pytest_plugins = ["kube.fixtures"]

NS = "team"


def _reconciles(op: OperatorThread) -> float:
    return op.ctx.metrics.value("huorn_reconcile_total", {"kind": "TrainingJob", "result": "ok"})


@pytest.mark.slow
def test_only_the_leader_acts_and_the_standby_takes_over(
    cluster: EmulatedCluster, kube: builders.Kube
) -> None:
    kube.custom.create_cluster_custom_object(
        "kopf.dev",
        "v1",
        "clusterkopfpeerings",
        {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": "huorn"}},
    )
    first = OperatorThread(cluster.api_client(), peering="huorn")
    with first, OperatorThread(cluster.api_client(), peering="huorn") as second:
        wait_for(
            lambda: (
                len(
                    kube.custom.get_cluster_custom_object(
                        "kopf.dev", "v1", "clusterkopfpeerings", "huorn"
                    ).get("status")
                    or {}
                )
                == 2
            ),
            what="both operators announced",
        )
        status = kube.custom.get_cluster_custom_object("kopf.dev", "v1", "clusterkopfpeerings", "huorn")
        priorities = [peer["priority"] for peer in status["status"].values()]
        assert len(set(priorities)) == 2 and min(priorities) > 0, priorities
        time.sleep(1.0)  # let the lower priority see the higher one and pause
        kube.create_job(NS, builders.make_training_job("ha", "train", replicas=1, gpus=1))
        wait_for(lambda: len(kube.pods(NS, "ha", "trainer")) == 1, what="the leader placed the job")
        kube.run_all_pods(NS, "ha")
        wait_for(lambda: kube.job_status(NS, "ha").get("phase") == "Running", what="Running")
        wait_for(lambda: _reconciles(first) + _reconciles(second) >= 1, what="the leader's reconcile")
        time.sleep(1.0)  # a standby that wrongly acted would have reconciled by now too
        acted = [op for op in (first, second) if _reconciles(op) >= 1]
        assert len(acted) == 1, "exactly one operator acts; the paused standby must not"
        # What the work kopf does not pause (the mirror resync, woken reconciles) asks first.
        standby = second if acted[0] is first else first
        assert asyncio.run(acted[0].ctx.leads()) and not asyncio.run(standby.ctx.leads())
        # and so says huorn_leader, which the chart's alerts read the other gauges through
        leader = [op.ctx.metrics.value("huorn_leader") for op in (acted[0], standby)]
        assert leader == [1, 0]
    # The leader has stopped (and withdrawn); only the standby is left, and it was stopped too by
    # the `with`. Start it again alone, as a restarted replica would be, and scale the job.
    with OperatorThread(cluster.api_client(), peering="huorn") as survivor:
        kube.scale(NS, "ha", 2)
        wait_for(lambda: len(kube.pods(NS, "ha", "trainer")) == 2, what="the survivor resized")
        wait_for(lambda: _reconciles(survivor) >= 1, what="the survivor's reconcile to finish")
    decisions = [d["action"] for d in kube.job_status(NS, "ha")["decisions"]]
    assert decisions == ["resize"]
