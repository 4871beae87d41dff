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
then placed gang by gang, all-or-none. The table assumes perfect packing, and fragmentation makes
that wrong often enough to matter (a gang of 8 spread over 3 nodes can run slower than 6 on one),
so placement prices each candidate at the nodes it really spans, steps down while a smaller gang
would pack better, and keeps a running job where it is unless moving pays for its restart.

Pollux's fairness knob (`AllocatorConfig.fairness_p`): Pollux maximises the generalised power
mean of the speedups, FITNESS_p = (1/J Σ_j SPEEDUP_j^p)^(1/p). p = 1 (the default) is the sum
above; the paper evaluates Pollux at p = −1, which trades some total speedup for balance. The
greedy pass compares marginal changes of Σ u(SPEEDUP_j) with u(s) = s^p for p > 0, −s^p for p < 0
(lower Σ s^p is better there) and log s at p = 0, per GPU. Like Pollux's artifact simulator, a
small ε (1e-3) is added to every speedup before the power when p ≠ 1, so that a job at zero GPUs
is finite but costs 1/ε times a job at its minimum: no extra GPU is ever worth more than admitting
a job, which is what the minimums pass already does first. The paper's SPEEDUP is relative to an
equal 1/J share of the cluster, not to the job's minimum; `speedup_reference="fair_share"` uses it.

