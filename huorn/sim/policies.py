"""Huorn and the baselines (FIFO, Kueue, six Pollux forms), each as faithful as one simulator allows.

- fifo: static gangs in strict arrival order (head-of-line blocking), each at its requested size,
  on the training cluster only; no elasticity, no loaning, no preemption.
- kueue: Kueue's ClusterQueue model. Workloads are admitted whole, at their requested size, in
  BestEffortFIFO order (a head that does not fit does not block the rest), and may borrow the
  inference cluster's unused quota. When the lender needs its quota back, borrowing workloads are
  evicted whole, lowest priority and most recently admitted first (Kueue's preemption order);
  they exit at once (no checkpoint on SIGTERM) and lose the work since their last periodic
  checkpoint.
  Kueue has no performance model and no forecast: it reclaims when the need is already there.
- pollux: the goodput allocator (AdaptDL's objective: speedup, batch size and learning rate chosen
  together) on the training cluster only, with a 10 % restart penalty and no priors: every job
  starts from one generic curve and learns its own from telemetry. No loaning, no inference
  awareness. It maximises the sum of speedups, Pollux's fairness exponent p = 1.
- pollux-p-1: the same at p = -1, the exponent the Pollux paper evaluates: the power mean of
  speedups, which favours the jobs furthest behind.
- pollux-p-1-fair: p = -1 with the paper's SPEEDUP, relative to an equal 1/J share of the cluster
  rather than to the job's minimum size: the paper's default as written.
- pollux-arrival, pollux-p-1-arrival, pollux-p-1-fair-arrival: each of the three as AdaptDL is
  deployed: beside the 60 s cycle, a job is placed when it arrives, at its minimum replicas on the
  first node with room for them (free GPUs only, no preemption, no loaning); otherwise it waits
  for the cycle. A completion admits nothing. All six run (POLLUX_FORMS), and the best per case
  is the baseline Huorn is measured against, so no choice of Pollux's knobs flatters Huorn.
- huorn: the same allocator with the priors its operator picks (moe for an MoE model, otherwise
  transformer, anchored to the measured level), the restart-cost hysteresis and cooldown, the
  JCT-aware terms (remaining-time weights, restarts charged over the remaining time, shortest-
  remaining admission over the whole queue, admission by value, jobs near their end kept whole)
  and admission between ticks, plus loaning: the inference cluster lends what its forecast peak
  (0.9 quantile) leaves idle, reclaims ahead of the forecast and at once on a jump, choosing
  victims by least lost work and shrinking them gracefully (SIGTERM → checkpoint → release)
  within the grace period.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from huorn.scheduler import allocator, forecast, loaning, placement

if TYPE_CHECKING:
    from huorn.sim import state
    from huorn.sim.engine import Simulation


@dataclass(frozen=True)
class PolicySpec:
    name: str
    elastic: bool
    loaning: str  # none | kueue | huorn
    strict_fifo: bool = False
    # Where each job's performance model starts (engine.initial_belief): "generic" (one
    # transformer curve for every job, unanchored: AdaptDL has no catalogue), "operator" (what
    # Huorn's operator can pick, huorn/backends/goodput.py prior_model: moe for an MoE model,
    # otherwise transformer, anchored to the measured level) or "family" (the job's own family
    # curve, the centre of the distribution its true curve is drawn from: a study's upper end,
    # not something a scheduler in a cluster has).
    priors: str = "generic"
    # Admit pending jobs into free GPUs as soon as they arrive or GPUs free up, instead of at the
    # next scheduling tick, as Huorn's kopf handlers do. The Pollux paper's simulator allocates on
    # its 60 s cycle only, as the three plain Pollux forms do; AdaptDL as deployed also admits a
    # job when it arrives (arrival_admission below). Tried for fifo and kueue too: FIFO got worse
    # (head-of-line blocking), Kueue barely moved, so they keep the tick (docs/scheduling.md).
    event_admission: bool = False
    # AdaptDL's allocator beside its 60 s optimiser (_allocate_one_loop, PolluxPolicy.allocate_job):
    # on a job's arrival (an ADDED event) it places the job at its minimum replicas on the first
    # node, by name, with that many free GPUs: one node, free GPUs only, no preemption, no
    # loaning. Otherwise the job waits for the cycle. It does not react to completions.
    arrival_admission: bool = False
    allocator: allocator.AllocatorConfig = field(default_factory=allocator.AllocatorConfig)
    # The prediction board that sizes the inference reserve (read only by loaning="huorn").
    board: forecast.ForecastConfig = field(default_factory=forecast.ForecastConfig)
    # A running job's resize keeps its processes (Huorn's runtime, spec.elasticity.resize): the
    # pause is state.IN_PLACE_RESIZE_SHARE of a restart. Pollux (AdaptDL) restarts from a
    # checkpoint on every reallocation, as torchrun does.
    in_place_resize: bool = False


HUORN_BOARD_QUANTILE = forecast.HUORN_QUANTILE  # why 0.9: huorn.scheduler.forecast
# Whether a resize leaves the staying replicas where they ran: the test the allocator prices a
# placement by is the one that decides the pause the simulator charges.
_keeps_nodes = allocator.keeps_nodes


_PLAIN_POLLUX: dict[str, PolicySpec] = {
    "pollux": PolicySpec("pollux", elastic=True, loaning="none", allocator=allocator.AllocatorConfig(
        horizon_seconds=math.inf, hysteresis=0.10, cooldown_seconds=0.0)),
    "pollux-p-1": PolicySpec("pollux-p-1", elastic=True, loaning="none", allocator=allocator.AllocatorConfig(
        horizon_seconds=math.inf, hysteresis=0.10, cooldown_seconds=0.0, fairness_p=-1.0)),
    "pollux-p-1-fair": PolicySpec("pollux-p-1-fair", elastic=True, loaning="none",
                                  allocator=allocator.AllocatorConfig(
                                      horizon_seconds=math.inf, hysteresis=0.10, cooldown_seconds=0.0,
                                      fairness_p=-1.0, speedup_reference="fair_share")),
}
# AdaptDL's deployed form of each Pollux variant: the same, and a job that arrives is placed at
# once where one node has room for its minimum (PolicySpec.arrival_admission)
ARRIVAL_SUFFIX = "-arrival"
_ARRIVAL_POLLUX = {f"{name}{ARRIVAL_SUFFIX}": dataclasses.replace(
    spec, name=f"{name}{ARRIVAL_SUFFIX}", arrival_admission=True) for name, spec in _PLAIN_POLLUX.items()}
# Every Pollux form Huorn is measured against: the best of the six per case is "the best Pollux"
# (each study and benchmark takes it so), so neither the fairness exponent nor the admission path
# chosen for Pollux flatters Huorn.
POLLUX_FORMS: tuple[str, ...] = (*_PLAIN_POLLUX, *_ARRIVAL_POLLUX)

POLICIES: dict[str, PolicySpec] = {
    "fifo": PolicySpec("fifo", elastic=False, loaning="none", strict_fifo=True),
    "kueue": PolicySpec("kueue", elastic=False, loaning="kueue"),
    **_PLAIN_POLLUX,
    **_ARRIVAL_POLLUX,
    # Huorn's production allocator and board (huorn.scheduler.allocator.HUORN, forecast.HUORN_QUANTILE)
    "huorn": PolicySpec("huorn", elastic=True, loaning="huorn", priors="operator", event_admission=True,
                        allocator=allocator.HUORN, in_place_resize=True,
                        board=forecast.ForecastConfig(quantile=HUORN_BOARD_QUANTILE)),
}
TRAIN, INFER = "train", "infer"


def schedule(sim: Simulation) -> None:
    react_to_load(sim)
    if sim.spec.elastic:
        _schedule_elastic(sim)
    else:
        _schedule_static(sim)


def admit(sim: Simulation) -> None:
    """Between ticks: place pending jobs into the GPUs free now; running jobs are not touched."""
    if sim.spec.elastic:
        _schedule_elastic(sim, admission_only=True)
    else:
        _schedule_static(sim)


def admit_arrivals(sim: Simulation, arrived: list[state.JobState]) -> None:
    """AdaptDL's admission on arrival (PolicySpec.arrival_admission): each job that has just
    arrived, in arrival order, at its minimum replicas on the first training node, by name, with
    that many free GPUs (PolluxPolicy.allocate_job: one node, free GPUs, no preemption and no
    loaning); a job no single node has room for waits for the next cycle. Nothing else moves,
    and a completion admits nothing (AdaptDL reacts to ADDED events only)."""
    for js in arrived:
        if js.status != "pending":
            continue
        gpr = js.job.family.gpus_per_replica
        need = js.job.min_replicas * gpr
        if sim.snap.free(TRAIN) < need:
            continue
        for node in sim.train_nodes:
            where = sim.snap.place_at(TRAIN, [node] * js.job.min_replicas, gpr)
            if isinstance(where, placement.Placement):
                sim.bind(js, where, js.job.min_replicas,
                         max(1.0, js.job.family.base_batch / js.job.min_replicas), restart=True)
                break


def react_to_load(sim: Simulation) -> None:
    """Set what the inference cluster lends now, and reclaim what it must have back."""
    if sim.spec.loaning == "none":
        return
    need = sim.load.need_at(sim.now)
    if sim.spec.loaning == "kueue":
        lendable = max(0, sim.infer_gpus - need)  # its unused quota, as of now
    else:
        reserve = max(need, sim.load.forecast_at(sim.now))
        lendable = loaning.lendable_gpus(sim.infer_view, sim.infer_gpus, reserve)
    sim.set_lend_limit(lendable)
    excess = sim.snap.lent(INFER) - lendable
    if excess <= 0:
        return
    if sim.spec.loaning == "kueue":
        _kueue_evict(sim, excess)
    else:
        jump = need > sim.infer_available()
        _huorn_reclaim(sim, excess, "load jumped past the forecast" if jump else "forecast peak rises")


def _kueue_evict(sim: Simulation, excess: int) -> None:
    """Kueue evicts whole workloads, newest first; their pods are deleted. A trainer without
    Huorn's runtime takes no checkpoint on SIGTERM: it exits at once, so its GPUs are back at once
    and the work since its last checkpoint is lost. (Its GPUs had been held for the whole grace
    period as well, a cost no runtime pays twice.)"""
    borrowers = sorted((js for js in sim.active() if js.status == "running" and js.on_lender),
                       key=lambda js: -js.admitted_at)  # one priority here: newest first
    for js in borrowers:
        if excess <= 0:
            break
        gpus = js.on_lender * js.job.family.gpus_per_replica
        sim.unbind(js, requeue=True, lose_work=True)
        excess -= gpus


def _huorn_reclaim(sim: Simulation, excess: int, why: str) -> None:
    loans = [loaning.LoanView(
        js.job.name, js.on_lender, js.replicas, js.job.min_replicas, js.job.family.gpus_per_replica,
        seconds_since_checkpoint=sim.now - js.last_checkpoint,
        checkpoint_seconds=js.job.family.checkpoint_seconds, restart_seconds=js.job.family.restart_seconds)
        for js in sim.active() if js.status == "running" and js.on_lender]
    for r in loaning.plan_reclaim(sim.infer_view, excess, loans, sim.now, why):
        js = sim.by_name[r.job]
        release = r.signal_at + (js.job.family.checkpoint_seconds if r.graceful else r.deadline - r.signal_at)
        keep = js.replicas - r.replicas_released
        staying = _staying_replicas(sim, js, r.replicas_released) if r.action == "shrink" else []
        leaving = _leaving_gpus(sim, js, staying)  # a preempted victim holds all of its GPUs
        sim.unbind(js, requeue=r.action == "preempt", lose_work=not r.graceful)
        # The victim holds those GPUs until it has gone: they go back to inference then, and no
        # gang may be placed on them meanwhile (before, a gang placed in the same tick shared a
        # GPU with the victim in its grace period).
        sim.hold_returns(leaving, min(release, r.deadline), js.job.name)
        if r.action == "shrink":
            # The replicas on the lender go and the others stay where they run (in place where
            # the runtime resizes so), as the operator's shrink deletes only the lender's pods.
            # The staying replicas' local batch rises where the old one would take the global
            # batch below the base batch (which no policy's allocator chooses); the next cycle
            # picks the batch again. It had kept the old one, below the base until then.
            local = max(js.local_batch, js.job.family.base_batch / keep)
            sim.bind(js, placement.Placement(staying), keep, local, restart=True)
            js.last_resize, js.last_direction = sim.now, -1


def _could_start(pending: list[state.JobState], room: int) -> list[state.JobState]:
    """The pending jobs, in admission order, that could get their minimum in `room` GPUs, each
    taking its minimum from the room: the rest cannot start this cycle. A job whose minimum is
    larger than what is left does not end the walk, since a smaller one behind it may fit. (The
    cut was the first room + 1 jobs: four 8-GPU jobs ahead of a 1-GPU job kept it waiting beside
    3 idle GPUs.)"""
    out = []
    for js in pending:
        if room <= 0:
            break
        need = js.job.min_replicas * js.job.family.gpus_per_replica
        if need <= room:
            out.append(js)
            room -= need
    return out


def _left_out_remaining(sim: Simulation, handed: list[state.JobState]) -> dict[str, list[float]]:
    """The remaining seconds of the live jobs not handed to the allocator (the pending ones that
    cannot start this cycle; the running ones too when only admission runs), for its rank weights
    (every job is of the training cluster); none when the weights are not by rank."""
    config = sim.spec.allocator
    if config.jct_weight_by != "rank" or config.jct_weight == 0 or config.rank_among != "live":
        return {}
    names = {js.job.name for js in handed}
    # a job that finished this tick is still in sim.active() until the engine's loop drops it
    return {TRAIN: [_remaining_seconds(sim, js) for js in sim.active()
                    if js.status in ("pending", "running") and js.job.name not in names]}


def _staying_replicas(sim: Simulation, js: state.JobState, released: int) -> list[str]:
    """The nodes of a borrower's replicas that stay when `released` of them leave the lender."""
    nodes = _replica_nodes(sim, js)
    staying = list(nodes)
    for node in [n for n in nodes if sim.node_vc[n] == INFER][:released]:
        staying.remove(node)
    return staying


