"""Fault injection: make chosen ranks slow or hung, inside or outside collectives, on demand.

The remediation detectors (hang and fail-slow) are tested against these, so each fault mimics
one of C4's four classes: `slow-compute` and `hang-compute` act between collectives (a slow or
stuck GPU kernel), `slow-comm` and `hang-collective` act inside the DDP communication hook
after the collective's sequence number was entered (a slow link, a stuck NIC). `slow-link` is
the pipeline's own slow network: the data-parallel collectives of a pipelined job are few and
the traffic that a slow link between two stages holds up is point-to-point, so it delays the
messages a rank sends to its neighbour stages, in the executor's send path where contention is
injected (`link_delays`). Faults come from
the run config and from `faults.json` in the run dir, which a harness may rewrite at any time;
the file is re-read at every step and while a hang blocks, so removing a hang releases it.

A `slow-compute` with `factor` instead of `ms` scales the rank's own measured compute: a fixed
delay is a large slowdown on a fast host and a small one on a loaded host, where every step is
slower, so a detector or a planner tested against it saw a different fault on each machine.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from huorn.runtime import config as run_config

_HANG_POLL_S = 0.5


class FaultInjector:
    def __init__(self, configured: list[run_config.Fault], run_dir: Path, rank: int,
                 replica: str | None) -> None:
        self.configured = list(configured)
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.replica = replica
        self.step = 0
        self._file_faults: list[run_config.Fault] = []
        self._file_mtime: float | None = None
        self._lock = threading.Lock()
        self.last_compute_s = 0.0  # the rank's last step's compute, without what was injected
        self._slept_this_step = 0.0

    def refresh(self) -> None:
        """Re-read the control file when it changed; a file that does not parse keeps the last
        good set, so a harness caught mid-write cannot switch faults off by accident."""
        path = self.run_dir / run_config.FAULTS_FILE
        try:
            mtime = os.stat(path).st_mtime_ns
        except FileNotFoundError:
            with self._lock:
                self._file_faults, self._file_mtime = [], None
            return
        if mtime == self._file_mtime:
            return
        faults = run_config.read_faults_file(self.run_dir)
        if faults is not None:
            with self._lock:
                self._file_faults, self._file_mtime = faults, mtime

    def active(self, kind: str) -> run_config.Fault | None:
        with self._lock:
            candidates = [*self.configured, *self._file_faults]
        for fault in candidates:
            if fault.kind == kind and fault.applies(self.step, self.rank, self.replica):
                return fault
        return None

    def _block_while(self, kind: str) -> None:
        while self.active(kind) is not None:
            time.sleep(_HANG_POLL_S)
            self.refresh()

    def _sleep(self, seconds: float) -> None:
        """Sleep, and count what was slept as measured: on a loaded host a sleep overruns (7 ms of
        40 once, in the suite), and counting only what was asked left the overrun in the rank's
        own compute, which the next step's `factor` then multiplied."""
        if seconds > 0:
            started = time.perf_counter()
            time.sleep(seconds)
            self._slept_this_step += time.perf_counter() - started

    def before_compute(self) -> None:
        """Called by the training loop at the start of every step's compute. A whole-step
        `factor` sleeps for the compute the rank's last step did itself ((factor − 1) times it):
        a step's own compute is known only once it ran, and the last one is the closest."""
        self._slept_this_step = 0.0
        slow = self.active("slow-compute")
        if slow is not None and not slow.per_micro_batch and not slow.per_layer:
            self._sleep((slow.factor - 1) * self.last_compute_s if slow.factor else slow.ms / 1000.0)
        self._block_while("hang-compute")

    def after_step(self, compute_s: float) -> None:
        """Called with a step's compute (its time less that inside collectives and waits), so a
        `factor` scales what the rank computes, not what it was made to sleep."""
        self.last_compute_s = max(0.0, compute_s - self._slept_this_step)

    def before_micro_batch(self) -> None:
        """Called before each micro-batch's forward: a slower device costs time per unit of work,
        which is what S2 (moving micro-batches away from the slow rank) can win back."""
        slow = self.active("slow-compute")
        if slow is not None and slow.per_micro_batch and not slow.factor:
            self._sleep(slow.ms / 1000.0)

    def after_micro_batch(self, compute_s: float) -> None:
        """Called after each micro-batch's forward and backward with their compute (collectives
        excluded): a perMicroBatch `factor` stretches it to factor times."""
        slow = self.active("slow-compute")
        if slow is not None and slow.per_micro_batch and slow.factor:
            self._sleep((slow.factor - 1) * compute_s)

    def before_layer(self) -> None:
        """Called before each decoder layer's forward: on a pipeline stage the delay then moves
        with the layers, which is what S3 (re-splitting the layers) can win back."""
        slow = self.active("slow-compute")
        if slow is not None and slow.per_layer:
            self._sleep(slow.ms / 1000.0)

    def inside_collective(self) -> None:
        """Called by the communication hook after entering a collective, before it runs."""
        slow = self.active("slow-comm")
        if slow is not None:
            time.sleep(slow.ms / 1000.0)
        self._block_while("hang-collective")

    def link_delays(self) -> tuple[float, float]:
        """Seconds to add to every message this rank sends to the next stage and to the previous
        one during this step. The executor's links sleep them out in the send path, like
        contention, so the slowdown is seen where a slow link shows: in the seconds per message
        of that link alone, and in the waits of the stages behind it, not in anybody's compute."""
        forward = backward = 0.0
        with self._lock:
            candidates = [*self.configured, *self._file_faults]
        for fault in candidates:
            if fault.kind == "slow-link" and fault.applies(self.step, self.rank, self.replica):
                if fault.direction in (None, "forward"):
                    forward += fault.ms / 1000.0
                if fault.direction in (None, "backward"):
                    backward += fault.ms / 1000.0
        return forward, backward
