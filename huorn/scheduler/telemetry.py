"""Turn the runtime's step log into what the scheduler learns from: perf samples and noise scale.

The runtime (huorn/runtime) appends one JSON object per event to `steps.jsonl`: `start` (with the
gang's world size and global batch), then `step` lines with `step_seconds`, the step's
`global_batch` and, when it has enough history, `gradient_noise_scale`; an in-place resize logs
`regroup` with the new gang's world size and global batch, and no `start`. The scheduler may not
import the runtime (the layers point the other way), so this module reads the plain dicts. One
sample per configuration, its median step time: a median shrugs off the first steps after a
restart (compilation, cold caches) and a noisy neighbour, which a mean would fold into the curve.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from huorn.scheduler import allocator, perfmodel


def replicas_of(ranks: int, ranks_per_replica: int) -> int:
    """The replicas (pods, or local agents) of a gang of `ranks`: the step log's `world_size`
    counts ranks, the allocator hands out replicas. The control plane's twin of the runtime's
    batching.replicas_in, which the import layers keep out of its reach."""
    return max(1, ranks // max(1, ranks_per_replica))


def samples_from_step_events(events: Iterable[dict], nodes: int = 1, skip_first: int = 2,
                             ranks_per_replica: int = 1, micro_batch: int | None = None
                             ) -> list[perfmodel.Sample]:
    """Median step time per (replicas, local batch) seen in the log; `nodes` the gang spanned.

    The log's `world_size` counts the gang's ranks and a sample counts replicas, the unit the
    allocator hands out, so it is divided by `ranks_per_replica`: the pipeline stages of a local
    replica, the GPUs of a pod (as backends.local.backend.replica_record and
    backends.kubernetes.observe.build_observation do). Read as replicas, a 2-stage job's log was
    learned at twice its replicas and half their local batch.

    A step's batch is its own `global_batch`, else the last `start`'s or `regroup`'s: under
    batchRule scale-with-replicas it grows with the gang, and read from the `start` alone the
    steps after an in-place resize counted the old gang's batch over the new world. The first
    `skip_first` steps after either are left out (warm-up, a new process group).

    `micro_batch`: the unit a replica's share of a step comes in (microBatch × its data-parallel
    ranks, allocator.JobView.micro_batch). The step waits for the replica with the most whole
    micro-batches, so a sample's local batch is that replica's (allocator.slowest_local_batch), the
    batch the allocator prices and the goodput policies learn at; 13 replicas of 512 in
    micro-batches of 8 ran 40 samples each, not 39.4. None: the even split M / replicas."""
    per_config: dict[tuple[int, float], list[float]] = {}
    global_batch: float | None = None
    since_start = 0
    for event in events:
        kind = event.get("event")
        if kind in ("start", "regroup") and event.get("global_batch") is not None:
            global_batch = float(event["global_batch"])
            since_start = 0
        elif kind == "step" and (global_batch is not None or event.get("global_batch") is not None):
            since_start += 1
            if since_start <= skip_first or not event.get("step_seconds"):
                continue
            world = replicas_of(int(event["world_size"]), ranks_per_replica)
            local = float(event.get("global_batch") or global_batch or 0) / world
            if micro_batch is not None:
                local = float(allocator.slowest_local_batch(local, micro_batch))
            per_config.setdefault((world, local), []).append(float(event["step_seconds"]))
    return [perfmodel.Sample(world, min(nodes, world), local, statistics.median(times))
            for (world, local), times in sorted(per_config.items())]


def noise_scale_from_step_events(events: Iterable[dict], window: int = 10) -> float | None:
    """Mean of the last `window` gradient noise scales the runtime reported; None before any."""
    values = [float(e["gradient_noise_scale"]) for e in events
              if e.get("event") == "step" and e.get("gradient_noise_scale") is not None]
    return statistics.fmean(values[-window:]) if values else None
