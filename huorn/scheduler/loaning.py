"""Lending idle inference GPUs to training, and getting them back in time.

An inference virtual cluster lends what its forecast peak over the next horizon leaves idle
(capacity − forecast need, within the VirtualCluster's maxGPUsLent). When the forecast rises the
difference is reclaimed ahead of need: the forecast horizon is longer than the reclaim grace, so
the GPUs are back before the load arrives. When load jumps past the forecast, the reclaim starts
at once and the grace period is the only delay.

Each reclaim is a decision with a deadline, not an action: the borrower gets SIGTERM at
`signal_at`, checkpoints and releases, and anything still running at `deadline` (signal_at + the
lender's reclaim grace) is killed. Victims are chosen to minimise lost work, measured in GPU-seconds
(FaPES): a victim that can checkpoint inside the grace loses only the checkpoint write and the
restart of the replicas that keep running; one that cannot also loses everything since its last
checkpoint. Shrinking an elastic job that stays above its minimum is preferred to preempting a
job, because a preempted job loses its whole restart and its place, which this cost counts.

A borrower's priority does not protect it: a lender always gets its own GPUs back. Priority ≥ 100
pins a job within its own cluster's quota (the allocator never shrinks it, preemption never stops
it), not on GPUs it borrowed, as Kueue's reclaimWithinCohort takes back nominal quota whatever the
borrower's priority. Before, a pinned borrower was never a victim, and since a tenant who may
edit a job may set its priority, any job could keep a lender's GPUs for good.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from huorn.scheduler import snapshot


@dataclass(frozen=True)
class LoanView:
    """One training job's replicas on a lender's nodes, and what losing them would cost."""

    job: str
    replicas_on_lender: int
    replicas_total: int
    min_replicas: int
    gpus_per_replica: int = 1
    priority: int = 50
    seconds_since_checkpoint: float = 0.0
    checkpoint_seconds: float = 10.0  # time to write a checkpoint after SIGTERM
    restart_seconds: float = 60.0


@dataclass(frozen=True)
class Reclaim:
    job: str
    action: str  # shrink | preempt
    replicas_released: int
    gpus_released: int
    signal_at: float
    deadline: float
    graceful: bool  # the victim can checkpoint before the deadline
    lost_gpu_seconds: float
    reason: str


def lendable_gpus(lender: snapshot.VirtualClusterView, capacity: int, forecast_need: int) -> int:
    """GPUs the lender may have out on loan now: idle under its forecast, within its limit."""
    if not lender.lendable:
        return 0
    return max(0, min(lender.max_gpus_lent, capacity - forecast_need))


def _lost(loan: LoanView, released: int, preempt: bool, grace: float) -> tuple[float, bool]:
    graceful = loan.checkpoint_seconds <= grace
    gpus_total = loan.replicas_total * loan.gpus_per_replica
    staying = 0 if preempt else (loan.replicas_total - released) * loan.gpus_per_replica
    since = loan.checkpoint_seconds if graceful else loan.seconds_since_checkpoint
    restart = loan.restart_seconds * (gpus_total if preempt else staying)
    return since * gpus_total + restart, graceful


def plan_reclaim(
    lender: snapshot.VirtualClusterView, gpus_wanted: int, loans: list[LoanView], now: float, why: str
) -> list[Reclaim]:
    """Choose victims that give back at least `gpus_wanted` GPUs at the least lost work.

    Returns fewer GPUs than asked only when the loans cannot cover it; the caller sees that from
    the sum. Every borrower is a candidate, whatever its priority (see the module's docstring).
    Greedy by lost GPU-seconds per GPU still wanted, each option priced at the replicas it would
    release now.
    """
    if gpus_wanted <= 0:
        return []
    grace = lender.reclaim_grace_seconds
    candidates = [loan for loan in loans if loan.replicas_on_lender > 0]
    chosen: dict[str, Reclaim] = {}
    left = gpus_wanted
    while left > 0:
        # Each option is priced at the size it would really take now: a shrink releases only the
        # replicas still wanted, and every replica that stays pays a restart. Ranked at the full
        # shrinkable amount instead, a big gang's cheap average hid the price of the one replica
        # it would actually give (16 replicas shrunk by one lose 1,060 GPU-s against 81 for a gang
        # of two).
        best: tuple[float, str, bool, int, float, bool] | None = None
        for loan in candidates:
            earlier = chosen.get(loan.job)
            if earlier is not None and earlier.action == "preempt":
                continue
            shrinkable = min(loan.replicas_on_lender, loan.replicas_total - loan.min_replicas)
            options = [(True, loan.replicas_on_lender)]
            if earlier is None and shrinkable > 0:
                options.append((False, min(shrinkable, math.ceil(left / loan.gpus_per_replica))))
            for preempt, replicas in options:
                lost, graceful = _lost(loan, replicas, preempt, grace)
                gpus = replicas * loan.gpus_per_replica
                more_lost = lost - (earlier.lost_gpu_seconds if earlier else 0.0)
                more_gpus = gpus - (earlier.gpus_released if earlier else 0)
                if more_gpus <= 0:
                    continue
                price = more_lost / min(more_gpus, left)
                key = (price, loan.job, preempt, replicas, lost, graceful)
                if best is None or key < best:
                    best = key
        if best is None:
            break  # the loans hold no more
        _, job, preempt, replicas, lost, graceful = best
        earlier = chosen.get(job)
        if earlier is not None:
            left += earlier.gpus_released  # a shrink that was not enough becomes a preemption
        gpus = replicas * next(loan.gpus_per_replica for loan in candidates if loan.job == job)
        chosen[job] = Reclaim(
            job, "preempt" if preempt else "shrink", replicas, gpus, now, now + grace, graceful, lost,
            f"{lender.name} reclaims {gpus_wanted} GPU(s) ({why}); {job} gives back {gpus} "
            f"losing {lost:.0f} GPU-s, the least of the borrowers")
        left -= gpus
    return list(chosen.values())
