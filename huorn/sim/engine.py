"""Discrete-event simulation of one policy on one cluster, running the real scheduler code.

Events are arrivals, completions, scheduling ticks (60 s, Pollux's interval), QPS bins (5 min) and
the return of reclaimed GPUs. Between events every running job progresses at its true rate, so
completions land at their exact time; the scheduler runs on ticks only, and only on ticks where
something changed (or every fifth tick for the elastic policies, whose noise scales drift). The
engine owns the ClusterSnapshot that the policies decide against. Policies never see a job's true
step-time curve, only telemetry samples of it, and of its gradient noise scale only the runtime's
reading, drawn each tick with the runtime's measured error (state.py's docstring).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from huorn.scheduler import allocator, perfmodel, placement, snapshot
from huorn.sim import inference, policies, state, workload

TRAIN, INFER = "train", "infer"


@dataclass(frozen=True)
class SimConfig:
    gpus: int
    seed: int = 0
    inference_share: float = 0.25
    load: float = 0.8
    tick_seconds: float = 60.0
    reclaim_grace_seconds: float = 30.0
    qps_start: str = "middle"  # where the QPS series starts playing: middle or beginning
    elastic_range: int = 1  # multiplies every job's elastic range (workload.load_jobs); 1 is the rule
    restart_cost: float = 1.0  # multiplies every job's restart time (workload.load_jobs); 1 is the rule
    # How wrong each job's declared total work is (σ of its log; workload.declared_factor) and the
    # share of jobs that declare none: a study of Huorn's JCT terms; 0 and 0 are exact.
    work_estimate_error: float = 0.0
    undeclared_share: float = 0.0
    # How long the policies keep a job's noise-scale reading before a fresh one (state.JobState.
    # read_noise_scale): a tick by default, since the runtime's reading decorrelates within about
    # 40 steps (benchmarks/noise_scale_reading.py); longer is a study of how much the readings'
    # jitter costs the elastic policies.
    noise_reading_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.gpus < 8:
            raise ValueError(f"gpus must be ≥ 8, got {self.gpus}")
        if self.seed < 0:  # numpy's own message ("expected non-negative integer") names no field
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        if not 0 < self.inference_share < 1:
            raise ValueError(f"inference_share must lie in (0, 1), got {self.inference_share}")
        if not self.load > 0:
            raise ValueError(f"load must be > 0, got {self.load}")
        if self.qps_start not in ("middle", "beginning"):
            raise ValueError(f"qps_start must be middle or beginning, got {self.qps_start!r}")
        if self.elastic_range < 1:
            raise ValueError(f"elastic_range must be >= 1, got {self.elastic_range}")
        if self.restart_cost < 0:
            raise ValueError(f"restart_cost must be >= 0, got {self.restart_cost}")
        if self.work_estimate_error < 0:
            raise ValueError(f"work_estimate_error must be >= 0, got {self.work_estimate_error}")
        if not 0 <= self.undeclared_share <= 1:
            raise ValueError(f"undeclared_share must lie in [0, 1], got {self.undeclared_share}")
        if not self.noise_reading_seconds > 0:
            raise ValueError(f"noise_reading_seconds must be > 0, got {self.noise_reading_seconds}")


@dataclass
class Totals:
    slo_requests: float = 0.0
    slo_served: float = 0.0
    train_gpu_seconds: float = 0.0
    infer_gpu_seconds: float = 0.0
    lost_gpu_seconds: float = 0.0  # what work rolled back to its last checkpoint had cost
    # GPUs a reclaim's victim still holds (its checkpoint write and exit) after the signal: they
    # train nothing and serve nothing until they are back
    reclaim_held_gpu_seconds: float = 0.0
    preemptions: int = 0
    series: list[tuple[float, int, int, int, int, float]] = field(default_factory=list)
    series_work: list[tuple[float, float]] = field(default_factory=list)  # (t, trace GPU-s done)
    # (t, train_gpu_seconds so far): the GPUs running jobs held, borrowed ones and restart pauses
    # included, sampled with series_work; the report's mean GPUs in use over a window
    series_gpu_seconds: list[tuple[float, float]] = field(default_factory=list)
    finished_work: float = 0.0


class Simulation:
    def __init__(self, jobs: list[workload.TrainingJob], nodes: list[workload.Node],
                 load: inference.InferenceLoad, spec: policies.PolicySpec, config: SimConfig):
        self.spec, self.config, self.load = spec, config, load
        self.rng = np.random.default_rng(config.seed)
        infer_names = _pick_inference_nodes(nodes, load.gpus)
        self.infer_gpus = sum(n.gpus for n in nodes if n.name in infer_names)
        if self.infer_gpus != load.gpus:  # the load would be sized for a cluster it does not have
            raise ValueError(f"the inference load is sized for {load.gpus} GPUs, but whole nodes give the "
                             f"inference cluster {self.infer_gpus}; size it with split_cluster")
        self.node_vc = {n.name: INFER if n.name in infer_names else TRAIN for n in nodes}
        # the training nodes by name: the order AdaptDL's arrival admission tries them in
        self.train_nodes = sorted(n.name for n in nodes if n.name not in infer_names)
        views = [placement.NodeView(n.name, n.gpus, n.gpus, virtual_cluster=self.node_vc[n.name])
                 for n in nodes]
        lends = spec.loaning != "none"
        self.infer_view = snapshot.VirtualClusterView(
            INFER, "inference", lendable=lends, max_gpus_lent=self.infer_gpus if lends else 0,
            reclaim_grace_seconds=config.reclaim_grace_seconds)
        train_view = snapshot.VirtualClusterView(TRAIN, max_gpus_borrowed=self.infer_gpus if lends else 0)
        self.snap = snapshot.ClusterSnapshot(views, [train_view, self.infer_view])
        self.train_gpus = self.snap.capacity(TRAIN)
        shape = {j.name: (j.requested_replicas, j.family.gpus_per_replica) for j in jobs}
        fitting = {s for s in set(shape.values()) if _fits(views, *s)}  # one check per gang shape
        self.left_out = [j.name for j in jobs if shape[j.name] not in fitting]
        jobs = [j for j in jobs if shape[j.name] in fitting]
        if not jobs:
            raise ValueError(f"no job of the trace fits the {len(views)} node(s) sampled for --gpus "
                             f"{config.gpus} (seed {config.seed}); use more --gpus or another --seed")
        ordered = sorted(jobs, key=lambda j: (j.arrival, j.name))
        self.jobs = [state.JobState(j, belief=self._belief(j)) for j in ordered]
        self.by_name = {js.job.name: js for js in self.jobs}
        self.allocator = allocator.Allocator(spec.allocator)
        # (time, GPUs, binding): reclaimed GPUs a victim still holds, bound on the snapshot
        # until then under a name of their own
        self.returns: list[tuple[float, int, str]] = []
        self._held = 0
        self.totals = Totals()
        self.now = 0.0
        self.live: list[state.JobState] = []
        self._running_gpus = 0

    def _belief(self, job: workload.TrainingJob) -> perfmodel.PerfModel | None:
        if not self.spec.elastic:
            return None
        return initial_belief(job, self.spec.priors)

    # ------------------------------------------------------------------ bookkeeping used by policies
    def active(self) -> list[state.JobState]:
        """Pending and running jobs, in arrival order."""
        return self.live

    def inflight_returns(self) -> int:
        return sum(g for t, g, _ in self.returns if t > self.now)

    def infer_available(self) -> int:
        return self.infer_gpus - self.snap.lent(INFER) - self.inflight_returns()

    def bind(self, js: state.JobState, where: placement.Placement, replicas: int, local: float,
             restart: bool) -> None:
        gpr = js.job.family.gpus_per_replica
        self.snap.assume(js.job.name, TRAIN, where, gpr)
        on_lender = sum(1 for n in where.assignments if self.node_vc[n] == INFER)
        if js.status != "running":
            js.status, js.admitted_at = "running", self.now
            js.started = self.now if js.started is None else js.started
        js.on_lender = on_lender
        js.configure(replicas, where.nodes_spanned, local, self.now, restart, self.spec.in_place_resize)

    def unbind(self, js: state.JobState, requeue: bool, lose_work: bool) -> None:
        js.sync(self.now)
        if js.job.name in self.snap.bindings():
            self.snap.forget(js.job.name)
        if lose_work:
            self.totals.lost_gpu_seconds += js.lose_since_checkpoint()
        if requeue:
            js.status, js.replicas, js.on_lender, js.rate = "pending", 0, 0, 0.0
            js.preemptions += 1
            self.totals.preemptions += 1

    def hold_returns(self, gpus_on: list[str], until: float, job: str) -> None:
        """Keep the GPUs of `gpus_on` (one node name per GPU) held by `job` until `until`, each as
        its own cluster's (they lend nothing while held, and they are not free). Those on the
        lender count as returns to inference."""
        if not gpus_on or until <= self.now:
            return
        self.totals.reclaim_held_gpu_seconds += len(gpus_on) * (until - self.now)
        for vc in (INFER, TRAIN):
            nodes = [n for n in gpus_on if self.node_vc[n] == vc]
            if not nodes:
                continue
            self._held += 1
            name = f"returning:{job}:{self._held}"
            self.snap.assume(name, vc, placement.Placement(nodes), 1)
            self.returns.append((until, len(nodes) if vc == INFER else 0, name))
        self.snap.commit()

    def set_lend_limit(self, gpus: int) -> None:
        self.snap.set_virtual_cluster(snapshot.VirtualClusterView(
            INFER, "inference", lendable=self.infer_view.lendable, max_gpus_lent=max(0, gpus),
            reclaim_grace_seconds=self.config.reclaim_grace_seconds))

    # ------------------------------------------------------------------ the loop
    def run(self, progress: Callable[[float], None] | None = None) -> list[state.JobState]:
        arrivals = [js.job.arrival for js in self.jobs]
        nxt, finished, total = 0, 0, len(self.jobs)
        next_tick, next_bin, next_reading = 0.0, 0.0, 0.0
        dirty, last_full = True, -math.inf
        running: list[state.JobState] = []
        while finished < total:
            # Each finish time is computed once per event: nothing below changes a running job's
            # progress before the completion check uses the same values.
            # (JobState.finish_time inlined: every job in `running` is running; this is the
            # engine's innermost loop.)
            fins = [max(js.synced, js.busy_until) + (js.job.work - js.done) / js.rate if js.rate > 0
                    else math.inf for js in running]
            t_fin = min(fins, default=math.inf)
            t_ret = min((t for t, _, _ in self.returns if t > self.now), default=math.inf)
            t_arr = arrivals[nxt] if nxt < total else math.inf
            t = min(t_fin, t_ret, t_arr, next_tick, next_bin)
            self._account(self.now, t, running)
            self.now = t
            event = False  # an arrival or a completion: what event-driven admission reacts to
            first_arrival = nxt
            while nxt < total and arrivals[nxt] <= t:
                self.jobs[nxt].status = "pending"
                self.live.append(self.jobs[nxt])
                nxt, dirty, event = nxt + 1, True, True
            for js, fin in zip(running, fins, strict=True):
                if fin <= t + 1e-6:
                    js.sync(t)
                    js.done, js.status, js.finished = js.job.work, "done", t
                    self.totals.finished_work += js.reference_gpu_seconds
                    self.unbind(js, requeue=False, lose_work=False)
                    js.replicas, js.rate = 0, 0.0
                    self.allocator.forget_job(js.job.name)
                    finished, dirty, event = finished + 1, True, True
            for rt, _, held in self.returns:
                if rt <= t:  # a victim has gone: its GPUs are free, as after a completion
                    self.snap.forget(held)
                    self.snap.commit()
                    dirty, event = True, True
            self.returns = [r for r in self.returns if r[0] > t]
            if t >= next_bin:
                next_bin = self.load.next_bin_time(t)
                for js in running:
                    js.sync(t)
                dirty = True
                policies.react_to_load(self)
            admit = self.spec.event_admission and event and t < next_tick
            # AdaptDL's admission reacts to arrivals only; at a tick the cycle sees them anyway
            admit_arrived = self.spec.arrival_admission and nxt > first_arrival and t < next_tick
            if t >= next_tick:
                next_tick = t + self.config.tick_seconds
                read = t >= next_reading
                if read:
                    next_reading = t + self.config.noise_reading_seconds
                for js in running:
                    js.sync(t)
                    js.refresh_rate()
                    if read or js.noise_reading == 0:  # a job's first reading comes at once
                        js.read_noise_scale(t)
                    if js.maybe_report(t, self.rng):
                        dirty = True
                full_due = self.spec.elastic and t - last_full >= 5 * self.config.tick_seconds
                if dirty or full_due:
                    policies.schedule(self)
                    dirty, last_full = False, t
                self.totals.series.append((t, sum(js.gpus for js in running), self.snap.lent(INFER),
                                           self.load.need_at(t), self.infer_available(),
                                           sum(js.rate > 0 for js in running)))
                # a job that ended at t is in finished_work already, and still in self.live
                live_work = sum(js.reference_gpu_seconds for js in self.live
                                if js.done > 0 and js.status != "done")
                self.totals.series_work.append((t, self.totals.finished_work + live_work))
                self.totals.series_gpu_seconds.append((t, self.totals.train_gpu_seconds))
                if progress is not None:
                    progress(finished / total)
            if admit and any(js.status == "pending" for js in self.live):
                policies.admit(self)  # dirty stays set: the next tick still runs the full cycle
            if admit_arrived:
                policies.admit_arrivals(self, self.jobs[first_arrival:nxt])
            self.live = [js for js in self.live if js.status != "done"]
            running = [js for js in self.live if js.status == "running"]
            self._running_gpus = sum(js.gpus for js in running)
        # the last job ends after the last tick: without this sample the series stopped short of
        # the trace's whole work, and goodput over a window past the last tick missed the rest
        if not self.totals.series_work or self.totals.series_work[-1][0] < self.now:
            self.totals.series_work.append((self.now, self.totals.finished_work))
            self.totals.series_gpu_seconds.append((self.now, self.totals.train_gpu_seconds))
        return self.jobs

    def _account(self, t0: float, t1: float, running: list[state.JobState]) -> None:
        if t1 <= t0:
            return
        dt = t1 - t0
        self.totals.train_gpu_seconds += self._running_gpus * dt
        need = self.load.need_at(t0)
        avail = self.infer_available()
        # inference uses what it needs of what it has: GPUs still on loan are training's
        self.totals.infer_gpu_seconds += min(need, max(avail, 0)) * dt
        requests = self.load.requests_per_second(t0) * dt
        self.totals.slo_requests += requests
        self.totals.slo_served += requests * (1.0 if need <= avail else max(0, avail) / need)


PRIORS = ("generic", "operator", "family")


def operator_prior_family(job: workload.TrainingJob) -> str:
    """The prior family Huorn's operator would start this job from (perfmodel.runtime_prior_family,
    which its `prior_model` uses too): its `moe` jobs are MoE models, every other family a dense
    decoder as far as the operator can tell. Until the review of 2026-12-07 the simulator's Huorn
    started each job from its own family's curve (a cnn job from cnn's), the centre of the
    distribution the true curves are drawn from, which no operator can pick."""
    return perfmodel.runtime_prior_family(job.family.name == "moe")


def initial_belief(job: workload.TrainingJob, priors: str) -> perfmodel.PerfModel:
    """A job's performance model before its first measurement, by PolicySpec.priors.

    - "generic": the transformer curve for every job, unanchored (Pollux: AdaptDL starts every job
      from one generic model and learns its own from telemetry);
    - "operator": what Huorn's operator picks (`operator_prior_family`), anchored to the measured
      level as prior_model anchors it (PerfModel.anchor_prior): the family gives the shape, the
      measurements the level. The catalogue's family curve stands for the operator's prior scaled
      to the model's size, which the simulator's jobs do not have;
    - "family": the job's own family curve (an LLM job's is the transformer's, as
      workload.PRIOR_FAMILY says), unanchored: a study's upper end, what no scheduler knows."""
    if priors == "generic":
        return perfmodel.PerfModel("transformer", prior=workload.FAMILIES["transformer"].params)
    if priors == "operator":
        fam = operator_prior_family(job)
        return perfmodel.PerfModel(fam, prior=workload.FAMILIES[fam].params, anchor_prior=True)
    if priors == "family":
        fam = workload.PRIOR_FAMILY.get(job.family.name, job.family.name)
        return perfmodel.PerfModel(fam, prior=workload.FAMILIES[fam].params)
    raise ValueError(f"priors {priors!r} is unknown; use one of {PRIORS}")