def _leaving_gpus(sim: Simulation, js: state.JobState, staying: list[str]) -> list[str]:
    """One entry per GPU (its node) of the borrower's replicas that do not stay."""
    held = _replica_nodes(sim, js)
    for node in staying:
        held.remove(node)
    return [node for node in held for _ in range(js.job.family.gpus_per_replica)]


def _replica_nodes(sim: Simulation, js: state.JobState) -> list[str]:
    """The node of each of the job's replicas, in node order."""
    return sorted(allocator.replica_nodes(sim.snap.bindings()[js.job.name], js.job.family.gpus_per_replica))


def _schedule_static(sim: Simulation) -> None:
    for js in sim.active():
        if js.status != "pending":
            continue
        fam = js.job.family
        free = sim.snap.free(TRAIN) + min(sim.snap.borrow_left(TRAIN), sim.snap.lend_left(INFER))
        if free < fam.gpus_per_replica:
            # Strict FIFO waits behind the head of the line; Kueue's default, BestEffortFIFO,
            # lets a job that fits pass one that does not
            if sim.spec.strict_fifo:
                return
            continue
        replicas = js.job.requested_replicas
        where = sim.snap.place(TRAIN, replicas, fam.gpus_per_replica)
        if isinstance(where, placement.Placement):
            sim.bind(js, where, replicas, max(1.0, fam.base_batch / replicas), restart=True)
        elif sim.spec.strict_fifo:
            return


