"""What every handler shares: the API client, the cluster mirror, metrics, locks and settings.

It travels in kopf's memo, so handlers stay plain functions of (context, body) that tests can
also call directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.api import common
from huorn.backends.kubernetes import client as kube
from huorn.backends.kubernetes import manifests, retry
from huorn.operator import index, metrics, queue
from huorn.operator.leadership import Leadership

EventPoster = Callable[[Mapping[str, Any], str, str, str], None]
WAKE_LIMIT = 8  # waiting jobs woken at once, first in line first


@dataclass(frozen=True)
class OperatorSettings:
    """Tunables; the defaults suit a real cluster, tests shorten the intervals."""

    resync_seconds: float = 30.0  # a timer re-reconciles every job: retries placement, repairs drift
    vc_status_seconds: float = 10.0
    error_backoff_seconds: float = 5.0  # kopf retries a handler that raised after this long
    # False: list every Huorn pod from the API before each reconcile instead of trusting the
    # watch-fed mirror; the stateless design that benchmarks/operator_scale.py compares against.
    mirror: bool = True
    # The mirror's pods are listed again this often, and records the watch never updated are
    # dropped: a pod deleted between the start-up list and the watch's own first list (or in the
    # gap of a watch that expired and was listed again) has no DELETED event, and would otherwise
    # hold its GPUs in the mirror for ever.
    mirror_resync_seconds: float = 60.0
    # Other controllers' pods (the GPUs they hold, index.ClusterIndex.foreign) are listed again
    # this often, for the same reason; listing every pod of the cluster costs more than listing
    # Huorn's, so less often.
    foreign_resync_seconds: float = 600.0
    api_threads: int = 32  # API calls in flight at once
    monitor_seconds: float = 5.0  # how often each running job's pods are polled for telemetry
    telemetry_port: int = 9400  # the runtime's /telemetry port in every trainer pod
    telemetry_timeout_seconds: float = 2.0
    # status.step/loss/tokensPerSecond/lastCheckpoint are written at most this often per job (a
    # new checkpoint is written at once): 1,000 running jobs cost ≤ 34 status writes a second
    progress_seconds: float = 30.0
    # An eval pod still Pending this long after its creation (unschedulable, image not pulled) is
    # reported failed: one eval runs at a time, so a pod that never starts would stall every
    # later eval and hold the job's Succeeded forever.
    eval_start_seconds: float = 600.0
    # A trainer pod still Pending this long after its creation is replaced like a failed one (the
    # job's replacement budget), and the job fails naming why once the budget is spent: Kueue's
    # waitForPodsReady. Until then its GPUs count as taken and the gang cannot train.
    trainer_start_seconds: float = 600.0
    # Kubernetes Job's pod failure back-off: the first failed pod is replaced at once, each further
    # one within 10 minutes waits this long after the previous replacement, doubling up to the
    # cap (huorn.operator.failures.replacement_backoff); 0 replaces every failure at once.
    replacement_backoff_seconds: float = 10.0
    replacement_backoff_max_seconds: float = 360.0
    forecast_timeout_seconds: float = 5.0  # one Prometheus range query of an inference cluster's board
    # How often each InferenceJob's ready replicas are scraped and its autoscaler consulted (the
    # HorizontalPodAutoscaler's default period), the port their /metrics are on, and its timeout.
    autoscale_seconds: float = 15.0
    serve_port: int = 8000
    serve_timeout_seconds: float = 2.0
    # The image of a job's pods when its spec names none (huorn.operator.images); the Helm chart
    # passes its own image, so a registry mirror serves the jobs too.
    job_image: str = common.DEFAULT_JOB_IMAGE
    retry: retry.RetryPolicy = field(default_factory=retry.RetryPolicy)

    def __post_init__(self) -> None:
        if self.resync_seconds <= 0 or self.vc_status_seconds <= 0 or self.mirror_resync_seconds <= 0:
            raise ValueError("resync_seconds, vc_status_seconds and mirror_resync_seconds must be > 0")
        if not self.foreign_resync_seconds > 0:
            raise ValueError(f"foreign_resync_seconds must be > 0, got {self.foreign_resync_seconds}")
        if self.monitor_seconds <= 0 or self.telemetry_timeout_seconds <= 0 or self.progress_seconds <= 0:
            raise ValueError("monitor_seconds, telemetry_timeout_seconds and progress_seconds must be > 0")
        if self.forecast_timeout_seconds <= 0:
            raise ValueError(f"forecast_timeout_seconds must be > 0, got {self.forecast_timeout_seconds}")
        if self.eval_start_seconds <= 0 or self.trainer_start_seconds <= 0:
            raise ValueError(f"eval_start_seconds and trainer_start_seconds must be > 0, got "
                             f"{self.eval_start_seconds} and {self.trainer_start_seconds}")
        if not 0 <= self.replacement_backoff_seconds <= self.replacement_backoff_max_seconds:
            raise ValueError("replacement_backoff_seconds must be in 0..replacement_backoff_max_seconds "
                             f"({self.replacement_backoff_max_seconds}), got "
                             f"{self.replacement_backoff_seconds}")
        if self.autoscale_seconds <= 0 or self.serve_timeout_seconds <= 0:
            raise ValueError(f"autoscale_seconds and serve_timeout_seconds must be > 0, got "
                             f"{self.autoscale_seconds} and {self.serve_timeout_seconds}")
        if not self.job_image or any(c.isspace() for c in self.job_image):
            raise ValueError(f"job_image must be an image reference without spaces, got {self.job_image!r}")
        if not 0 < self.serve_port < 65536:
            raise ValueError(f"serve_port must be in 1..65535, got {self.serve_port}")
        if not 0 < self.telemetry_port < 65536:
            raise ValueError(f"telemetry_port must be in 1..65535, got {self.telemetry_port}")


@dataclass
class Context:
    client: kube.KubeClient
    post_event: EventPoster
    settings: OperatorSettings = field(default_factory=OperatorSettings)
    connection: Any = None  # kopf.ConnectionInfo for kopf's own watches; same server as `client`
    index: index.ClusterIndex = field(default_factory=index.ClusterIndex)
    metrics: metrics.OperatorMetrics = field(default_factory=metrics.OperatorMetrics)
    placement_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _job_locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    # The monitor's per-job policies (detector history, learned perf model). Memory only: a
    # restarted operator relearns them, and every decision they took is already in status.
    monitors: dict[tuple[str, str], Any] = field(default_factory=dict)
    # The goodput allocator every monitor's decision comes from (huorn.operator.allocation), by
    # the node size it predicts spans with; its tables are a cache of the monitors' models.
    allocators: dict[int, Any] = field(default_factory=dict)
    # Each inference cluster's prediction board (huorn.operator.board.BoardState). Memory only:
    # its history is Prometheus's, read again at the first tick.
    boards: dict[str, Any] = field(default_factory=dict)
    # The order of admission, and the preemptions a reconcile decided for its handler to apply
    # (huorn.scheduler.preemption.Plan, who for, and its kind) once the deciding job's lock is
    # released.
    queue: queue.AdmissionQueue = field(default_factory=queue.AdmissionQueue)
    preemptions: dict[tuple[str, str], tuple[Any, str, str]] = field(default_factory=dict)
    # Reconcile a job soon, from a task of its own (the handlers set it): a waiting job that can go
    # first, or that GPUs just freed for, should not wait for its resync timer.
    wake: Callable[[str, str], None] = field(default=lambda namespace, name: None)
    # The same, `seconds` from now: a deadline or a TTL that falls due before the resync timer.
    wake_later: Callable[[str, str, float], None] = field(default=lambda namespace, name, seconds: None)
    # The same for an InferenceJob; and the InferenceJobs with replicas waiting for GPUs, by
    # their virtual cluster: GPUs freed there wake them before the training line.
    wake_serving: Callable[[str, str], None] = field(default=lambda namespace, name: None)
    serving_waiting: dict[tuple[str, str], str] = field(default_factory=dict)
    # And what each waits for: (virtual cluster, GPUs of one replica, replicas unplaced), which a
    # lender's reclaim fits node by node (huorn.operator.loans.node_shortfall).
    # (vc, GPUs a replica, replicas, the job's nodeSelector)
    serving_unplaced: dict[tuple[str, str], tuple[str, int, int, Mapping[str, str] | None]] = field(
        default_factory=dict)
    # Each InferenceJob's autoscaler (huorn.operator.autoscaling.ScalerState). Memory only: a
    # restarted operator keeps the replicas in status until its window has filled again.
    autoscalers: dict[tuple[str, str], Any] = field(default_factory=dict)
    # When each RLJob's progress was last written to status (huorn.operator.rljobs.tick).
    rl_progress: dict[tuple[str, str], float] = field(default_factory=dict)
    # RLJobs waiting for GPUs of their virtual cluster, woken like waiting InferenceJobs, and
    # the wakers that reconcile an RLJob (now, or `seconds` from now: a restart's back-off).
    rl_waiting: dict[tuple[str, str], str] = field(default_factory=dict)
    wake_rl: Callable[[str, str], None] = field(default=lambda namespace, name: None)
    wake_rl_later: Callable[[str, str, float], None] = field(default=lambda namespace, name, seconds: None)
    # The last ReclaimBlocked message of each lender (huorn.operator.loans): posted once per
    # change, not at every tick (360 identical Events an hour for as long as a borrower ran).
    reclaim_blocked: dict[str, str] = field(default_factory=dict)

    # Set when peering: the background work kopf does not pause asks it first (None: standalone).
    leadership: Leadership | None = None

    # The namespaces this operator serves (`--namespace`); empty: all of them. The mirror still
    # holds every namespace's Huorn pods, since they take GPUs on the same nodes.
    namespaces: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.index.served = self.namespaces

    def serve_only(self, namespaces: Iterable[str]) -> None:
        """Serve these namespaces (none: all), and lend only what this install can reclaim
        (index.ClusterIndex.serves_all_of)."""
        self.namespaces = self.index.served = frozenset(namespaces)

    def serves(self, namespace: str) -> bool:
        return not self.namespaces or namespace in self.namespaces

    async def leads(self) -> bool:
        """Whether this operator may act outside kopf's handlers: always when standalone. The
        answer is also `huorn_leader`, read every mirror resync at least (handlers._resync_mirror)."""
        leads = self.leadership is None or await self.leadership.leads(self.client)
        self.metrics.leader.set(1 if leads else 0)
        return leads

    async def apply_all(self, writes: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Write independent objects concurrently (a gang of 64 pods is one round trip deep). If
        one fails, the pods created beside it go into the mirror before the error is raised: the
        caller then releases its placement's reservations, and the GPUs of pods that exist must
        not look free until the watch reports them."""
        results = await asyncio.gather(*(self.client.apply(w) for w in writes), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        for wrote, obj in zip(writes, results, strict=True):
            if not (isinstance(obj, dict) and obj.get("kind", "Pod") == "Pod"):
                continue
            # A pod that existed already (a create met 409) comes back as it runs, on its own node,
            # where this placement's reservation says another: it goes into the mirror now, unless
            # the watch has reported it (newer). Created ones wait for the watch, as the
            # reservation stands for them until then; on a failed batch they go in too.
            meta = obj.get("metadata") or {}
            elsewhere = _node_of(obj) != _node_of(wrote)
            if (failed or elsewhere) and (meta.get("namespace"), meta.get("name")) not in self.index.pods:
                self.index.observe_pod(obj)
        if failed:
            raise failed[0]
        return [r for r in results if isinstance(r, dict)]

    def job_lock(self, namespace: str, name: str) -> asyncio.Lock:
        """One reconcile of a job at a time, whether kopf, a timer or a pod event started it."""
        return self._job_locks.setdefault((namespace, name), asyncio.Lock())

    def wake_line(self, virtual_cluster: str | None = None) -> None:
        """GPUs were freed, or the line moved: its first jobs (of one VirtualCluster, or of all)
        try to place now rather than at their resync."""
        for key, vc in list(self.serving_waiting.items()):
            if virtual_cluster in (None, vc):
                self.wake_serving(*key)
        for key, vc in list(self.rl_waiting.items()):
            if virtual_cluster in (None, vc):
                self.wake_rl(*key)
        waiting = [j for j in self.queue.waiting() if virtual_cluster in (None, j.virtual_cluster)]
        for job in waiting[:WAKE_LIMIT]:
            self.wake_queued(job)

    def wake_queued(self, job: queue.QueuedJob) -> None:
        """Reconcile a job of the line soon, by its kind (the line holds RLJobs too)."""
        (self.wake_rl if job.kind == "RLJob" else self.wake)(*job.key)

    def forget_job(self, namespace: str, name: str) -> None:
        self._job_locks.pop((namespace, name), None)
        self.monitors.pop((namespace, name), None)
        for decider in self.allocators.values():  # its goodput tables (huorn.operator.allocation)
            decider.forget_job(f"{namespace}/{name}")
            decider.forget_job(f"{namespace}/{name}#ranked")  # allocation.ranked_name's
        self.queue.forget(namespace, name)
        self.preemptions.pop((namespace, name), None)
        self.serving_waiting.pop((namespace, name), None)
        self.serving_unplaced.pop((namespace, name), None)
        self.autoscalers.pop((namespace, name), None)
        self.rl_progress.pop((namespace, name), None)
        self.rl_waiting.pop((namespace, name), None)


def _node_of(pod: Mapping[str, Any]) -> str:
    """The node a pod was placed on, as the operator annotates it."""
    return str(((pod.get("metadata") or {}).get("annotations") or {}).get(manifests.ANNOTATION_NODE, ""))
