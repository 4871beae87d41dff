"""Finding a dead peer of an in-place NCCL gang while a collective waits on it, and ending the wait.

On gloo a lost peer closes its sockets, the collective raises, and the survivors regroup in their
own processes (`Trainer.recover`). NCCL reports nothing: over NVLink or shared memory a collective
whose peer was SIGKILLed spins until its timeout, and then torch's watchdog kills the process
(TORCH_NCCL_ASYNC_ERROR_HANDLING=1), so every survivor restarted from the last checkpoint.

Here each member of a round bumps its own counter on the rendezvous store about once a second
from a thread, over a store connection of its own (the main thread's connection may be blocked in
a store wait while a process group forms). A peer whose counter stands still for `timeout_s` is
dead. Counters, not timestamps: the hosts' clocks need not agree. The watcher then calls
`on_lost`, which marks the loss and aborts the process groups (ncclCommAbort, which spinning NCCL
kernels poll), and the training loop, which checks the mark before it applies a step, regroups
with the survivors as it does on gloo.

A false alarm costs a regroup, never correctness: the gang's next round forms with every process
that is still alive, and the newest state among them goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist


class PeerWatch:
    """Heartbeats of one round's members on a store; calls `on_lost(ranks)` once if any stop."""

    def __init__(self, store: dist.Store, rank: int, world: int, on_lost: Callable[[list[int]], None],
                 interval_s: float = 1.0, timeout_s: float = 15.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank must lie in [0, world) = [0, {world}), got {rank}")
        if not 0 < interval_s < timeout_s:
            raise ValueError(f"need 0 < interval_s < timeout_s, got {interval_s} and {timeout_s}")
        self.store, self.rank, self.world = store, rank, world
        self.on_lost, self.interval_s, self.timeout_s, self.clock = on_lost, interval_s, timeout_s, clock
        self.lost: list[int] | None = None
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # peer: (its counter, when it last moved)
        self._thread = threading.Thread(target=self._run, name=f"huorn-peer-watch-{rank}", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Ends the thread and waits for it, an abort it is making included: one that finished
        late could abort the next round's groups. A store that does not answer ends it too,
        within the store's timeout."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=120)

    def check(self) -> list[int]:
        """One heartbeat and one look at the peers; returns the ranks found dead now."""
        self.store.add(f"beat/{self.rank}", 1)
        now = self.clock()
        dead = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            count = int(self.store.add(f"beat/{peer}", 0))  # reads without blocking on a missing key
            last = self._seen.get(peer)
            if last is None or count != last[0]:
                self._seen[peer] = (count, now)
            elif now - last[1] > self.timeout_s:
                dead.append(peer)
        return dead

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                dead = self.check()
            except Exception:  # the store itself is gone: the rendezvous will say so to the main thread
                return
            if dead:
                self.lost = dead
                self.on_lost(dead)
                return
            self._stop.wait(self.interval_s)


class PeerLostError(RuntimeError):
    """A member of the gang stopped beating; its process groups were aborted."""