def _fits(views: list[placement.NodeView], replicas: int, gpus_per_replica: int) -> bool:
    """Whether a gang of this shape fits the empty training nodes at all. A small cluster can sample
    only nodes smaller than one of the trace's pods (at 16 GPUs, seed 0: 2-GPU training nodes and
    an 8-GPU pod), and a job no policy can ever place would keep the simulation running forever:
    such jobs are left out of every policy's run alike (`Simulation.left_out`, in the report)."""
    train = [v for v in views if v.virtual_cluster == TRAIN]
    empty = snapshot.ClusterSnapshot(train, [snapshot.VirtualClusterView(TRAIN)])
    return isinstance(empty.place(TRAIN, replicas, gpus_per_replica), placement.Placement)


MIN_INFERENCE_GPUS = 8  # one whole 8-GPU node: an inference replica is big


@dataclass(frozen=True)
class Split:
    """The sampled nodes shared between the two virtual clusters. The inference cluster takes whole
    nodes, so it can hold more GPUs than `--inference-share` asks; the inference load and the
    training load are both sized for what each cluster really holds (`infer_gpus`, `train_gpus`).
    They were sized for the share asked: at 100 GPUs the 32 inference GPUs served a load sized for
    25, and the training load was compressed for 75 GPUs where 68 train (found by review)."""

    inference: frozenset[str]
    infer_gpus: int
    train_gpus: int
    asked: int  # the GPUs the share asks for, rounded, at least MIN_INFERENCE_GPUS

    def note(self, config: SimConfig) -> str | None:
        """What a user who gave `--inference-share` should know: the split is not what it asked."""
        share = round(config.gpus * config.inference_share)
        pct = 100 * self.infer_gpus / config.gpus
        real = f"{self.infer_gpus} GPUs ({pct:.0f} %), training {self.train_gpus}"
        if share < MIN_INFERENCE_GPUS:
            return (f"--inference-share {config.inference_share:g} asks {share} of {config.gpus} GPUs, fewer "
                    f"than the inference cluster's least (one {MIN_INFERENCE_GPUS}-GPU node): inference gets "
                    f"{real}; both loads are sized for that")
        if self.infer_gpus != self.asked:
            return (f"--inference-share {config.inference_share:g} asks {self.asked} of {config.gpus} GPUs; "
                    f"the inference cluster takes whole nodes, so it gets {real}; both loads are sized for "
                    "that")
        return None