Optional JCT-aware terms (off by default, on for Huorn in the simulator) use each job's remaining
work, which a goodput-only objective ignores: a weight favouring jobs that finish sooner, a
restart charged over the remaining time, shortest-remaining-first admission, jobs a few restarts
from their end kept whole while others are admitted, and admission by value (a pending job's
first GPUs compete with running jobs' extras instead of coming before all of them), because
tearing running jobs down for every arrival paid restarts that the arrivals did not earn back.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import heapq
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from huorn.scheduler import goodput, perfmodel, placement, snapshot

PINNED_PRIORITY = 100
# What a resize of a running job costs, as a share of its restart time, when the runtime resizes
# in place (huorn.runtime.membership: the staying processes keep their state, only a joiner starts
# up, and it does so while the gang trains). The largest ratio of training time lost in place to
# that lost under Huorn's torchrun settings, measured for joins and graceful shrinks on CPU and on
# two H200s (docs/benchmarks.md, "Elastic recovery of the runtime"), rounded up. The simulator and
# the goodput policies of the local backend and the operator price resizes with it alike.
IN_PLACE_RESIZE_SHARE = 0.6


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
    # Work left, in base-batch samples (the spec's steps or tokens less the reported progress);
    # None when unknown. Only read when AllocatorConfig.jct_weight > 0.
    remaining_work: float | None = None
    # Its runtime resizes the gang without restarting it (one process per replica, resize mode
    # in place: huorn.graph.jobs.resizes_in_place), so a resize that keeps the staying replicas
    # where they run costs AllocatorConfig.in_place_share of restart_seconds, not all of it.
    resizes_in_place: bool = False
    # What the job's trainer does with its batch when its replicas change (BATCH_RULES): the
    # allocator prices every replica count at the batch the trainer will really run. Priced at the
    # best batch of a grid while the trainer kept its global batch, a job with a large noise scale
    # looked 7.2× faster at 8 replicas where it ran 1.4× (the batch was never delivered), and took
    # GPUs from jobs that would gain from them.
    batch_rule: str = "goodput"
    # A replica's share of micro-batches comes in units of this: the spec's microBatch times the
    # data-parallel ranks of one replica (a pod of 8 GPUs: 8). The runtime deals a step's
    # micro-batches round-robin over every rank and the step waits for the rank with the most,
    # ceil(M / microBatch / ranks) of them (docs/runtime.md, "What happens on a resize"): a
    # replica count that does not divide them runs no faster than the next one down that gives
    # the slowest rank as many. Priced at M / replicas, 15 replicas
    # of a 512 batch in micro-batches of 8 looked 7 % faster than 13, where they ran 1.5 % slower.
    # None: the batch is priced as if split evenly (the simulator's jobs).
    micro_batch: int | None = None
    # The labels its nodes must carry (the spec's nodeSelector): every gang of it is placed on
    # such nodes only, and it is offered no more replicas than they hold.
    node_selector: Mapping[str, str] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"job {self.name}: need 1 ≤ min_replicas ≤ max_replicas, got "
                             f"{self.min_replicas}..{self.max_replicas}")
        if self.gpus_per_replica < 1:
            raise ValueError(f"job {self.name}: gpus_per_replica must be ≥ 1")
        if self.batch_rule not in BATCH_RULES:
            raise ValueError(f"job {self.name}: batch_rule {self.batch_rule!r} is none of {BATCH_RULES}")
        if self.micro_batch is not None and self.micro_batch < 1:
            raise ValueError(f"job {self.name}: micro_batch must be ≥ 1 or None, got {self.micro_batch}")

    def throughput(self, replicas: np.ndarray, nodes: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Samples of the global batch (local × replicas) per second: its step takes as long as
        its slowest rank's share (slowest_local_batch), which is the model's configuration."""
        assert self.perf is not None
        if self.micro_batch is None:
            return self.perf.predict_many(replicas, nodes, local)
        slowest = slowest_local_batch(local, self.micro_batch)
        return self.perf.predict_many(replicas, nodes, slowest) * (local / slowest)

    def local_batches(self, replicas: np.ndarray) -> np.ndarray:
        """The local batches worth pricing at each replica count (one row each, smallest first):
        under `goodput` the global batch M0 split over the replicas, then doublings up to memory
        (goodput.candidate_local_batches' grid; the global batch never drops below M0); under
        `fixed-global` only M0 split, whatever the replicas (efficiency 1); under
        `scale-with-replicas` the batch each replica had at min_replicas (M0 / min_replicas, so
        the global batch grows with the gang, huorn.runtime.batching.plan_batch)."""
        replicas = np.asarray(replicas, dtype=float)
        low = np.maximum(1.0, self.base_batch / replicas)
        if self.batch_rule == "fixed-global":
            return low[:, None]
        if self.batch_rule == "scale-with-replicas":
            return np.full((len(replicas), 1), max(1.0, self.base_batch / self.min_replicas))
        return np.minimum(low[:, None] * 2.0 ** np.arange(12)[None, :], self.max_local_batch)


def slowest_local_batch(local: np.ndarray | float, micro_batch: int) -> np.ndarray:
    """The samples the slowest rank computes when a step's global batch is `local` a replica: its
    micro-batches are dealt round-robin, so one rank gets ceil(local / micro_batch) of them (at
    least one: a rank with none still runs a backward). The tolerance keeps a whole count whole
    when `local` is M / replicas in floating point."""
    per_rank = np.ceil(np.asarray(local, dtype=float) / micro_batch - 1e-9)
    return np.maximum(per_rank, 1.0) * micro_batch


def selected_slots(snap: snapshot.ClusterSnapshot, job: JobView, lend: Mapping[str, int] | None = None,
                   borrow: Mapping[str, int] | None = None) -> int:
    """The replicas of `job` that the nodes its node_selector admits can hold, in service and
    empty: its own cluster's, and what it may borrow of other clusters' (within its borrowing
    budget and each lender's, `borrow` and `lend` as Allocator._budgets gives them; the snapshot's
    when not given). A bound on its size, not a placement. Counted over every matching node, an
    H100 node of a cluster that lends nothing raised the bound past what the job could reach, and
    the greedy took GPUs from another job for replicas placement then cut."""
    gpr, vc = job.gpus_per_replica, job.virtual_cluster
    own = 0
    elsewhere: dict[str, int] = {}
    for view in snap.node_views():
        if view.cordoned or not placement.fits_selector(view, job.node_selector):
            continue
        if not vc or view.virtual_cluster == vc:
            own += view.gpus_total // gpr
        elif view.virtual_cluster:  # a node of no cluster lends nothing to one that has one
            # less what its cluster keeps there for its own waiting jobs (NodeView.kept)
            lendable = view.gpus_total - view.kept
            elsewhere[view.virtual_cluster] = elsewhere.get(view.virtual_cluster, 0) + lendable
    if not vc or not elsewhere:
        return own
    lend_left = lend if lend is not None else {name: snap.lend_left(name) for name in elsewhere}
    borrow_left = borrow.get(vc, 0) if borrow is not None else snap.borrow_left(vc)
    lendable = sum(min(lend_left.get(name, 0), gpus) for name, gpus in elsewhere.items())
    return own + min(borrow_left, lendable) // gpr


# The runtime's batch rules (huorn.api.training.BatchRule's values): `goodput`, the allocator
# chooses the batch (the simulator's jobs); the other two, the trainer's own rule.
BATCH_RULES = ("goodput", "fixed-global", "scale-with-replicas")


@dataclass(frozen=True)
class AllocatorConfig:
    horizon_seconds: float = 1800.0  # how long a decision is expected to stand
    hysteresis: float = 0.05  # a resize must win at least this much more than its restart costs
    cooldown_seconds: float = 300.0
    gpus_per_node: int = 8  # to predict nodes spanned before placement
    elastic: bool = True  # False: every job runs at exactly min replicas (no goodput search)
    # Price a gang at the nodes its placement really spans, not at perfect packing: a running job
    # is valued (and its batch chosen) at its own span, and a gang that would land on more nodes
    # than packing promised is compared with the smaller sizes that fit in fewer nodes.
    placement_aware: bool = True
    # 0: maximise the sum of speedups (Pollux). > 0: weigh each job's speedup so that GPUs go first
    # where they finish work soonest (heSRPT's rule for concave speedups: shorter jobs get larger
    # shares), by its rank or its remaining time (jct_weight_by).
    jct_weight: float = 0.0
    # "rank": a job's weight is its rank ** jct_weight, its rank the number of live jobs of its
    # virtual cluster (rank_among) whose remaining time at minimum size is at least its own
    # (itself included: 1 for the longest, J for the shortest of J). heSRPT's optimal shares for
    # speedups k^p give job i the weight ≈ i^p: the order of the remaining sizes sets them, not
    # their ratios. "remaining": (horizon / its remaining time at minimum size) ** jct_weight, 1
    # for a job whose length is unknown (docs/scheduling.md, "Allocator", items 10 and 11).
    jct_weight_by: str = "remaining"
    # The jobs a rank counts: "live", every live job of the virtual cluster (those handed to
    # `allocate` and its `also_ranked`), as heSRPT ranks every job in the system; "allocation",
    # those handed over alone (Huorn's weights before 2026-12-07's second change), which made the
    # weights depend on which pending jobs a caller left out (item 11).
    rank_among: str = "live"
    # Order of pending jobs in the minimums pass: "submitted" (FIFO) or "remaining" (shortest
    # remaining time first, SRPT without preemption: running jobs still come first).
    pending_order: str = "submitted"
    # Charge a restart over the shorter of the horizon and the job's own remaining time: a job that
    # will finish in two minutes does not pay back a one-minute restart, whatever it gains per second.
    restart_over_remaining: bool = False
    # Pollux's fairness exponent p: the greedy maximises the power mean (1/J Σ speedup^p)^(1/p).
    # 1 is the plain sum (Pollux's throughput-optimal setting, and this allocator's behaviour before
    # p existed); the Pollux paper evaluates p = -1, which gives the GPUs to the jobs furthest behind.
    fairness_p: float = 1.0
    # What a speedup of 1 means in the objective: "min", the job's goodput at its minimum size (this
    # allocator's own reference), or "fair_share", its goodput at an equal 1/J share of the GPUs it
    # may use, as the Pollux paper defines SPEEDUP. Jobs are weighed differently unless p = 0.
    speedup_reference: str = "min"
    # A running job that would finish within this many of its own restart times at its current size
    # keeps that size in the minimums pass, before pending jobs of its priority get theirs (0: off).
    # Tearing it down to admit others frees its GPUs only briefly before its completion would, and
    # costs it a restart and a slower finish. Needs remaining_work; Huorn only.
    protect_finishing_restarts: float = 0.0
    # How a pending job gets its minimum. "minimums": in the first pass, before any running job gets
    # an extra GPU (Pollux: admitting a job outweighs any growth). "value": a pending job that no
    # running job is below in priority competes in the greedy pass instead, its first step (0 → its
    # minimum) valued like any other step, so running jobs keep extras that are worth more than
    # starting it. A pending job of higher priority than some running job still gets its minimum
    # in the first pass, as before. Huorn only.
    admission: str = "minimums"
    # How a running job is resized. False: placed afresh at its new size (AdaptDL restarts the job
    # from a checkpoint on every reallocation, wherever it lands; the simulator charges a resize
    # that moved a staying replica a full restart). True: its replicas stay where they run, a grow
    # places only the new ones and a shrink removes some (those on a lender's nodes, then those
    # where the gang is thinnest), as the operator's reconcile kept a gang's pods until it learned
    # to move a resized gang to the allocator's placement (backends.goodput.repack). Measured on
    # 2026-12-06 (seed 0), True cost Huorn 8.4-9.6 % mean JCT and 33-40 % more restarts:
    # shrinks of one replica whose GPUs a fragmented cluster could not use, regrown a cycle later
    # (docs/scheduling.md, "Resizes that keep their replicas"). Off in HUORN.
    keep_replicas: bool = False
    # What a placement that resizes a running job in place is charged, as a share of its restart:
    # one whose staying replicas keep their nodes, of a job whose runtime resizes in place
    # (JobView.resizes_in_place; IN_PLACE_RESIZE_SHARE). A placement that moves a staying
    # replica, or a move at the same size, is a full restart. 1: every resize is priced as a
    # restart (Pollux: AdaptDL restarts on every reallocation).
    in_place_share: float = 1.0
    # Whether the greedy's values charge such a job the in-place share too. The greedy cannot know
    # where a resize will land; in the simulator, charged the cheaper price there, Huorn resized
    # more and lost mean JCT (docs/scheduling.md, "Allocator", item 9), so HUORN charges a full
    # restart. A local run and the operator do charge the in-place share (HUORN_RUNTIME): a short
    # job, such as the quickstart's 41 s of work, would never grow for a 20 s restart.
    greedy_in_place: bool = False
    # Whether a running job's resize is also placed around its replicas (Allocator._anchored) and
    # kept where, priced in place, it beats the gang placed afresh. Only matters with
    # in_place_share < 1; off, whether a resize keeps its replicas is the placement's tie-break.
    resize_around_replicas: bool = True

    def __post_init__(self) -> None:
        if self.pending_order not in ("submitted", "remaining"):
            raise ValueError(f"pending_order must be submitted or remaining, got {self.pending_order!r}")
        if self.speedup_reference not in ("min", "fair_share"):
            raise ValueError(f"speedup_reference must be min or fair_share, got {self.speedup_reference!r}")
        if self.jct_weight_by not in ("rank", "remaining"):
            raise ValueError(f"jct_weight_by must be rank or remaining, got {self.jct_weight_by!r}")
        if self.rank_among not in ("live", "allocation"):
            raise ValueError(f"rank_among must be live or allocation, got {self.rank_among!r}")
        if self.admission not in ("minimums", "value"):
            raise ValueError(f"admission must be minimums or value, got {self.admission!r}")
        if not self.protect_finishing_restarts >= 0:
            raise ValueError("protect_finishing_restarts must be ≥ 0, got "
                             f"{self.protect_finishing_restarts!r}")
        if not 0.0 <= self.in_place_share <= 1.0:
            raise ValueError(f"in_place_share must be within 0..1, got {self.in_place_share!r}")
        if not math.isfinite(self.fairness_p):
            raise ValueError(f"fairness_p must be finite, got {self.fairness_p!r}")


# Huorn's own settings: what the operator, the local backend and the simulator all run (the
# defaults above are the neutral, Pollux-like allocator the baselines build on). JCT-aware:
# speedups weighed by the job's rank by remaining time among its cluster's live jobs to the power
# 0.7 (heSRPT), restarts charged over the shorter of a one-hour horizon and the job's remaining
# time, pending jobs shortest first, jobs within sixteen restarts of finishing not shrunk to admit
# others, a pending job admitted when its first GPUs are worth more than a running job's extras,
# and a placement that resizes in place charged the in-place share of a restart, tried around the
# gang's replicas (docs/scheduling.md, "Allocator", items 9 to 11: the numbers chosen on seeds
# 0-9, with seeds 10-29 held out). The
# JCT terms need a job's remaining work (JobView.remaining_work); a job without it is weighed as
# one horizon from its end.
HUORN = AllocatorConfig(horizon_seconds=3600.0, jct_weight=0.7, jct_weight_by="rank",
                        restart_over_remaining=True, pending_order="remaining",
                        protect_finishing_restarts=16.0, admission="value",
                        in_place_share=IN_PLACE_RESIZE_SHARE)
# What a local run and the operator's goodput jobs run: HUORN, with the greedy charging a resize
# in place its in-place share too (greedy_in_place says why).
HUORN_RUNTIME = dataclasses.replace(HUORN, greedy_in_place=True)


@dataclass(frozen=True)
class Decision:
    job: str
    action: str  # admit | grow | shrink | move (same size, new nodes) | preempt | keep | pending
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


_AtSpan = tuple[float, goodput.BatchChoice | None]  # speedup and best batch at a real span


class Allocator:
    def __init__(self, config: AllocatorConfig | None = None):
        self.config = config or AllocatorConfig()
        self._tables: dict[str, tuple[int, _Table]] = {}
        # (model_version, {(replicas, nodes): (speedup, batch choice)}) per job, for real spans.
        self._spans: dict[str, tuple[int, dict[tuple[int, int], _AtSpan]]] = {}

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
        self._spans.pop(job, None)

    def ideal_nodes(self, job: JobView, replicas: int) -> int:
        """The nodes a gang spans when packed perfectly: what the goodput table assumes."""
        return math.ceil(replicas / max(1, self.config.gpus_per_node // job.gpus_per_replica))

    def at_span(self, job: JobView, replicas: int, nodes: int) -> tuple[float, goodput.BatchChoice | None]:
        """Speedup (on the table's scale) and best batch of `replicas` spread over `nodes` nodes."""
        table = self.table(job)
        packed = nodes == self.ideal_nodes(job, replicas)
        if job.perf is None or packed or not 0 < replicas < len(table.speedup):
            return (float(table.speedup[replicas]) if 0 <= replicas < len(table.speedup) else 0.0,
                    table.choice(replicas))
        cached = self._spans.get(job.name)
        if cached is None or cached[0] != job.model_version:
            cached = (job.model_version, {})
            self._spans[job.name] = cached
        hit = cached[1].get((replicas, nodes))
        if hit is not None:
            return hit
        if job.batch_rule == "goodput":
            local = goodput.candidate_local_batches(job.base_batch, replicas, job.max_local_batch)
        else:
            local = job.local_batches(np.array([replicas]))[0]
            local = local[local <= job.max_local_batch]
        if local.size == 0:
            result: _AtSpan = (0.0, None)
        else:
            thr = job.throughput(np.full(local.shape, float(replicas)), np.full(local.shape, float(nodes)),
                                 local)
            eff = goodput.efficiency(job.noise_scale, job.base_batch, local * replicas)
            i = int(np.argmax(thr * eff))
            m = float(local[i] * replicas)
            good = float(thr[i] * eff[i])
            ref = table.good[job.min_replicas] if table.good is not None else 0.0
            ref = ref or max(float(table.good.max()) if table.good is not None else 0.0, 1e-12)
            gain = goodput.adascale_gain(job.noise_scale, job.base_batch, m)
            choice = goodput.BatchChoice(m, float(local[i]), float(thr[i]), float(eff[i]), good, gain)
            result = (good / ref, choice)
        cached[1][(replicas, nodes)] = result
        return result

    def _build_table(self, job: JobView) -> _Table:
        top = job.max_replicas if self.config.elastic else job.min_replicas
        good = np.zeros(top + 1)
        if job.perf is None:
            good[job.min_replicas:] = 1.0
            return _Table(good)
        # Every replica count and every candidate local batch in one vectorised model call.
        per_node = max(1, self.config.gpus_per_node // job.gpus_per_replica)
        reps = np.arange(1, top + 1, dtype=float)
        local = job.local_batches(reps)
        # the smallest batch of a row, before the goodput grid's clip to memory
        smallest = np.maximum(1.0, job.base_batch / reps) if job.batch_rule == "goodput" else local[:, 0]
        ok = smallest[:, None] <= job.max_local_batch
        r2 = np.broadcast_to(reps[:, None], local.shape)
        nodes = np.ceil(r2 / per_node)
        thr = job.throughput(r2, nodes, local)
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
    def allocate(self, snap: snapshot.ClusterSnapshot, jobs: list[JobView], now: float,
                 cluster_jobs: int | None = None,
                 also_ranked: Mapping[str, Sequence[float]] | None = None) -> list[Decision]:
        """Decide every job's replicas and batch, and bind the result on `snap`.

        `cluster_jobs` is J, the number of jobs the fair share is split among when
        `speedup_reference` is "fair_share" (default: len(jobs)). A caller that leaves out pending
        jobs that cannot be admitted this cycle, as the simulator does for speed, passes the full
        count, so that the fair share is that of the real cluster.

        `also_ranked`: by virtual cluster, the remaining seconds (`remaining_seconds`) of its live
        jobs that are not in `jobs`, for the same reason. Rank weights (`jct_weight_by` "rank")
        count them: ranked over the jobs handed over alone, which pending jobs a caller left out
        moved the split among those that run (seeds 0-9: 22.11 % below the best Pollux ranked
        over what the simulator handed over, 21.12 % over the running jobs the operator handed).
        """
        by_name = {j.name: j for j in jobs}
        if len(by_name) != len(jobs):
            raise ValueError("jobs: two jobs share a name; job names must be unique")
        bound = snap.bindings()
        own, lend, borrow = self._budgets(snap, [j for j in jobs if j.name in bound])
        target = {j.name: 0 for j in jobs}
        share = cluster_jobs if cluster_jobs is not None else len(jobs)
        weights = self._jct_weights(jobs, also_ranked or {})
        values = {j.name: fitness_terms(self._values(j, now, bound, weights[j.name])
                                        / self._reference(j, share, own, lend, borrow),
                                        self.config.fairness_p) for j in jobs}
        for j in jobs:
            if j.node_selector:
                # no size beyond what its nodes hold: the GPUs would go unused this cycle
                values[j.name] = values[j.name][: selected_slots(snap, j, lend, borrow) + 1]

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
            if self.config.pending_order == "remaining" and not j.replicas:
                return (not pinned, -j.priority, True, self.remaining_seconds(j), j.submitted, j.name)
            return (not pinned, -j.priority, not j.replicas, 0.0, j.submitted, j.name)

        order = sorted(jobs, key=rank)
        lowest_running = min((j.priority for j in jobs if j.replicas), default=math.inf)
        by_value = {j.name for j in jobs if self.config.admission == "value" and not j.replicas
                    and j.priority <= lowest_running}  # admitted in pass 2, if worth the GPUs
        for _, group in itertools.groupby(order, key=lambda j: rank(j)[:2]):
            members = list(group)  # one priority level: running jobs first, then pending ones
            running = [j for j in members if j.replicas]
            for job in members:
                if not job.replicas:
                    # Jobs about to finish keep their size before the level's pending jobs get theirs.
                    for near in running:
                        if (target[near.name] and target[near.name] < near.replicas and self._finishing(near)
                                and take(near, (near.replicas - target[near.name]) * near.gpus_per_replica,
                                         commit=True)):
                            target[near.name] = near.replicas
                    running = []
                if job.name in by_value:
                    continue
                floor = job.replicas if job.replicas and job.priority >= PINNED_PRIORITY else job.min_replicas
                if take(job, floor * job.gpus_per_replica, commit=True):
                    target[job.name] = floor

        # Pass 2: extras, greedy on the fitness term (speedup at p = 1) gained per GPU.
        heap: list[tuple[float, str, int]] = []
        for job in jobs:
            self._push_best(heap, job, target[job.name], values[job.name], job.name in by_value)
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
            self._push_best(heap, job, target[name], values[name], name in by_value)

        # A running job that the greedy would shrink keeps the GPUs for its current size in
        # reserve if they are left over: placement may find the smaller gang spread so thin that
        # shrinking does not pay (the table prices every size at perfect packing).
        keepable: set[str] = set()
        if self.config.placement_aware:
            for job in jobs:
                t = target[job.name]
                if job.name in bound and 0 < t < job.replicas and take(
                        job, (job.replicas - t) * job.gpus_per_replica, commit=True):
                    keepable.add(job.name)
        return self._place(snap, jobs, target, bound, keepable, now)

    def _reference(self, job: JobView, jobs: int, own: dict[str, int], lend: dict[str, int],
                   borrow: dict[str, int]) -> float:
        """The speedup (on the table's scale) that counts as 1 in the objective.

        Pollux measures SPEEDUP against an exclusive 1/J share of the cluster, so a job is judged
        by what it would do with its fair share; the table's own scale is the minimum size (1.0).
        """
        if self.config.speedup_reference == "min":
            return 1.0
        vc = job.virtual_cluster
        gpus = own.get(vc, 0) + min(borrow.get(vc, 0), sum(x for v, x in lend.items() if v != vc))
        speedup = self.table(job).speedup
        fair = min(max(1, math.ceil(gpus / (max(jobs, 1) * job.gpus_per_replica))), len(speedup) - 1)
        return float(speedup[fair]) if speedup[fair] > 0 else 1.0

    def _jct_weights(self, jobs: list[JobView], also_ranked: Mapping[str, Sequence[float]]
                     ) -> dict[str, float]:
        """Each job's weight in the objective (AllocatorConfig.jct_weight and jct_weight_by).

        By rank, a job whose length is unknown ranks as one horizon left, as SRPT admission
        ranks it (remaining_seconds), and a job is ranked among the live jobs of its own virtual
        cluster, those handed over and those `also_ranked`: ranked across clusters, one team's
        long jobs moved how another team's jobs split its own GPUs (a review: 16/0 became 11/5
        with four long jobs added elsewhere).
        """
        exponent = self.config.jct_weight
        if exponent == 0:
            return {j.name: 1.0 for j in jobs}
        if self.config.jct_weight_by == "rank":
            left = {j.name: self.remaining_seconds(j) for j in jobs}
            live = self.config.rank_among == "live"
            peers: dict[str, list[float]] = {vc: list(times) for vc, times in also_ranked.items() if live}
            for j in jobs:
                peers.setdefault(j.virtual_cluster, []).append(left[j.name])
            for times in peers.values():
                times.sort()
            return {j.name: float(len(peers[j.virtual_cluster])
                                  - bisect.bisect_left(peers[j.virtual_cluster], left[j.name])) ** exponent
                    for j in jobs}
        weights = {}
        for j in jobs:
            left_s = self._remaining_seconds(j)
            weights[j.name] = (1.0 if math.isinf(left_s)
                               else (self.config.horizon_seconds / max(left_s, 60.0)) ** exponent)
        return weights

    def _values(self, job: JobView, now: float, bound: dict[str, snapshot.Binding],
                weight: float) -> np.ndarray:
        """Speedup per replica count, weighed for JCT and discounted for a restart where a size
        change needs one."""
        table = self.table(job)
        v = table.speedup.copy() * weight
        if job.replicas:
            penalty = self._penalty(job, in_place=self.config.greedy_in_place)
            cur = min(job.replicas, len(v) - 1)
            keep = v[cur]
            if self.config.placement_aware and job.name in bound:
                keep = self.at_span(job, cur, len(bound[job.name].gpus_by_node))[0] * weight
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
    def _push_best(heap: list, job: JobView, at: int, values: np.ndarray, from_zero: bool = False) -> None:
        """Queue the job's best jump from `at` replicas; from 0 only when it is admitted by value."""
        if (at == 0 and not from_zero) or at + 1 >= len(values):
            return
        first = max(at + 1, job.min_replicas)  # a jump from 0 lands on the minimum or above
        if first >= len(values):
            return
        steps = np.arange(first, len(values))
        gains = (values[first:] - values[at]) / ((steps - at) * job.gpus_per_replica)
        i = int(np.argmax(gains))
        if gains[i] > 1e-9:
            heapq.heappush(heap, (-float(gains[i]), job.name, int(steps[i])))

    @staticmethod
    def _budgets(snap: snapshot.ClusterSnapshot, running: list[JobView]
                 ) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
        # Pinned jobs are never shrunk by the allocator (PINNED_PRIORITY): what they hold on a
        # lender stays theirs when the lender lowers its limit below it. Without this the lowered
        # limit preempted another pinned job, one that held no lent GPU at all. (A lender that
        # needs its GPUs for its own work still reclaims them: loaning.plan_reclaim.)
        bound = snap.bindings()
        pinned_lent: dict[str, int] = {}
        pinned_borrowed: dict[str, int] = {}
        for job in running:
            if job.priority >= PINNED_PRIORITY:
                held = snap.foreign_gpus(job.virtual_cluster, bound[job.name].gpus_by_node)
                for owner, gpus in held.items():
                    pinned_lent[owner] = pinned_lent.get(owner, 0) + gpus
                    pinned_borrowed[job.virtual_cluster] = pinned_borrowed.get(job.virtual_cluster, 0) + gpus
        with snap.simulate():
            for job in running:
                snap.forget(job.name)
            own = {v.name: snap.free(v.name) for v in snap.virtual_clusters()}
            own[""] = snap.free("")  # nodes outside any virtual cluster
            lend = {v.name: min(max(snap.lend_left(v.name), pinned_lent.get(v.name, 0)), snap.free(v.name))
                    for v in snap.virtual_clusters()}
            borrow = {v.name: max(snap.borrow_left(v.name), pinned_borrowed.get(v.name, 0))
                      for v in snap.virtual_clusters()}
        return own, lend, borrow

    def _place(self, snap: snapshot.ClusterSnapshot, jobs: list[JobView], target: dict[str, int],
               bound: dict[str, snapshot.Binding], keepable: set[str], now: float) -> list[Decision]:
        decisions: list[Decision] = []
        # Release first what shrinks or stops, so the GPUs are there for the jobs that grow.
        shrunk: set[str] = set()
        deferred: set[str] = set()  # released at their turn below
        for job in jobs:
            if job.name in bound and target[job.name] != job.replicas:
                grows = target[job.name] > job.replicas
                if self.config.keep_replicas and (grows or self._keeps(job, keepable)):
                    continue  # grows around the replicas it has (_grow_in_place), or keeps them
                if grows and job.priority >= PINNED_PRIORITY:
                    # A pinned job falls back on its old GPUs if it cannot grow: another job may not
                    # take them, nor the lender's room they are counted in, before its turn.
                    deferred.add(job.name)
                    continue
                snap.forget(job.name)
                if (self.config.keep_replicas and target[job.name]
                        and self._shrink_in_place(snap, job, bound[job.name], target[job.name])):
                    shrunk.add(job.name)
        # Keepers need no placement; then the rest by priority, running pinned jobs first within
        # theirs, and size (big gangs first). A pinned job that grows stays bound until its turn
        # (deferred above), so no gang placed before it takes its old GPUs or the lender's room
        # they are counted in (it was then preempted, or kept on top of the other's loan, over
        # the lender's limit: found by the property test).
        # (jobs that select nodes before the others of their priority: placed after, a gang that
        # may go anywhere took the selected nodes and left the selecting job below its minimum)
        changing = sorted((j for j in jobs if not (j.name in bound and target[j.name] == j.replicas)),
                          key=lambda j: (-j.priority, not (j.name in bound and j.priority >= PINNED_PRIORITY),
                                         not j.node_selector, -target[j.name] * j.gpus_per_replica,
                                         j.submitted))
        for job in jobs:
            if job.name in bound and target[job.name] == job.replicas:
                decisions.append(self._keep(job, bound[job.name], "size unchanged"))
        for job in changing:
            want = target[job.name]
            if job.name in shrunk:
                kept = snap.bindings()[job.name]
                speed = self.at_span(job, want, len(kept.gpus_by_node))[0]
                decisions.append(self._decision(
                    job, "shrink", want, replica_nodes(kept, job.gpus_per_replica),
                    f"predicted speedup {speed:.2f}× at {want} replicas on {len(kept.gpus_by_node)} "
                    f"node(s), its other replicas where they run", nodes=len(kept.gpus_by_node)))
                continue
            if self.config.keep_replicas and self._keeps(job, keepable):
                # the GPUs it holds are left over: a smaller gang of the same replicas gains nothing
                decisions.append(self._keep(job, bound[job.name], "its GPUs are not needed elsewhere"))
                continue
            if self.config.keep_replicas and job.name in bound and want > job.replicas:
                decisions.append(self._grow_in_place(snap, job, bound[job.name], want))
                continue
            if job.name in deferred:
                snap.forget(job.name)
            placed: placement.Placement | None = None
            reason = ""
            best = -1.0
            running = job.name in bound
            # A resize restarts the job: price it as _values does, so that a placement worse than
            # the table assumed cannot make a job flap between two sizes; one that leaves the
            # staying replicas where they run is resized in place, at the in-place share.
            moved = 1.0 - self._penalty(job) if running else 1.0
            in_place = 1.0 - self._penalty(job, in_place=True) if running else 1.0
            # A pinned job is never shrunk (pass 1's floor): a smaller gang that would pack better
            # is not an option for it, and if no size from its own up fits, it keeps its GPUs.
            floor = job.replicas if running and job.priority >= PINNED_PRIORITY else job.min_replicas
            for a in range(want, floor - 1, -1) if want else []:
                where = snap.place(job.virtual_cluster, a, job.gpus_per_replica,
                                   node_selector=job.node_selector)
                if not isinstance(where, placement.Placement):
                    reason = where.reason
                    continue
                if not self.config.placement_aware:
                    placed, want = where, a
                    break
                # Fragmentation may spread the gang over more nodes than the table assumed; a
                # smaller gang on fewer nodes can then be faster. Keep the best real speedup, and
                # stop at the first size that packs as the table assumed.
                if where.nodes_spanned > 1 and self.ideal_nodes(job, a) == 1:
                    # Own-cluster-first spread the gang; one whole node (a lender's, if the
                    # lending limits allow) may hold it instead.
                    whole = snap.place(job.virtual_cluster, a, job.gpus_per_replica,
                                       node_selector=job.node_selector, single_node=True)
                    if isinstance(whole, placement.Placement):
                        where = whole
                cost = moved
                if running and a != job.replicas and keeps_nodes(
                        bound[job.name].gpus_by_node, where.gpus_by_node(job.gpus_per_replica),
                        grew=a > job.replicas):
                    cost = in_place
                speed = self.at_span(job, a, where.nodes_spanned)[0] * cost
                if (running and a != job.replicas and cost != in_place and job.resizes_in_place
                        and self.config.in_place_share < 1 and self.config.resize_around_replicas):
                    # The gang placed afresh moves a staying replica (the placement search does
                    # not know where the job runs); the same size around its replicas is resized
                    # in place, and may be worth more even where it spans more nodes.
                    anchored = self._anchored(snap, job, bound[job.name], a)
                    if anchored is not None:
                        around = self.at_span(job, a, anchored.nodes_spanned)[0] * in_place
                        if around > speed:
                            where, speed = anchored, around
                if speed > best:
                    placed, want, best = where, a, speed
                # (where the gang around the replicas won and spans more, smaller sizes are
                # still tried: the best so far does not pack as the table assumed)
                if where.nodes_spanned <= self.ideal_nodes(job, a):
                    break
            pinned = running and job.priority >= PINNED_PRIORITY
            if running and ((self.config.placement_aware and (job.replicas <= target[job.name]
                                                               or job.name in keepable))
                            or (pinned and placed is None)):  # never preempted for want of room
                old = bound[job.name]
                stay = self.at_span(job, job.replicas, len(old.gpus_by_node))[0]
                # Its old GPUs on a lender's nodes count against that lender's limit again: a
                # gang placed since it was lifted off may have taken the room (the limit was
                # exceeded by 7 GPUs, and an inference SLO missed, before this check). A pinned
                # job keeps what it holds, as in _budgets.
                if stay >= best and (pinned or snap.limits_allow(job.virtual_cluster, old.gpus_by_node)):
                    with contextlib.suppress(ValueError):  # its GPUs went to a bigger gang first
                        where = placement.Placement(replica_nodes(old, job.gpus_per_replica))
                        snap.assume(job.name, job.virtual_cluster, where, job.gpus_per_replica)
                        why = ("a resize would land on a placement that does not pay for its restart"
                               if placed is not None else
                               f"pinned (priority ≥ {PINNED_PRIORITY}): kept where it runs, as it cannot "
                               f"grow ({reason or 'no room'})")
                        decisions.append(self._keep(job, old, why))
                        continue
            if placed is not None:
                snap.assume(job.name, job.virtual_cluster, placed, job.gpus_per_replica)
            if placed is None:
                action = "preempt" if job.replicas else "pending"
                why = reason or self._why_zero(job)
                decisions.append(self._decision(job, action, 0, [], why))
                continue
            action = ("admit" if not job.replicas else "grow" if want > job.replicas
                      else "shrink" if want < job.replicas else "move")
            speed = self.table(job).speedup
            real = self.at_span(job, want, placed.nodes_spanned)[0]
            why = (f"predicted speedup {real:.2f}× at {want} replicas on {placed.nodes_spanned} node(s) "
                   f"vs {speed[job.min_replicas]:.2f}× at min {job.min_replicas}")
            decisions.append(self._decision(job, action, want, placed.assignments, why,
                                            nodes=placed.nodes_spanned))
        return decisions

    @staticmethod
    def _keeps(job: JobView, keepable: set[str]) -> bool:
        """A running job the greedy would shrink keeps its size where its GPUs are left over, unless
        its spec no longer allows it (maxReplicas lowered below it)."""
        return job.name in keepable and job.replicas <= job.max_replicas

    def _anchored(self, snap: snapshot.ClusterSnapshot, job: JobView, old: snapshot.Binding,
                  replicas: int) -> placement.Placement | None:
        """The running job at `replicas` with every staying replica where it runs (its binding
        lifted off): a shrink keeps the replicas `_kept_replicas` names, a grow adds the new ones
        beside the gang on its own cluster's nodes first, then wherever they fit. None where a
        gang placed since took GPUs it holds, one of its nodes is cordoned, or the lending limits
        forbid it."""
        gpr, vc = job.gpus_per_replica, job.virtual_cluster
        views = snap.node_views()
        free = {view.name: view.gpus_free for view in views}
        if any(view.cordoned for view in views if view.name in old.gpus_by_node):
            return None  # a node being drained: the gang placed afresh leaves it
        if replicas < job.replicas:
            where = self._kept_replicas(snap, job, old, replicas)
            need = where.gpus_by_node(gpr)
            taken = any(free.get(node, 0) < gpus for node, gpus in need.items())
            return None if taken or not snap.limits_allow(vc, need) else where
        if any(free.get(node, 0) < gpus for node, gpus in old.gpus_by_node.items()):
            return None
        added = self._new_replicas_beside(snap, job, old, replicas - job.replicas, lifted=True)
        if added is None:
            return None
        merged = placement.Placement(sorted(replica_nodes(old, gpr) + added))
        return merged if snap.limits_allow(vc, merged.gpus_by_node(gpr)) else None

    @staticmethod
    def _new_replicas_beside(snap: snapshot.ClusterSnapshot, job: JobView, old: snapshot.Binding, extra: int,
                             lifted: bool) -> list[str] | None:
        """The nodes of `extra` new replicas of a running gang: on the gang's own nodes first, most
        of its replicas first (more on a lender's node needs the lender's room, and none goes on a
        cordoned node: both are left to the placement), then wherever the rest fit. `lifted`: the
        gang's binding is off the snapshot, so its own GPUs count as free there and are held for
        it. None where the new replicas do not fit."""
        gpr, vc = job.gpus_per_replica, job.virtual_cluster
        views = snap.node_views()
        held = old.gpus_by_node if lifted else {}
        free = {v.name: v.gpus_free - held.get(v.name, 0) for v in views}
        cordoned = {v.name for v in views if v.cordoned}
        beside: list[str] = []
        admitted = {v.name for v in views if placement.fits_selector(v, job.node_selector)}
        for node in sorted(old.gpus_by_node, key=lambda n: (-old.gpus_by_node[n], n)):
            if not snap.foreign_gpus(vc, {node: 1}) and node not in cordoned and node in admitted:
                beside += [node] * max(0, min(free[node] // gpr, extra - len(beside)))
        if not lifted and len(beside) == extra:
            return beside
        with snap.simulate():
            try:
                ours = replica_nodes(old, gpr) + beside if lifted else beside
                if ours:
                    snap.assume(f"{job.name}/beside", vc, placement.Placement(ours), gpr)
            except ValueError:  # a node's GPUs gone in between: nothing to add beside
                return None
            if len(beside) == extra:
                return beside
            rest = snap.place(vc, extra - len(beside), gpr, node_selector=job.node_selector)
        return beside + rest.assignments if isinstance(rest, placement.Placement) else None

    @staticmethod
    def _kept_replicas(snap: snapshot.ClusterSnapshot, job: JobView, old: snapshot.Binding,
                       want: int) -> placement.Placement:
        """Which `want` of a running job's replicas stay in a shrink: the ones on other clusters'
        nodes leave first, then those where the gang is thinnest, so the smaller gang spans no
        more nodes."""
        count = {node: gpus // job.gpus_per_replica for node, gpus in old.gpus_by_node.items()}
        lent = {node for node in count if snap.foreign_gpus(job.virtual_cluster, {node: 1})}
        drop = job.replicas - want
        for node in sorted(count, key=lambda n: (n not in lent, count[n], n)):  # leaves first
            take = min(drop, count[node])
            count[node] -= take
            drop -= take
        return placement.Placement([node for node, n in sorted(count.items()) for _ in range(n)])

    def _shrink_in_place(self, snap: snapshot.ClusterSnapshot, job: JobView, old: snapshot.Binding,
                         want: int) -> bool:
        """Bind `want` of the job's replicas where they run (its binding already forgotten; which
        stay: _kept_replicas). False, binding nothing, where what stays would break a lending limit
        lowered since (the job is then placed afresh)."""
        gpr = job.gpus_per_replica
        where = self._kept_replicas(snap, job, old, want)
        if not snap.limits_allow(job.virtual_cluster, where.gpus_by_node(gpr)):
            return False
        snap.assume(job.name, job.virtual_cluster, where, gpr)
        return True

    def _grow_in_place(self, snap: snapshot.ClusterSnapshot, job: JobView, old: snapshot.Binding,
                       want: int) -> Decision:
        """Add replicas to a gang that stays bound where it runs: the job's own nodes first, then
        wherever the gang of new ones fits; the size with the best real speedup, priced with its
        restart's in-place share, against staying. Keeps the job where no growth pays."""
        gpr = job.gpus_per_replica
        cost = 1.0 - self._penalty(job, in_place=True)  # every replica stays where it runs
        current = replica_nodes(old, gpr)
        stay = self.at_span(job, job.replicas, len(old.gpus_by_node))[0]
        best, chosen = stay, None
        for a in range(want, job.replicas, -1):
            added = self._new_replicas_beside(snap, job, old, a - job.replicas, lifted=False)
            if added is None:
                continue
            merged = placement.Placement(sorted(current + added))
            speed = self.at_span(job, a, merged.nodes_spanned)[0] * cost
            if speed > best:
                best, chosen = speed, merged
            if merged.nodes_spanned <= max(self.ideal_nodes(job, a), len(old.gpus_by_node)):
                break
        if chosen is None:
            return self._keep(job, old, "no larger gang around its replicas pays for its restart")
        snap.forget(job.name)
        snap.assume(job.name, job.virtual_cluster, chosen, gpr)
        size = len(chosen.assignments)
        speed = self.at_span(job, size, chosen.nodes_spanned)[0]
        return self._decision(
            job, "grow", size, chosen.assignments,
            f"predicted speedup {speed:.2f}× at {size} replicas on {chosen.nodes_spanned} node(s), "
            f"its {job.replicas} replicas where they run", nodes=chosen.nodes_spanned)

    def _keep(self, job: JobView, binding: snapshot.Binding, why: str) -> Decision:
        return self._decision(job, "keep", job.replicas, replica_nodes(binding, job.gpus_per_replica), why,
                              nodes=len(binding.gpus_by_node))

    def remaining_seconds(self, job: JobView) -> float:
        """Time the job still needs at its minimum size, by its own model: the key of SRPT admission.

        A caller that hands the allocator only the pending jobs that could start this cycle (the
        simulator, for speed) must pick them by this key when `pending_order` is "remaining", or
        the shortest jobs further back in the queue are never seen.

        A job whose spec declares no length ranks as if it had one horizon left, the time its
        neutral JCT weight stands for: ranked last (as infinitely long), jobs that declare
        nothing waited behind every job that did, and half the jobs undeclared cost more mean
        JCT than all of them (docs/scheduling.md, "Wrong or missing job lengths").
        """
        left = self._remaining_seconds(job)
        return self.config.horizon_seconds if math.isinf(left) else left

    def _remaining_seconds(self, job: JobView) -> float:
        """Time the job still needs at its minimum size, by its own model; inf when unknown."""
        table = self.table(job)
        if job.remaining_work is None or table.good is None:
            return math.inf
        rate = float(table.good[job.min_replicas])
        return job.remaining_work / rate if rate > 0 else math.inf

    def _finishing(self, job: JobView) -> bool:
        """Whether a running job finishes at its current size within protect_finishing_restarts restarts."""
        if self.config.protect_finishing_restarts <= 0 or not job.replicas:
            return False
        speedup = self.table(job).speedup
        speed = float(speedup[min(job.replicas, len(speedup) - 1)]) or 1.0
        left = self._remaining_seconds(job) / speed
        return left <= self.config.protect_finishing_restarts * job.restart_seconds

    def _penalty(self, job: JobView, in_place: bool = False) -> float:
        """What a resize costs a running job, as a share of its goodput over the planning horizon:
        its restart (or, in place, the in-place share of one) plus the hysteresis margin."""
        restart = job.restart_seconds
        if in_place and job.resizes_in_place:
            restart *= self.config.in_place_share
        horizon = self.config.horizon_seconds
        if self.config.restart_over_remaining and job.replicas:
            table = self.table(job)
            cur = min(job.replicas, len(table.speedup) - 1)
            speed = float(table.speedup[cur]) or 1.0
            horizon = min(horizon, self._remaining_seconds(job) / speed)
        return restart / max(horizon, 1e-9) + self.config.hysteresis

    def _why_zero(self, job: JobView) -> str:
        return (f"no GPUs left for its minimum of {job.min_replicas}×{job.gpus_per_replica} after jobs of "
                f"priority ≥ {job.priority} took theirs")

    def _decision(self, job: JobView, action: str, replicas: int, assignments: list[str], reason: str,
                  nodes: int | None = None) -> Decision:
        if self.config.placement_aware and nodes is not None:
            choice = self.at_span(job, replicas, nodes)[1]
        else:
            choice = self.table(job).choice(replicas)
        return Decision(job.name, action, replicas, job.replicas,
                        choice.global_batch if choice else None, choice.local_batch if choice else None,
                        choice.lr_scale if choice else None, assignments, reason)


FITNESS_EPSILON = 1e-3  # added to speedups before the power when p ≠ 1, as Pollux's artifact does


def fitness_terms(speedups: np.ndarray, p: float) -> np.ndarray:
    """Each size's contribution to the power-mean objective, oriented so that higher is better.

    Maximising (1/J Σ s_j^p)^(1/p) is maximising Σ s_j^p for p > 0 and minimising it for p < 0
    (the outer power 1/p is then decreasing), and the limit p → 0 is the geometric mean, Σ log s_j.
    The greedy compares differences of these terms, so the monotone outer power never has to be
    taken. At p = 1 the speedups come back untouched, so the allocator decides exactly as it did
    before p existed. Otherwise ε keeps a size with speedup 0 (pending, or blocked by the cooldown)
    finite: for p < 0 it costs 1/ε^|p| against 1 at the minimum, so reaching the minimum outweighs
    any growth, the paper's treatment of jobs without GPUs.
    """
    if p == 1.0:
        return speedups
    s = np.maximum(speedups, 0.0) + FITNESS_EPSILON
    if p == 0.0:
        return np.log(s)
    return np.sign(p) * s**p


def fitness(speedups: np.ndarray, p: float) -> float:
    """Pollux's FITNESS_p of one allocation: the power mean of the jobs' speedups (ε added when p ≠ 1)."""
    s = np.asarray(speedups, dtype=float)
    if p == 1.0:
        return float(s.mean())
    s = np.maximum(s, 0.0) + FITNESS_EPSILON
    if p == 0.0:
        return float(np.exp(np.log(s).mean()))
    return float(np.mean(s**p) ** (1.0 / p))


def replica_nodes(binding: snapshot.Binding, gpus_per_replica: int) -> list[str]:
    """The node of each replica a binding holds (replicas on one node adjacent)."""
    return [node for node, gpus in binding.gpus_by_node.items() for _ in range(gpus // gpus_per_replica)]


def keeps_nodes(old: dict[str, int], new: dict[str, int], grew: bool) -> bool:
    """Whether a resize from GPUs by node `old` to `new` leaves every staying replica where it
    ran: a grow only adds, a shrink only removes."""
    small, large = (old, new) if grew else (new, old)
    return all(large.get(node, 0) >= gpus for node, gpus in small.items())
