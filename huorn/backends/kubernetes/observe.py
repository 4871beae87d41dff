"""The Kubernetes side of the shared monitor loop: pod telemetry in, an Observation out.

The local backend reads its ranks' `/telemetry` through the endpoint files on disk; in a cluster
the same JSON is read over HTTP from each trainer pod's IP (the runtime binds 0.0.0.0 on
`manifests.TELEMETRY_PORT`). The HTTP polls run before the job's lock is taken, and the monitor
tick itself then runs against `ObservedBackend`, which hands the prefetched observation to
`Monitor.tick` and records the graph it is asked to apply. Applying is the operator's: it writes
the graph into status first (write-ahead) and then reconciles pods, exactly like a spec change,
so a decision of the monitor and one of a user take the same path.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.backends import fetch, monitor
from huorn.graph import model
from huorn.scheduler import telemetry


def fetch_snapshot(url: str, timeout: float) -> dict[str, Any] | None:
    """One rank's `/telemetry`; None when the pod does not answer (starting, gone, partitioned).

    NB: a pod that does not answer is not a hang by itself: the hang detector judges sequence
    numbers of the ranks that do answer, and a pod that died is the restart rules' to handle.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            data = json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def fetch_snapshots(targets: Mapping[str, str], timeout: float) -> dict[str, dict[str, Any]]:
    """Every target (replica → URL) at once, so one slow pod costs one timeout, not one each."""
    return fetch.fetch_all(targets, fetch_snapshot, timeout)


def build_targets(pod_ips: Mapping[str, str], port: int, ranks_per_pod: int = 1) -> dict[str, str]:
    """One URL per rank: the runtime serves local rank r on `port + r`. Every rank, not only the
    pod's first: S2's shape needs each rank's seconds per micro-batch and S3's each pipeline
    stage's (a pod's local ranks are different stages), and a hung rank may be any of them.
    Local rank 0 is keyed by the replica's name, the others `<replica>/<local rank>`."""
    targets = {}
    for replica, ip in sorted(pod_ips.items()):
        if not ip:
            continue
        for local in range(max(1, ranks_per_pod)):
            key = replica if local == 0 else f"{replica}/{local}"
            targets[key] = f"http://{ip}:{port + local}/telemetry"
    return targets


def build_observation(
    now: float, snapshots: Mapping[str, dict[str, Any]], after_step: int, gpus_per_replica: int
) -> monitor.Observation:
    """An Observation whose `steps` are the lowest rank's step records newer than `after_step`.

    Every rank logs the same global steps, so one rank's history is the job's; the lowest rank
    answers most often (rank 0 is the checkpoint writer). `world_size` in a step record is the
    replica count, the unit the goodput allocator hands out, so the gang's ranks are divided by
    the GPUs of one pod: the ranks of the gang that took the step, which the record carries (the
    telemetry's buffer outlives an in-place resize, and the snapshot's world then put the steps
    before it at the new size), else the snapshot's (a trainer from before records kept it).
    """
    steps: list[dict[str, Any]] = []
    if snapshots:
        first = min(snapshots.values(), key=lambda s: int(s.get("rank", 1 << 30)))
        for record in first.get("steps") or []:
            if int(record.get("step", -1)) > after_step:
                ranks = int(record.get("world_size") or first.get("world_size") or 1)
                steps.append({**record, "world_size": telemetry.replicas_of(ranks, gpus_per_replica)})
    return monitor.Observation(time=now, telemetry=dict(snapshots), steps=steps)


@dataclass
class ObservedBackend:
    """A `monitor.Backend` for one tick: observe returns what was fetched, apply records the graph."""

    observation: monitor.Observation
    applied: list[model.Graph] = field(default_factory=list)

    def observe(self) -> monitor.Observation:
        return self.observation

    def apply(self, graph: model.Graph) -> list[str]:
        self.applied.append(graph)
        return [f"graph version {graph.version} recorded for the operator to apply"]
