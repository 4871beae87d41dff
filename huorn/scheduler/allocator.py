"""Joint choice of replicas and batch size for every elastic job, to maximise cluster goodput.

The objective is Pollux's: the sum over jobs of speedup = goodput(a) / goodput(min replicas), so
that a job's claim on an extra GPU is what that GPU adds to its own progress, comparable across
jobs of any size. One cycle runs in two passes against a ClusterSnapshot:

1. Minimums, by priority: every job, highest priority first, gets its minimum replicas while GPUs
   last. Within one priority, running jobs come before pending ones (no job is preempted for an
   equal), and pending ones in submission order. Running jobs of priority ≥ 100 are pinned at
   their current size: never shrunk, never preempted (the KAI convention the API documents).
2. Extras, greedily: the next GPUs go to the job whose goodput table gains the most speedup per
   GPU, jumping as far as the best jump (the tables are not concave when one more replica crosses
   a node boundary). Greedy marginal allocation is optimal for concave speedups, which data
   parallelism nearly is, and costs O(jobs · log jobs) per GPU instead of Pollux's genetic search.

Flapping is priced, not forbidden: any size other than a running job's current one is discounted
by the restart it costs (restart seconds over the planning horizon) plus a hysteresis margin, and
inside a cooldown after its last resize a job may not reverse it: no regrowth after a shrink, and
no shrink after a growth unless the minimums pass forces it.

Budgets come from the snapshot with every managed job lifted off: each virtual cluster's own free
GPUs, plus what it may borrow (its borrowing limit, and what lenders still lend). The counts are
then placed gang by gang, all-or-none, stepping a job down when fragmentation leaves no room.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import numpy as np

from huorn.scheduler import goodput, perfmodel, placement, snapshot

PINNED_PRIORITY = 100


@dataclass
class JobView:
    """What the allocator needs to know about one job; the operator and the simulator fill it."""

    name: str
    virtual_cluster: str
    perf: perfmodel.PerfModel | None = None  # None: no model (the job runs at min replicas)
    gpus_per_replica: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    priority: int = 50
    replicas: int = 0  # running now; 0 means pending
    noise_scale: float = 0.0
    base_batch: float = 32.0
    max_local_batch: float = 256.0
    restart_seconds: float = 60.0
    last_resize: float = -math.inf
    last_direction: int = 0  # +1 the last resize grew the job, -1 it shrank it
    submitted: float = 0.0
    model_version: int = 0  # bump when perf or noise_scale change, so cached tables are rebuilt

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"job {self.name}: need 1 ≤ min_replicas ≤ max_replicas, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        if self.gpus_per_replica < 1:
            raise ValueError(f"job {self.name}: gpus_per_replica must be ≥ 1")


@dataclass(frozen=True)
class AllocatorConfig:
    horizon_seconds: float = 1800.0  # how long a decision is expected to stand
    hysteresis: float = 0.05  # a resize must win at least this much more than its restart costs
    cooldown_seconds: float = 300.0
    gpus_per_node: int = 8  # to predict nodes spanned before placement
    elastic: bool = True  # False: every job runs at exactly min replicas (no goodput search)


@dataclass(frozen=True)
class Decision:
    job: str
    action: str  # admit | grow | shrink | preempt | keep | pending
    replicas: int
    previous_replicas: int
    global_batch: float | None = None
    local_batch: float | None = None
    lr_scale: float | None = None
    assignments: list[str] = field(default_factory=list)
    reason: str = ""


@dataclass
class _Table:
    """A job's speedup per replica count, and the batch that earns it.

    The batch choices are built only for the sizes a decision reports: a cycle rebuilds hundreds
    of tables but reports a handful of sizes, and building all of them cost more than the search.
    """

    speedup: np.ndarray  # index a = replicas; [0] = 0
    local: np.ndarray | None = None  # best local batch per replica count (index a - 1)
    throughput: np.ndarray | None = None
    eff: np.ndarray | None = None
    good: np.ndarray | None = None  # goodput before normalisation, index a
    ok: np.ndarray | None = None
    noise_scale: float = 0.0
    base_batch: float = 1.0

    def choice(self, replicas: int) -> goodput.BatchChoice | None:
        if self.local is None or self.ok is None or not 0 < replicas < len(self.speedup):
            return None
        i = replicas - 1
        if not self.ok[i]:
            return None
        m = float(self.local[i] * replicas)
        assert self.throughput is not None and self.eff is not None and self.good is not None
        # goodput.adascale_gain in scalar arithmetic (same operations): a cycle reports every job.
        gain = m / self.base_batch * ((self.noise_scale + self.base_batch) / (self.noise_scale + m))
        return goodput.BatchChoice(m, float(self.local[i]), float(self.throughput[i]), float(self.eff[i]),
                                   float(self.good[replicas]), float(gain))

    @property
    def choices(self) -> list[goodput.BatchChoice | None]:
        return [self.choice(a) for a in range(len(self.speedup))]


class Allocator:
    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self._tables: dict[str, tuple[int, _Table]] = {}

    # ------------------------------------------------------------------ goodput tables
    def table(self, job: JobView) -> _Table:
        cached = self._tables.get(job.name)
        if cached is not None and cached[0] == job.model_version:
            return cached[1]
        table = self._build_table(job)
        self._tables[job.name] = (job.model_version, table)
        return table

    def forget_job(self, job: str) -> None:
        self._tables.pop(job, None)

    def _build_table(self, job: JobView) -> _Table:
        top = job.max_replicas if self.config.elastic else job.min_replicas
        good = np.zeros(top + 1)
        if job.perf is None:
            good[job.min_replicas:] = 1.0
            return _Table(good)
        # Every replica count and every candidate local batch in one vectorised model call.
        per_node = max(1, self.config.gpus_per_node // job.gpus_per_replica)
        reps = np.arange(1, top + 1, dtype=float)
        low = np.maximum(1.0, job.base_batch / reps)
        local = low[:, None] * 2.0 ** np.arange(12)[None, :]
        local = np.minimum(local, job.max_local_batch)
        ok = low[:, None] <= job.max_local_batch
        r2 = np.broadcast_to(reps[:, None], local.shape)
        nodes = np.ceil(r2 / per_node)
        thr = job.perf.predict_many(r2, nodes, local)
        eff = goodput.efficiency(job.noise_scale, job.base_batch, local * r2)
        gp = np.where(ok, thr * eff, 0.0)
        best = np.argmax(gp, axis=1)
        rows = np.arange(top)
        fits = ok[:, 0]
        good[1:] = np.where(fits, gp[rows, best], 0.0)
        ref = good[job.min_replicas] or max(good.max(), 1e-12)
        return _Table(good / ref, local[rows, best], thr[rows, best], eff[rows, best], good, fits,
                      job.noise_scale, job.base_batch)

    # ------------------------------------------------------------------ the cycle
    def allocate(self, snap: snapshot.ClusterSnapshot, jobs: list[JobView], now: float) -> list[Decision]:
        """Decide every job's replicas and batch, and bind the result on `snap`."""
        by_name = {j.name: j for j in jobs}
        if len(by_name) != len(jobs):
            raise ValueError("jobs: two jobs share a name; job names must be unique")
        bound = snap.bindings()
        own, lend, borrow = self._budgets(snap, [j for j in jobs if j.name in bound])
        target = {j.name: 0 for j in jobs}
        values = {j.name: self._values(j, now) for j in jobs}

        def take(job: JobView, gpus: int, commit: bool) -> bool:
            vc = job.virtual_cluster
            from_own = min(gpus, own.get(vc, 0))
            rest = gpus - from_own
            lenders = [(v, lend[v]) for v in sorted(lend) if v != vc and lend[v] > 0]
            if rest > min(borrow.get(vc, 0), sum(x for _, x in lenders)):
                return False
            if commit:
                own[vc] = own.get(vc, 0) - from_own
                borrow[vc] = borrow.get(vc, 0) - rest
                for v, x in lenders:
                    used = min(x, rest)
                    lend[v] -= used
                    rest -= used
            return True

        # Pass 1: minimums by priority; pinned jobs first, running before pending within a priority.
        def rank(j: JobView) -> tuple:
            pinned = bool(j.replicas) and j.priority >= PINNED_PRIORITY
            return (not pinned, -j.priority, not j.replicas, j.submitted, j.name)

        order = sorted(jobs, key=rank)
        for job in order:
            floor = job.replicas if job.replicas and job.priority >= PINNED_PRIORITY else job.min_replicas
            if take(job, floor * job.gpus_per_replica, commit=True):
                target[job.name] = floor

        # Pass 2: extras, greedy on speedup per GPU.
        heap: list[tuple[float, str, int]] = []
        for job in jobs:
            self._push_best(heap, job, target[job.name], values[job.name])
        while heap:
            _, name, to = heapq.heappop(heap)
            job = by_name[name]
            if to <= target[name]:
                continue
            extra = (to - target[name]) * job.gpus_per_replica
            if take(job, extra, commit=True):
                target[name] = to
            else:
                values[name] = values[name][: to]  # that jump does not fit; try smaller ones
            self._push_best(heap, job, target[name], values[name])

        return self._place(snap, jobs, target, bound)

    def _values(self, job: JobView, now: float) -> np.ndarray:
        """Speedup per replica count, discounted for a restart where a size change needs one."""
        v = self.table(job).speedup.copy()
        if job.replicas:
            penalty = job.restart_seconds / self.config.horizon_seconds + self.config.hysteresis
            cur = min(job.replicas, len(v) - 1)
            keep = v[cur]
            v *= max(0.0, 1.0 - penalty)
            v[cur] = keep
            if now - job.last_resize < self.config.cooldown_seconds:
                # Flapping is a reversal: no regrowth right after a shrink, and no voluntary shrink
                # right after a growth (the minimums pass can still force one).
                if job.last_direction < 0:
                    v[cur + 1:] = 0.0
                elif job.last_direction > 0:
                    v[1:cur] = 0.0
        return v

    @staticmethod
    def _push_best(heap: list, job: JobView, at: int, values: np.ndarray) -> None:
        if at == 0 or at + 1 >= len(values):
            return
        steps = np.arange(at + 1, len(values))
        gains = (values[at + 1:] - values[at]) / ((steps - at) * job.gpus_per_replica)
        i = int(np.argmax(gains))
        if gains[i] > 1e-9:
            heapq.heappush(heap, (-float(gains[i]), job.name, int(steps[i])))

    @staticmethod
    def _budgets(snap: snapshot.ClusterSnapshot, running: list[JobView]
                 ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        with snap.simulate():
            for job in running:
                snap.forget(job.name)
            own = {v.name: snap.free(v.name) for v in snap.virtual_clusters()}
            own[""] = snap.free("")  # nodes outside any virtual cluster
            lend = {v.name: min(snap.lend_left(v.name), snap.free(v.name)) for v in snap.virtual_clusters()}
            borrow = {v.name: snap.borrow_left(v.name) for v in snap.virtual_clusters()}
        return own, lend, borrow

    def _place(self, snap: snapshot.ClusterSnapshot, jobs: list[JobView], target: dict[str, int],
               bound: dict[str, snapshot.Binding]) -> list[Decision]:
        decisions: list[Decision] = []
        # Release first what shrinks or stops, so the GPUs are there for the jobs that grow.
        for job in jobs:
            if job.name in bound and target[job.name] != job.replicas:
                snap.forget(job.name)
        # Keepers need no placement; then the rest by priority and size (big gangs first).
        changing = sorted((j for j in jobs if not (j.name in bound and target[j.name] == j.replicas)),
                          key=lambda j: (-j.priority, -target[j.name] * j.gpus_per_replica, j.submitted))
        for job in jobs:
            if job.name in bound and target[job.name] == job.replicas:
                decisions.append(self._decision(job, "keep", job.replicas, list(
                    _assignments(bound[job.name], job.gpus_per_replica)), "size unchanged"))
        for job in changing:
            want = target[job.name]
            placed: placement.Placement | None = None
            reason = ""
            for a in range(want, job.min_replicas - 1, -1) if want else []:
                where = snap.place(job.virtual_cluster, a, job.gpus_per_replica)
                if isinstance(where, placement.Placement):
                    snap.assume(job.name, job.virtual_cluster, where, job.gpus_per_replica)
                    placed, want = where, a
                    break
                reason = where.reason
            if placed is None:
                action = "preempt" if job.replicas else "pending"
                why = reason or self._why_zero(job)
                decisions.append(self._decision(job, action, 0, [], why))
                continue
            action = "admit" if not job.replicas else ("grow" if want > job.replicas else "shrink")
            speed = self.table(job).speedup
            why = (f"predicted speedup {speed[want]:.2f}× at {want} replicas "
                   f"vs {speed[job.min_replicas]:.2f}× at min {job.min_replicas}")
            decisions.append(self._decision(job, action, want, placed.assignments, why))
        return decisions

    def _why_zero(self, job: JobView) -> str:
        return (f"no GPUs left for its minimum of {job.min_replicas}×{job.gpus_per_replica} after jobs of "
                f"priority ≥ {job.priority} took theirs")

    def _decision(self, job: JobView, action: str, replicas: int, assignments: list[str], reason: str
                  ) -> Decision:
        choice = self.table(job).choice(replicas)
        return Decision(job.name, action, replicas, job.replicas,
                        choice.global_batch if choice else None, choice.local_batch if choice else None,
                        choice.lr_scale if choice else None, assignments, reason)


def _assignments(binding: snapshot.Binding, gpus_per_replica: int) -> list[str]:
    return [node for node, gpus in binding.gpus_by_node.items() for _ in range(gpus // gpus_per_replica)]