def job_view(js: state.JobState, in_place_resize: bool = False) -> allocator.JobView:
    """What the allocator sees of a job: its own model and the runtime's reports, never its true
    step-time curve. The noise scale is the runtime's last reading (JobState.noise_reading), which
    every elastic policy, Huorn and Pollux alike, reads the same.

    Its restart time is the family's full one; where the policy resizes in place (one process per
    replica, as JobState.resize_seconds has it), the allocator charges the in-place share of it
    to a placement that keeps the staying replicas where they run (AllocatorConfig.in_place_share).
    Told the cheaper price for every resize, Huorn's allocator resized more and lost mean JCT
    (128 GPUs, seed 0, middle: 960 restarts and 1,636 s against 915 and 1,598 s; docs/scheduling.md)."""
    fam = js.job.family
    return allocator.JobView(
        js.job.name, TRAIN, js.belief, fam.gpus_per_replica, js.job.min_replicas, js.job.max_replicas,
        replicas=js.replicas, noise_scale=js.noise_reading, base_batch=fam.base_batch,
        max_local_batch=fam.max_local_batch, restart_seconds=fam.restart_seconds,
        last_resize=js.last_resize, last_direction=js.last_direction, submitted=js.job.arrival,
        model_version=js.model_version * 1000 + int(4 * math.log1p(js.noise_reading)),
        remaining_work=_declared_remaining(js),
        resizes_in_place=in_place_resize and fam.gpus_per_replica == 1)  # as JobState.resize_seconds


