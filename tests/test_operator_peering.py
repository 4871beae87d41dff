"""High availability through kopf peering, against the emulator: one of two operators acts.

kopf peering is leader election, not sharding: both operators announce themselves in the
ClusterKopfPeering object, the one with the highest priority handles resources and the other
pauses. When the leader stops, it withdraws from the peering object and the standby resumes,
picking the job up from its status alone.
"""

from __future__ import annotations

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
    standby = OperatorThread(cluster.api_client(), peering="huorn", priority=1)
    with standby, OperatorThread(cluster.api_client(), peering="huorn", priority=100) as leader:
        peers = wait_for(
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
        assert peers
        time.sleep(1.0)  # let the standby see the leader's higher priority and pause
        kube.create_job(NS, builders.make_training_job("ha", "train", replicas=1, gpus=1))
        wait_for(lambda: len(kube.pods(NS, "ha", "trainer")) == 1, what="the leader placed the job")
        kube.run_all_pods(NS, "ha")
        wait_for(lambda: kube.job_status(NS, "ha").get("phase") == "Running", what="Running")
        wait_for(lambda: _reconciles(leader) >= 1, what="the leader's reconcile to finish")
        assert _reconciles(standby) == 0, "the paused standby must not act"
    # The leader has stopped (and withdrawn); only the standby is left, and it was stopped too by
    # the `with`. Start it again alone, as a restarted replica would be, and scale the job.
    with OperatorThread(cluster.api_client(), peering="huorn", priority=1) as survivor:
        kube.scale(NS, "ha", 2)
        wait_for(lambda: len(kube.pods(NS, "ha", "trainer")) == 2, what="the survivor resized")
        wait_for(lambda: _reconciles(survivor) >= 1, what="the survivor's reconcile to finish")
    decisions = [d["action"] for d in kube.job_status(NS, "ha")["decisions"]]
    assert decisions == ["resize"]
