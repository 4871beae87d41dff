"""Per-rank telemetry: Prometheus `/metrics` and a JSON `/telemetry` view on one small HTTP server.

The JSON view exists for the remediation detectors, which need what Prometheus cannot give
cheaply: the last N steps of this rank with step time split into compute and communication, and
the sequence numbers of the last collective entered and completed. In bulk-synchronous training
every rank enters collective k together, so a rank whose `entered` stops while its peers sit in
`entered > completed` is the one hung outside collectives, and a rank stuck with
`entered > completed` alone is hung inside one (C4's classification).

A pipeline stage's receives from its neighbours, its sends' delivery and its data-parallel
gradient all-reduce count here too (`huorn.runtime.comm.StepLedger`): a stage blocked on a hung
neighbour then sits at `entered > completed`, and the operation in flight names the neighbour
(`peer`, and `waiting_on` for the oldest such operation). Stages receive different numbers of
messages, so the ledger pads every rank's count to the same total per step: the numbers stay one
timeline across stages and replicas, which the comparison above needs.

The server runs in a daemon thread and reads state under a lock, so it keeps answering while
the training thread is blocked, which is exactly when a detector needs it.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import prometheus_client

_DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_HEARTBEAT_PERIOD_S = 1.0


class Telemetry:
    """Metrics and recent history of one rank. Thread-safe: the comm hook calls it from the
    autograd/gloo threads, the HTTP server from its own."""

    def __init__(self, job: str, rank: int, world_size: int, replica: str | None, history: int = 256) -> None:
        self.job, self.rank, self.world_size, self.replica = job, rank, world_size, replica
        self.registry = prometheus_client.CollectorRegistry()
        r = self.registry
        self.step_seconds = prometheus_client.Histogram(
            "huorn_step_seconds", "Wall time of one optimizer step", buckets=_DURATION_BUCKETS, registry=r)
        self.step_gauge = prometheus_client.Gauge("huorn_step", "Last completed global step", registry=r)
        self.tokens_per_second = prometheus_client.Gauge(
            "huorn_tokens_per_second", "Global training tokens per second, last step", registry=r)
        self.loss = prometheus_client.Gauge("huorn_loss", "Training loss of the last step", registry=r)
        self.collectives = prometheus_client.Counter(
            "huorn_collectives", "Collectives completed, by operation", ["op"], registry=r)
        self.collective_seconds = prometheus_client.Histogram(
            "huorn_collective_seconds", "Collective duration from entry to completion, by operation",
            ["op"], buckets=_DURATION_BUCKETS, registry=r)
        self.heartbeat = prometheus_client.Gauge(
            "huorn_heartbeat_timestamp_seconds", "Unix time of the last heartbeat of this rank", registry=r)
        self.noise_scale = prometheus_client.Gauge(
            "huorn_gradient_noise_scale", "Smoothed B_noise (sequences), McCandlish et al.", registry=r)
        self.seq_entered = prometheus_client.Gauge(
            "huorn_collective_seq_entered", "Sequence number of the last collective entered", registry=r)
        self.seq_completed = prometheus_client.Gauge(
            "huorn_collective_seq_completed", "Sequence number of the last collective completed", registry=r)
        self.world_gauge = prometheus_client.Gauge(
            "huorn_world_size", "Ranks in the current gang", registry=r)
        self.info = prometheus_client.Info("huorn_rank", "Identity of this rank", registry=r)
        self.info.info({"job": job, "rank": str(rank), "replica": replica or "", "pid": str(os.getpid())})
        self.world_gauge.set(world_size)
        self._lock = threading.Lock()
        self._entered = 0
        self._completed = 0
        # wall time of the last change of either sequence number: lets a hang detector that starts
        # watching late (a restarted operator) time a stall from when it began, not from its start
        self._changed = time.time()
        self._in_flight: dict[int, tuple[str, float, int | None]] = {}  # seq -> (op, started, peer)
        self._op_metrics: dict[str, tuple] = {}  # op -> its counter and histogram children
        self._comm_seconds = 0.0
        self._steps: collections.deque[dict] = collections.deque(maxlen=history)
        self._parameters: dict[str, object] = {}
        self._last_heartbeat = time.time()
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self.beat()

    def rejoin(self, rank: int, world_size: int) -> None:
        """A new round of an in-place resize: a new rank and world, and collective sequence numbers
        from 0 again on every member, so that newcomers and old members stay aligned for the hang
        detectors (they compare `entered` across ranks)."""
        with self._lock:
            self.rank, self.world_size = rank, world_size
            self._entered = self._completed = 0
            self._in_flight.clear()
            self._changed = time.time()
        self.seq_entered.set(0)
        self.seq_completed.set(0)
        self.world_gauge.set(world_size)
        self.info.info({"job": self.job, "rank": str(rank), "replica": self.replica or "",
                        "pid": str(os.getpid())})

    # -- collectives -------------------------------------------------------------------------
    def enter_collective(self, op: str, peer: int | None = None) -> int:
        """`peer`: the rank this operation waits for, where one is known (a point-to-point
        receive); `/telemetry` serves the oldest as `waiting_on`."""
        with self._lock:
            self._entered += 1
            seq = self._entered
            self._in_flight[seq] = (op, time.monotonic(), peer)
            self._changed = time.time()
        self.seq_entered.set(seq)
        return seq

    def complete_collective(self, seq: int, count_seconds: bool = True) -> float:
        """`count_seconds=False` for an operation whose wait the caller already adds to the step's
        communication time itself (a pipeline stage's receive and reduce waits)."""
        with self._lock:
            op, started, _ = self._in_flight.pop(seq)
            duration = time.monotonic() - started
            self._completed = max(self._completed, seq)
            if count_seconds:
                self._comm_seconds += duration
            self._changed = time.time()
            completed = self._completed
        self.seq_completed.set(completed)
        metrics = self._op_metrics.get(op)
        if metrics is None:  # labels() costs a lookup under a lock; a pipeline pays it per message
            metrics = self._op_metrics[op] = (self.collectives.labels(op=op),
                                              self.collective_seconds.labels(op=op))
        metrics[0].inc()
        metrics[1].observe(duration)
        return duration

    def skip_collectives(self, count: int) -> None:
        """Count `count` sequence numbers as entered and completed without an operation: a
        pipeline stage pads its step's operations to the number every stage is allotted
        (`comm.StepLedger`), so that all ranks' numbers agree again at the step's end."""
        if count <= 0:
            return
        with self._lock:
            self._entered += count
            self._completed += count
            self._changed = time.time()
            entered, completed = self._entered, self._completed
        self.seq_entered.set(entered)
        self.seq_completed.set(completed)

    def add_comm_seconds(self, seconds: float) -> None:
        """Waiting outside the wrapped collectives (a pipeline stage blocked on its neighbour's
        point-to-point message) is communication too: without it a stage that waits for a slow
        neighbour would look as slow as the neighbour, and S3 could not tell them apart."""
        with self._lock:
            self._comm_seconds += max(0.0, seconds)

    def comm_seconds_so_far(self) -> float:
        """Communication time since the last `take_comm_seconds`, without resetting it."""
        with self._lock:
            return self._comm_seconds

    def take_comm_seconds(self) -> float:
        """Communication time accumulated since the last call (one step's worth)."""
        with self._lock:
            seconds, self._comm_seconds = self._comm_seconds, 0.0
        return seconds

    # -- steps and heartbeat -----------------------------------------------------------------
    def beat(self) -> None:
        with self._lock:
            self._last_heartbeat = time.time()
        self.heartbeat.set(self._last_heartbeat)

    def record_step(self, step: int, step_seconds: float, comm_seconds: float, loss: float,
                    tokens_per_second: float, noise_scale: float | None,
                    microbatch_seconds: float | None = None,
                    waits: Mapping[str, float] | None = None,
                    links: Mapping[str, float] | None = None,
                    global_batch: int | None = None, learning_rate: float | None = None,
                    tokens: int | None = None, noise_reading: str | None = None) -> None:
        """`microbatch_seconds`: compute seconds of one of this rank's micro-batches (forward and
        backward, collectives excluded). S2 plans from it: the step's compute also holds work
        that does not scale with the micro-batches (the optimizer step), which would make a
        rank holding few micro-batches look slow per micro-batch. `waits`: parts of
        `comm_seconds` by kind (a pipeline stage's receive and data-parallel reduce waits). The
        fail-slow detector needs them apart: a slow neighbour stage raises the receive wait, a
        slow replica the reduce wait, and only a wait that no compute slowdown explains is a slow
        link. `links`: a pipeline stage's outgoing links, seconds per message and messages
        (`send_link_*` to the next stage, `grad_link_*` to the previous); they run beside compute,
        so they are not part of `comm_seconds`. Behind a slow link every stage waits longer, but
        only that link's messages take longer: they say which link it is. `global_batch` and
        `learning_rate`: what the step trained with, the batch the goodput allocator's rule set
        for this many replicas and its scaled, scheduled rate (status.batchSize, learningRate).
        `world_size`: the ranks of the gang that took the step (the record outlives an in-place
        resize until the monitor reads it). `tokens`: tokens trained by the run so far, this
        step's included. The batch, and so a
        step's tokens, changes with the world under `scale-with-replicas`, so a run with a budget
        in tokens ends after fewer steps than the spec's globalBatch makes of it: the operator
        measures progress, the final step and the work left by this count, not by steps.
        `noise_reading`: how this step read the noise scale (`ranks`, or a world of one's `halves`
        or `first micro-batch`; none with one micro-batch), since the readings differ in quality."""
        comm = min(comm_seconds, step_seconds)
        record = {
            "step": step, "time": time.time(), "world_size": self.world_size, "step_seconds": step_seconds,
            "compute_seconds": step_seconds - comm, "comm_seconds": comm, "loss": loss,
            "tokens_per_second": tokens_per_second, "gradient_noise_scale": noise_scale,
        }
        if microbatch_seconds is not None:
            record["microbatch_seconds"] = microbatch_seconds
        if global_batch is not None:
            record["global_batch"] = global_batch
        if learning_rate is not None:
            record["learning_rate"] = learning_rate
        if tokens is not None:
            record["tokens"] = tokens
        if noise_reading is not None:
            record["gradient_noise_reading"] = noise_reading
        record.update(waits or {})
        record.update(links or {})
        with self._lock:
            self._steps.append(record)
        self.step_seconds.observe(step_seconds)
        self.step_gauge.set(step)
        self.loss.set(loss)
        self.tokens_per_second.set(tokens_per_second)
        if noise_scale is not None:
            self.noise_scale.set(noise_scale)
        self.beat()

    def set_parameter(self, name: str, value: object) -> None:
        """A run-time setting the monitor should see (per-rank micro-batch counts, the pipeline's k
        and the reason it was chosen); served under `parameters` until replaced."""
        with self._lock:
            self._parameters[name] = value

    def snapshot(self) -> dict:
        """What `/telemetry` serves."""
        now = time.monotonic()
        with self._lock:
            in_flight = [{"seq": s, "op": op, "seconds": now - t, **({"peer": p} if p is not None else {})}
                         for s, (op, t, p) in sorted(self._in_flight.items())]
            waiting_on = next((f["peer"] for f in in_flight if "peer" in f), None)
            return {
                "job": self.job, "rank": self.rank, "world_size": self.world_size, "replica": self.replica,
                "pid": os.getpid(), "heartbeat": self._last_heartbeat,
                "collective": {"entered": self._entered, "completed": self._completed,
                               "in_flight": in_flight, "waiting_on": waiting_on, "changed": self._changed},
                "steps": list(self._steps),
                "parameters": dict(self._parameters),
            }

    # -- server ------------------------------------------------------------------------------
    def serve(self, host: str, port: int) -> int:
        """Start the HTTP server and the heartbeat thread; returns the bound port."""
        telemetry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if path == "/metrics":
                    body = prometheus_client.generate_latest(telemetry.registry)
                    kind = prometheus_client.CONTENT_TYPE_LATEST
                elif path == "/telemetry":
                    body, kind = json.dumps(telemetry.snapshot()).encode(), "application/json"
                elif path == "/healthz":
                    body, kind = b"ok\n", "text/plain"
                else:
                    self.send_error(404, "try /metrics, /telemetry or /healthz")
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # keep the trainer's stderr for the trainer
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="huorn-telemetry", daemon=True).start()
        threading.Thread(target=self._beat_forever, name="huorn-heartbeat", daemon=True).start()
        return self._server.server_address[1]

    def _beat_forever(self) -> None:
        # NB: the heartbeat says the process is alive, not that it progresses; progress is the
        # collective sequence numbers and the step history.
        while not self._stop.wait(_HEARTBEAT_PERIOD_S):
            self.beat()

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def write_endpoint_file(run_dir: Path, replica: str | None, local_rank: int, info: dict) -> Path:
    """Publish where this rank's telemetry listens, atomically, as
    `<run_dir>/endpoints/<replica>-<local_rank>.json`; a supervisor lists the directory."""
    directory = Path(run_dir) / "endpoints"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{replica or 'local'}-{local_rank}.json"
    scratch = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(info) + "\n")
    os.replace(scratch, path)
    return path