def _declared_remaining(js: state.JobState) -> float | None:
    """Remaining work as the job's spec declares it, as the runtime's GoodputPolicy computes it:
    what is declared less what is done, at least 0, and unknown when nothing is declared."""
    factor = js.job.declared_factor
    return None if factor is None else max(js.job.work * factor - js.done, 0.0)


def _remaining_seconds(sim: Simulation, js: state.JobState) -> float:
    """The allocator's SRPT key for a pending job (and a job's rank among the live ones), cached
    while its model and progress stand still."""
    key = js.admission_key
    if key is None or key[0] != js.model_version or key[1] != js.done:
        key = (js.model_version, js.done, sim.allocator.remaining_seconds(job_view(js)))
        js.admission_key = key
    return key[2]


def _schedule_elastic(sim: Simulation, admission_only: bool = False) -> None:
    if admission_only:
        running = []
        room = sim.snap.free(TRAIN) + min(sim.snap.borrow_left(TRAIN), sim.snap.lend_left(INFER))
        if room <= 0:
            return
    else:
        running = [js for js in sim.active() if js.status == "running"]
        capacity = sim.train_gpus + sim.snap.lend_left(INFER) + sim.snap.lent(INFER)
        room = max(0, capacity - sum(js.job.min_replicas * js.job.family.gpus_per_replica for js in running))

    # Pending jobs beyond what could ever get their minimum this cycle get no GPUs: the first
    # room + 1 in the allocator's own admission order (arrival order, or shortest remaining time
    # first, which needs every pending job's estimate to pick them) are handed over. The others
    # still count in Huorn's rank weights (AllocatorConfig.jct_weight_by; `also_ranked`), so that
    # the cut does not move them (docs/scheduling.md, "Allocator", item 11).
    pending = [js for js in sim.active() if js.status == "pending"]
    if sim.spec.allocator.pending_order == "remaining" and len(pending) > 1:
        pending = sorted(pending, key=lambda js: (_remaining_seconds(sim, js), js.job.arrival, js.job.name))
    handed = _could_start(pending, room)
    views = [job_view(js, sim.spec.in_place_resize) for js in running + handed]
    before = {name: dict(b.gpus_by_node) for name, b in sim.snap.bindings().items()}
    # J for Pollux's fair-share speedup: every job waiting or running, not only those handed over.
    for d in sim.allocator.allocate(sim.snap, views, sim.now, cluster_jobs=len(sim.active()),
                                    also_ranked=_left_out_remaining(sim, running + handed)):
        js = sim.by_name[d.job]
        if d.action == "keep":
            if d.local_batch and d.local_batch != js.local_batch:
                js.sync(sim.now)
                js.local_batch = d.local_batch  # a batch change needs no restart (AdaptDL)
                js.refresh_rate()
            continue
        if d.action == "pending":
            continue
        if d.action == "preempt":
            js.sync(sim.now)
            js.status, js.replicas, js.on_lender, js.rate = "pending", 0, 0, 0.0
            js.preemptions += 1
            sim.totals.preemptions += 1
            continue
        where = placement.Placement(d.assignments)
        js.on_lender = sum(1 for n in where.assignments if sim.node_vc[n] == INFER)
        if js.status != "running":
            js.status, js.admitted_at = "running", sim.now
            js.started = sim.now if js.started is None else js.started
        local = d.local_batch or max(1.0, js.job.family.base_batch / d.replicas)
        # A grow or shrink of a running job keeps its processes where the runtime can (Huorn's
        # in-place resizing) and only where the replicas that stay keep their nodes, as the
        # operator keeps a gang's pods and places only the new ones. The allocator places a
        # resized gang afresh; a placement that moves a staying replica, or a move at the same
        # size, is a restart. A first start or one after preemption is a full restart either way.
        kept = d.action in ("grow", "shrink") and _keeps_nodes(
            before.get(d.job, {}), where.gpus_by_node(js.job.family.gpus_per_replica), d.action == "grow")
        js.configure(d.replicas, where.nodes_spanned, local, sim.now, restart=True,
                     in_place=sim.spec.in_place_resize and kept)
        if d.action in ("grow", "shrink"):
            js.last_resize, js.last_direction = sim.now, 1 if d.action == "grow" else -1

