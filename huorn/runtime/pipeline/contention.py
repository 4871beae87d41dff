"""Network contention for experiments, and the link thread every pipeline send goes through.

Contention is a documented throttle in the send path, not background traffic: on a shared
CPU box, background traffic steals cores before it steals bandwidth, and on NVLink it would
take enormous volumes to matter, so neither measures what Ada-Grouper is about (a network
preempted by other tenants). The throttle models the link as a queue that background
tenants keep busy a fraction `level` (0 to 0.8) of the time, with bursts of `burst_s` each,
and a message of b bytes is held back, before its real send starts, by

    burst_s · level / (1 − level)                       queueing behind background bursts (M/M/1)
  + b · level / ((1 − level) · bandwidth_bytes_s)        its bytes getting only a (1 − level) share

which is zero at level 0 (the real link alone), grows as 1/(1 − level), and at 80% is
4 × burst_s plus 4 × the message's emulated transfer time. Links are FIFO: one thread per
direction of each pipeline edge sleeps out the delay and then sends, so a message also waits
for those ahead of it, while the compute thread carries on. The level can change at any
time, e.g. from a per-step callback.

A link also has its own `extra_s`, seconds added to each of its messages whatever the level:
fault injection's `slow-link` (huorn/runtime/faults.py) slows one direction of one edge, where
the throttle is shared by all of a stage's links. It is slept out in the same place as the
throttle's delay, so it is measured in the same seconds per message.

Every send goes through a link whatever the level, so that the time each message held its
link (delay + real transfer) is measured the same way with and without contention; that is the
point-to-point figure the planner's cost model is calibrated from. There are two links:

- `LinkSender` (gloo, CPU): a host thread per link sleeps out the delay, then sends.
- `StreamLink` (NCCL, GPU): no host thread at all. Each link owns a CUDA stream that waits for
  the compute stream at the moment of the send, spins `delay` on the GPU (`torch.cuda._sleep`),
  then sends; stream order keeps the link FIFO and CUDA events time it. A host thread on GPU
  woke up once per message, then re-launched the send and blocked on the stream: on NVLink,
  where a message takes tens of microseconds, that hand-off cost more than the transfer, and
  the 2×H200 benchmark measured the executor 18% behind torch's single-threaded schedules."""

from __future__ import annotations

import math
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

MAX_LEVEL = 0.8


@dataclass
class Throttle:
    level: float = 0.0
    burst_s: float = 0.005
    bandwidth_bytes_s: float = math.inf

    def __post_init__(self) -> None:
        self.set_level(self.level)
        if not self.bandwidth_bytes_s > 0:
            raise ValueError(f"Throttle.bandwidth_bytes_s must be > 0, got {self.bandwidth_bytes_s}")
        if self.burst_s < 0:
            raise ValueError(f"Throttle.burst_s must be >= 0, got {self.burst_s}")

    def set_level(self, level: float) -> None:
        if not 0.0 <= level <= MAX_LEVEL:
            raise ValueError(f"contention level must be in 0..{MAX_LEVEL} (0–80%), got {level}")
        self.level = float(level)

    def delay_s(self, nbytes: int) -> float:
        busy = self.level / (1.0 - self.level)
        return busy * (self.burst_s + nbytes / self.bandwidth_bytes_s)


@dataclass
class LinkStats:
    messages: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    samples: list[float] = field(default_factory=list)  # each message's seconds, in order
    host_timed: bool = False  # timed by a host thread's clock (LinkSender), not CUDA events

    def record(self, nbytes: int, seconds: float) -> None:
        self.messages += 1
        self.nbytes += nbytes
        self.seconds += seconds
        self.samples.append(seconds)

    @property
    def seconds_per_message(self) -> float:
        """The mean: the time the link was held, which a slow link's fault detection sums."""
        return self.seconds / self.messages if self.messages else 0.0

    @property
    def typical_s(self) -> float:
        """What the k planner prices a message at. A host thread's clock: the median message. On
        a CPU box one message of a step's eight often waits 2-8 ms for a thread to get a core
        while the others take 0.1-0.2 ms (measured, 2 gloo stages): the mean read a calm link
        as a preempted one and predicted kFkB gains where there were none. CUDA events have no
        such noise, and there the mean stays: contention that holds fewer than half of a step's
        messages is still contention, which a median would price as a calm link."""
        if self.host_timed and self.samples:
            return statistics.median(self.samples)
        return self.seconds_per_message


@dataclass
class _Item:
    tensor: torch.Tensor
    tag: int
    ready: torch.cuda.Event | None = field(default=None)
    done: threading.Event | None = field(default=None)