def split_cluster(nodes: list[workload.Node], config: SimConfig) -> Split:
    """Which nodes serve inference (whole nodes, biggest first, until the share is reached), and
    the GPUs left to train. ValueError, naming the flags, when none are left to train."""
    asked = max(MIN_INFERENCE_GPUS, round(config.gpus * config.inference_share))
    names = _pick_inference_nodes(nodes, asked)
    infer = sum(n.gpus for n in nodes if n.name in names)
    train = sum(n.gpus for n in nodes if n.name not in names)
    if train < 1:
        raise ValueError(
            f"--gpus {config.gpus} with --inference-share {config.inference_share:g}: the inference cluster "
            f"takes all {infer} GPUs (whole nodes, at least {MIN_INFERENCE_GPUS}), leaving none to train; "
            "give more --gpus or a smaller --inference-share")
    return Split(frozenset(names), infer, train, asked)


def _pick_inference_nodes(nodes: list[workload.Node], gpus: int) -> set[str]:
    """Whole 8-GPU nodes first (inference replicas are big), until the share is reached."""
    chosen: set[str] = set()
    total = 0
    for n in sorted(nodes, key=lambda n: (-n.gpus, n.name)):
        if total >= gpus:
            break
        chosen.add(n.name)
        total += n.gpus
    return chosen
