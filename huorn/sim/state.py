"""What the simulator tracks per job, and the truth it measures policies against.

The truth (a job's real Pollux curve, its real noise scale) lives here. A policy's step times
come only from its own performance model, fed by the telemetry samples the engine reports, as the
operator's would. Its gradient noise scale is what the runtime reports (`JobState.noise_reading`):
none (0, as the goodput policy starts) until the job has trained, then the true one with the
runtime's measured error, drawn afresh each tick. Every elastic policy, Huorn and Pollux alike,
reads the same reading of a job at the same time. Until 2026-12-07 they read the true value.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np

from huorn.scheduler import allocator, perfmodel
from huorn.sim import workload

NOISE_GROWTH = 4.0  # the noise scale grows to (1 + this)× its start by the end of training [Pollux §2]
MEASURE_SECONDS = 120.0  # a configuration reports a step time once it has run this long
CHECKPOINT_EVERY = 600.0  # periodic checkpoint interval (seconds of progress)
TELEMETRY_NOISE = 0.05  # log-normal σ of a reported step time
IN_PLACE_RESIZE_SHARE = allocator.IN_PLACE_RESIZE_SHARE  # the policies' price of an in-place resize
# Log-normal σ of one step's noise-scale reading, on one GPU (two halves of its micro-batches,
# runtime.solo_noise) and on two or more (each rank against the reduced gradient): the median
# spread across data seeds of the runtime's own reading at the same step
# (benchmarks/noise_scale_reading.py).
NOISE_READING_SIGMA_ALONE = 0.31
NOISE_READING_SIGMA = 0.29
# Fixed standard normal draws, indexed by job and time: a job's reading at a time is the same
# under every policy, and costs no generator call.
_READING_ERRORS = np.random.default_rng(20261207).standard_normal(4093)


@dataclass
class JobState:
    job: workload.TrainingJob
    belief: perfmodel.PerfModel | None = None
    status: str = "future"  # future | pending | running | done
    replicas: int = 0
    nodes: int = 0
    on_lender: int = 0  # replicas on nodes of the inference virtual cluster
    local_batch: float = 0.0
    rate: float = 0.0  # base-batch samples per second, true
    done: float = 0.0
    done_at_checkpoint: float = 0.0
    last_checkpoint: float = 0.0
    busy_until: float = 0.0  # restarting until then: holds GPUs, makes no progress
    config_since: float = 0.0
    last_resize: float = -math.inf
    last_direction: int = 0
    admitted_at: float = 0.0
    started: float | None = None
    finished: float | None = None
    model_version: int = 0
    reported: set[tuple[int, int, float]] = field(default_factory=set)
    gpu_seconds: float = 0.0
    # GPU-seconds held while paused for a restart: the first start's, and every later one's
    # (resizes, restarts after preemption, a reclaim's shrink). Held, they make no progress.
    start_gpu_seconds: float = 0.0
    restart_gpu_seconds: float = 0.0
    first_pause: bool = False  # the pause until busy_until is the job's first start
    restarts: int = 0
    preemptions: int = 0
    synced: float = 0.0  # progress is accounted up to this time; it is linear in between
    # The true step time of a configuration never changes; the engine asks for it every tick.
    _step_cache: dict[tuple[int, int, float], float] = field(default_factory=dict, repr=False)
    # A pending job's admission key (model version, progress, key): it only changes when they do.
    admission_key: tuple[int, float, float] | None = field(default=None, repr=False)
    # What the runtime last reported of the gradient noise scale: 0 until the job has trained.
    noise_reading: float = 0.0
    _reading_offset: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self._reading_offset = zlib.crc32(self.job.name.encode())

    @property
    def gpus(self) -> int:
        return self.replicas * self.job.family.gpus_per_replica

    @property
    def noise_scale(self) -> float:
        return self.job.noise_scale * (1 + NOISE_GROWTH * min(1.0, self.done / self.job.work))

    def read_noise_scale(self, t: float) -> None:
        """The runtime's reading at tick `t`: the true noise scale times a log-normal error, once
        the job has made progress (a job that has not trained has reported nothing)."""
        if self.done <= 0:
            return
        z = _READING_ERRORS[(self._reading_offset + int(t)) % len(_READING_ERRORS)]
        sigma = NOISE_READING_SIGMA if self.gpus >= 2 else NOISE_READING_SIGMA_ALONE
        self.noise_reading = self.noise_scale * math.exp(sigma * float(z))

    def true_step_time(self, replicas: int, nodes: int, local: float) -> float:
        key = (replicas, nodes, local)
        step = self._step_cache.get(key)
        if step is None:
            step = float(perfmodel.predict_step_time(self.job.truth, replicas, nodes, local))
            self._step_cache[key] = step
        return step

    def resize_seconds(self, in_place: bool) -> float:
        """The pause of resizing this job while it runs: a restart, or in place (one process per
        replica only) a share of one. Starting from nothing is always a full restart."""
        fam = self.job.family
        if in_place and self.replicas > 0 and fam.gpus_per_replica == 1:
            return fam.restart_seconds * IN_PLACE_RESIZE_SHARE
        return fam.restart_seconds

    def configure(self, replicas: int, nodes: int, local: float, now: float, restart: bool,
                  in_place: bool = False) -> None:
        """Run at a new size; a restart pauses progress for the family's restart time (less,
        resizing a running job in place)."""
        self.sync(now)
        pause = self.resize_seconds(in_place)
        self.replicas, self.nodes, self.local_batch = replicas, nodes, local
        self.config_since = now
        if restart:
            self.busy_until = now + pause
            self.first_pause = self.restarts == 0
            self.restarts += 1
        self.refresh_rate()

    def refresh_rate(self) -> None:
        if not self.replicas:
            self.rate = 0.0
            return
        step = self.true_step_time(self.replicas, self.nodes, self.local_batch)
        m = self.replicas * self.local_batch
        # goodput.efficiency in scalar float arithmetic: the same IEEE operations, without the
        # numpy call overhead that dominated the static policies' runs.
        noise = self.noise_scale
        eff = (noise + self.job.family.base_batch) / (noise + m)
        self.rate = m / step * eff

    def sync(self, t: float) -> None:
        """Account progress up to `t`; called only where the rate is about to change."""
        if self.status == "running" and t > self.synced:
            self.gpu_seconds += self.gpus * (t - self.synced)
            start = max(self.synced, self.busy_until)
            if t > start:
                self.done = min(self.job.work, self.done + self.rate * (t - start))
            if start > self.synced:  # paused from synced until min(t, busy_until)
                paused = self.gpus * (min(t, start) - self.synced)
                if self.first_pause:
                    self.start_gpu_seconds += paused
                else:
                    self.restart_gpu_seconds += paused
            if t - self.last_checkpoint >= CHECKPOINT_EVERY:
                self.done_at_checkpoint, self.last_checkpoint = self.done, t
        self.synced = max(self.synced, t)

    def finish_time(self, now: float) -> float:
        if self.status != "running" or self.rate <= 0:
            return math.inf
        return max(self.synced, self.busy_until) + (self.job.work - self.done) / self.rate

    def maybe_report(self, now: float, rng: np.random.Generator) -> bool:
        """Report a step-time sample once a configuration has run a measurement window."""
        if self.belief is None or self.status != "running":
            return False
        if now - max(self.config_since, self.busy_until) < MEASURE_SECONDS:
            return False
        key = (self.replicas, self.nodes, self.local_batch)
        if key in self.reported:
            return False
        self.reported.add(key)
        t = self.true_step_time(*key) * float(rng.lognormal(0, TELEMETRY_NOISE))
        self.belief.observe(perfmodel.Sample(self.replicas, self.nodes, self.local_batch, t))
        self.model_version += 1
        return True

    def lose_since_checkpoint(self) -> float:
        """Roll back to the last checkpoint; returns the GPU-seconds that work had cost (at the
        current rate and size: the progress time rolled back, not the pauses, counted apart)."""
        lost = self.done - self.done_at_checkpoint
        self.done = self.done_at_checkpoint
        return lost / self.rate * self.gpus if self.rate > 0 else 0.0

    @property
    def reference_gpu_seconds(self) -> float:
        """The job's progress in trace GPU-seconds (duration × requested GPUs × fraction done)."""
        return self.done / self.job.work * self.job.requested_gpus * self.job.duration
