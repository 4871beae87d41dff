"""The order in which TrainingJobs and RLJobs get GPUs, and who a waiting job of higher priority
may stop (a running TrainingJob or RLJob).

Each job's reconcile places its own gang, so without an order the GPUs that one job frees go to
whichever reconcile runs next, not to the job that has waited longest or matters most. The queue
gives Kueue's BestEffortFIFO order within each VirtualCluster: higher priority first, then the
older job. A job that would place now steps back when one ahead of it in its VirtualCluster is
waiting and fits in the free GPUs (that one goes first, and is woken to do so); a job ahead that
does not fit blocks nobody. A waiting job that does not fit may preempt running gangs of lower
priority (`huorn.scheduler.preemption`).

Memory, like the mirror, and rebuilt the same way: at start, from a listing of the jobs, before
any handler runs (`from_job`: a job whose status says it waits, Unplaceable or Queued, is in line
with the replicas its graph has no pod for). Without that, the first job a restarted operator
happened to reconcile could take GPUs that a preemption had freed for another. Every reconcile
then records its job again. A job not seen yet is never a victim (its priority is unknown).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from huorn.operator.index import PodRecord, parse_time
from huorn.scheduler import placement, preemption
from huorn.scheduler.allocator import JobView
from huorn.scheduler.snapshot import ClusterSnapshot


@dataclass(frozen=True)
class QueuedJob:
    namespace: str
    name: str
    virtual_cluster: str
    priority: int
    created: float  # metadata.creationTimestamp, seconds since the epoch
    gpus: int  # per replica
    missing: int = 0  # replicas it could not place at its last reconcile; 0: not waiting
    min_replicas: int = 1
    elastic: bool = False  # elasticity.policy goodput: it may be shrunk to min_replicas
    # An RLJob is recorded too (huorn.operator.rljobs): a gang that others may stop, and, while
    # its Ray workers wait, a job in line like any other, placed on its own nodes only.
    kind: str = "TrainingJob"
    borrows: bool = True  # False: it never takes GPUs from other virtual clusters
    # its spec's: placed on such nodes only (left out of the hash, which a dict would break)
    node_selector: Mapping[str, str] | None = field(default=None, hash=False)
    # How the goodput allocator ranks it while no arbitration hands it over (allocation.rank_view);
    # None for a job that competes for no GPUs by goodput.
    ranked: JobView | None = field(default=None, hash=False, compare=False)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def binding(self) -> str:
        """Its key in the operator's ClusterSnapshot (index.build_snapshot)."""
        return f"{self.namespace}/{self.name}"

    def goes_before(self, other: QueuedJob) -> bool:
        return (-self.priority, self.created, self.key) < (-other.priority, other.created, other.key)


WAITING_REASONS = frozenset({"Unplaceable", "Queued"})
GANG_VERTICES = frozenset({"trainer", "ray-worker"})  # the pods that hold a gang's GPUs, by kind


def build_entry(job: Any, meta: Mapping[str, Any], missing: int = 0) -> QueuedJob:
    """A job's entry from its validated model and its metadata. A kind without elasticity (an
    RLJob) is a fixed gang of at least one replica here; its caller sets its own bounds."""
    spec = job.spec
    elasticity = getattr(spec, "elasticity", None)
    min_replicas = elasticity.min_replicas if elasticity is not None else 1
    elastic = elasticity is not None and elasticity.policy.value == "goodput"
    return QueuedJob(str(meta.get("namespace", "")), str(meta.get("name", "")), spec.virtual_cluster,
                     spec.priority, parse_time(meta.get("creationTimestamp")), spec.resources.gpus, missing,
                     min_replicas, elastic, node_selector=getattr(spec, "node_selector", None))