class LinkSender:
    """One direction of one pipeline edge: a FIFO of outgoing messages served by one thread.

    NB: the thread keeps each tensor referenced until its send completed, so the compute
    thread may drop its own reference right after `send`."""

    def __init__(self, peer: int, group: dist.ProcessGroup, throttle: Throttle, device: torch.device) -> None:
        self.peer, self.group, self.throttle, self.device = peer, group, throttle, device
        self.extra_s = 0.0  # per message, on top of the throttle's delay (module docstring)
        self._queue: queue.Queue[_Item | None] = queue.Queue()
        self._stats = LinkStats(host_timed=True)
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"huorn-link-to-{peer}", daemon=True)
        self._thread.start()

    def send(self, tensor: torch.Tensor, tag: int, done: threading.Event | None = None) -> None:
        """Queue `tensor` for the peer; `done` (if given) is set once it has been delivered."""
        self._raise_if_failed()
        ready = None
        if tensor.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        self._queue.put(_Item(tensor, tag, ready, done))

    def drain(self) -> None:
        """Block until every queued message has been delivered (end of a step)."""
        self._queue.join()
        self._raise_if_failed()

    def take_stats(self) -> LinkStats:
        with self._lock:
            stats, self._stats = self._stats, LinkStats(host_timed=True)
        return stats

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"link to rank {self.peer} failed") from self._error

    def _serve(self) -> None:
        stream = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:
                    self._deliver(item, stream)
            except BaseException as error:
                self._error = error
            finally:
                self._queue.task_done()

    def _deliver(self, item: _Item, stream: torch.cuda.Stream | None) -> None:
        if item.ready is not None:
            item.ready.synchronize()
        start = time.perf_counter()
        delay = self.throttle.delay_s(item.tensor.numel() * item.tensor.element_size()) + self.extra_s
        if delay > 0:
            time.sleep(delay)
        if stream is not None:
            with torch.cuda.stream(stream):
                dist.isend(item.tensor, dst=self.peer, group=self.group, tag=item.tag).wait()
            stream.synchronize()
        else:
            dist.isend(item.tensor, dst=self.peer, group=self.group, tag=item.tag).wait()
        elapsed = time.perf_counter() - start
        with self._lock:
            self._stats.record(item.tensor.numel() * item.tensor.element_size(), elapsed)
        if item.done is not None:
            item.done.set()


def make_link(peer: int, group: dist.ProcessGroup, throttle: Throttle,
              device: torch.device) -> LinkSender | StreamLink:
    """The link for this device: stream-ordered on CUDA, a host thread elsewhere."""
    if device.type == "cuda":
        return StreamLink(peer, group, throttle, device)
    return LinkSender(peer, group, throttle, device)


@dataclass
class _InFlight:
    tensor: torch.Tensor
    nbytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class StreamLink:
    """One direction of one pipeline edge on a GPU, ordered by a CUDA stream instead of a thread.

    The same contract as `LinkSender`: `send` returns at once, the link is FIFO, `drain` ends
    a step and `take_stats` reports seconds per message (delay, waiting for the receiver and
    transfer, from CUDA events). NB: a sent tensor stays referenced until `drain`, and is
    recorded on the link's stream, so the caching allocator cannot hand its memory to the
    compute stream while NCCL still reads it."""

    def __init__(self, peer: int, group: dist.ProcessGroup, throttle: Throttle, device: torch.device) -> None:
        self.peer, self.group, self.throttle, self.device = peer, group, throttle, device
        self.stream = torch.cuda.Stream(device)
        self.extra_s = 0.0  # per message, on top of the throttle's delay (module docstring)
        self._cycles_per_s = 0.0
        self._in_flight: list[_InFlight] = []
        self._stats = LinkStats()

    def send(self, tensor: torch.Tensor, tag: int, done: threading.Event | None = None) -> None:
        if done is not None:
            raise ValueError("StreamLink.send: `done` is not supported on CUDA; wait on drain()")
        nbytes = tensor.numel() * tensor.element_size()
        delay = self.throttle.delay_s(nbytes) + self.extra_s
        if delay > 0 and not self._cycles_per_s:
            self._cycles_per_s = gpu_sleep_rate(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record()
            if delay > 0:
                torch.cuda._sleep(int(delay * self._cycles_per_s))
            dist.isend(tensor, dst=self.peer, group=self.group, tag=tag).wait()
            end.record()
        tensor.record_stream(self.stream)
        self._in_flight.append(_InFlight(tensor, nbytes, start, end))

    def drain(self) -> None:
        """Make the compute stream wait for every send of the step (the host does not block)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def take_stats(self) -> LinkStats:
        """Seconds per message need the events: this blocks until the step's sends are done."""
        for item in self._in_flight:
            item.end.synchronize()
            self._stats.record(item.nbytes, item.start.elapsed_time(item.end) / 1000.0)
        self._in_flight = []
        stats, self._stats = self._stats, LinkStats()
        return stats

    def close(self) -> None:
        self.stream.synchronize()
        self._in_flight = []


def gpu_sleep_rate(device: torch.device) -> float:
    """GPU clock cycles per second of `torch.cuda._sleep`, to turn a delay into cycles."""
    # a private stream, so that the measurement neither waits for queued compute nor for a
    # receive the compute stream is waiting on
    # NB: an idle H200 sits at a low SM clock and a lone spinning kernel raises it only after a
    # while; counted at the idle clock, every later delay ran several times too short. Spin
    # first, then count.
    with torch.cuda.device(device), torch.cuda.stream(torch.cuda.Stream(device)):
        torch.cuda._sleep(100_000_000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        return 20_000_000 / (start.elapsed_time(end) / 1000.0)