def from_job(job: Any, body: Mapping[str, Any], pods: Iterable[PodRecord]) -> QueuedJob:
    """A job's entry as its API object shows it (`job`: its validated model): in line with the
    trainer replicas that have no pod when its Reconciling condition says it waits, and only
    while fewer than its minimum run, as the reconcile puts it in line. A running job that waits
    only to grow is not in line: before, a restarted operator counted its growth as a waiting
    gang, and jobs behind it stepped back for it until its first reconcile."""
    status = body.get("status") or {}
    missing = 0
    reconciling = next((c for c in status.get("conditions") or [] if c.get("type") == "Reconciling"), {})
    graph = status.get("graph") or {}
    if reconciling.get("status") == "True" and reconciling.get("reason") in WAITING_REASONS:
        # A gang never placed has no graph in status yet: it starts at minReplicas.
        trainer = next((v for v in graph.get("vertices") or [] if v.get("name") == "trainer"), {})
        replicas = int(trainer.get("replicas", job.spec.elasticity.min_replicas))
        minimum = int(trainer.get("minReplicas", job.spec.elasticity.min_replicas))
        present = sum(1 for p in pods if p.vertex == "trainer" and p.holds_resources and not p.deleting)
        missing = max(0, replicas - present) if present < minimum else 0
    return build_entry(job, body.get("metadata") or {}, missing)


@dataclass
class AdmissionQueue:
    jobs: dict[tuple[str, str], QueuedJob] = field(default_factory=dict)

    def record(self, job: QueuedJob) -> None:
        self.jobs[job.key] = job

    def forget(self, namespace: str, name: str) -> None:
        self.jobs.pop((namespace, name), None)

    def waiting(self) -> list[QueuedJob]:
        """Jobs whose gang could not be placed, first in line first."""
        out = [j for j in self.jobs.values() if j.missing]
        return sorted(out, key=lambda j: (-j.priority, j.created, j.key))

    def first_ahead_that_fits(self, job: QueuedJob, snap: ClusterSnapshot,
                              growth: bool = False) -> QueuedJob | None:
        """The first waiting job of `job`'s VirtualCluster ahead of it that could be placed now;
        with `growth` (replicas beyond `job`'s minimum), every waiting job is ahead of it."""
        for other in self.waiting():
            if other.key == job.key or other.virtual_cluster != job.virtual_cluster:
                continue
            if not growth and not other.goes_before(job):
                break
            where = snap.place(other.virtual_cluster, other.missing, other.gpus, borrow=other.borrows,
                               node_selector=other.node_selector)
            if isinstance(where, placement.Placement):
                return other
        return None

    def candidates(self, pods: Iterable[PodRecord], nodes: Container[str] | None = None
                   ) -> tuple[list[preemption.Candidate], list[str]]:
        """Running gangs as preemption sees them, and the jobs already stopping (every pod that
        holds GPUs is being deleted), by snapshot binding key.

        `nodes`: the only nodes where freed GPUs help (a waiting job's nodeSelector): a gang with
        no replica there is no candidate, and an elastic one offers only its replicas there as
        surplus, as many as it has above its minimum counted over all of them. Counted from its
        replicas on those nodes alone, a gang of 4 at minimum 2 with two there had no surplus,
        and was stopped whole where a shrink by two would do."""
        held: dict[tuple[str, str], list[PodRecord]] = {}
        for p in pods:
            if p.gpus and p.holds_resources:
                held.setdefault(p.job_key, []).append(p)
        candidates, stopping = [], []
        for key, mine in held.items():
            binding = f"{key[0]}/{key[1]}"
            if all(p.deleting for p in mine):
                stopping.append(binding)
                continue
            known = self.jobs.get(key)
            if known is None:
                continue
            live = sorted((p for p in mine if not p.deleting and p.vertex in GANG_VERTICES),
                          key=lambda p: (p.created, p.instance), reverse=True)
            started = max((p.created for p in live), default=0.0)
            spare = max(0, len(live) - known.min_replicas) if known.elastic else 0
            useful = [p for p in live if nodes is None or p.node in nodes]
            if nodes is not None and not any(p.node in nodes for p in mine if not p.deleting):
                continue
            surplus = tuple((p.instance, p.node, p.gpus) for p in useful[:spare])
            candidates.append(preemption.Candidate(binding, known.priority, started, surplus))
        return candidates, stopping
