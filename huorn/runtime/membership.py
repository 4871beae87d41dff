"""In-place resizing: the worker process stays alive when the gang changes.

torchrun restarts every worker of a gang whenever its membership changes: a replica that joins
makes all the others stop, start a new Python process, import torch, build the model and load the
last checkpoint, which is what a resize costs (docs/benchmarks.md, "Elastic recovery"). In
in-place mode a replica is one trainer process that takes part in torch.distributed.elastic's c10d
rendezvous itself, through the same `DynamicRendezvousHandler` torchrun's agent uses, against the
same stand-alone store (`huorn.runtime.store`):

- a newcomer does its slow start-up (imports, model, optimizer) *before* it enters the
  rendezvous's wait list, while the gang keeps training;
- the gang sees the waiting node at a step boundary (`waiting()`), agrees on it through the step's
  statistics all-reduce, and every member calls `next_round()` from inside its loop;
- each round gets a fresh process group on the rendezvous store under its own key prefix, so no
  rank hosts a store that the others depend on;
- the members' state then reaches the newcomers by broadcast from one member
  (`Trainer.share_state`), not from a checkpoint.

A graceful leaver stops its keep-alive heartbeats and exits (`leave()`): the heartbeats lapse
after `keep_alive_interval × keep_alive_max_attempt` and the survivors' next round forms without
it. A failed peer is found the same way once a collective has raised; the survivors keep the
state of the last step they all finished.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

from huorn.runtime import launcher
from huorn.runtime.peer_watch import PeerWatch


@dataclass(frozen=True)
class Round:
    """One formed gang: this process's rank in it, its size, and the store its process group uses."""

    rank: int
    world: int
    store: dist.Store


class Membership:
    """This process's seat in the elastic gang, across rounds of the c10d rendezvous."""

    def __init__(self, settings: launcher.ElasticSettings) -> None:
        if settings.nproc_per_node != 1:
            raise ValueError("in-place resizing runs one trainer process per replica: set "
                             f"nproc_per_node to 1 (got {settings.nproc_per_node})")
        params = RendezvousParameters(
            backend="c10d", endpoint=settings.rdzv_endpoint, run_id=settings.rdzv_id,
            min_nodes=settings.min_nodes, max_nodes=settings.max_nodes, local_addr=settings.local_addr,
            **launcher.rdzv_conf(settings))
        # Without this the handler makes rank 0 of every round host a TCP store for the others:
        # the single point of failure the stand-alone store exists to avoid (launcher docstring).
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        self.settings = settings
        self.handler = registry.get_rendezvous_handler(params)

    def next_round(self) -> Round:
        """Leave the current round (if any) and block until the next one forms; a process may
        call this any number of times. The process group of the round is this process's to make."""
        info = self.handler.next_rendezvous()
        # NB: the handler already prefixes the store with the rendezvous's round number, the
        # same on every member and different from every earlier round's.
        store = dist.PrefixStore("huorn/process-group/", info.store)
        return Round(info.rank, info.world_size, store)

    def watch(self, round_: Round, on_lost: Callable[[list[int]], None], timeout_s: float) -> PeerWatch:
        """Heartbeats of this round's members (huorn.runtime.peer_watch), on a store connection of
        this process's own, under a key the round's members agree on through the round's store."""
        if round_.rank == 0:
            round_.store.set("huorn/peer-watch-token", uuid.uuid4().hex)
        token = round_.store.get("huorn/peer-watch-token").decode()
        host, _, port = self.settings.rdzv_endpoint.rpartition(":")
        own = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        store = dist.PrefixStore(f"huorn/peer-watch/{token}/", own)
        return PeerWatch(store, round_.rank, round_.world, on_lost, timeout_s=timeout_s).start()

    def reconnected(self) -> Membership:
        """This seat on new connections to the store, for a gang whose own broke (a store that
        restarted never answers them again): the old handler's keep-alive stops first."""
        self.leave()
        return Membership(self.settings)

    def waiting(self) -> int:
        """Nodes in the wait list for the next round: replicas ready to join."""
        return self.handler.num_nodes_waiting()

    def leave(self) -> None:
        """Stop this node's keep-alive heartbeats before the process exits; the survivors' next
        round forms without it, as it would once the heartbeats lapsed.

        NB: the handler beats from a daemon thread that calls into the store's C++ client. Left
        running, it could be inside such a call when the interpreter finalises; CPython then ends
        the thread with a forced unwind through pybind11's noexcept frames, and C++ aborts the
        process ("terminate called without an active exception", SIGABRT instead of the leaver's
        exit code; seen in the in-place test). torch has no public way to stop the heartbeats of
        a node that stays out of the next round, so this uses the handler's own `_stop_heartbeats`
        (what its `next_rendezvous` and `shutdown` call), which joins the thread."""
        stop = getattr(self.handler, "_stop_heartbeats", None)
        if stop is not None:
            stop()

    def close(self) -> None:
        """Mark the rendezvous closed: the job is over, and no node may join any more."""
        self.handler.shutdown()


def init_round_process_group(backend: str, round_: Round, timeout_s: float) -> None:
    """The process group of one round, on the rendezvous store under the round's prefix."""
    dist.init_process_group(backend=backend, store=round_.store, rank=round_.rank,
                            world_size=round_.world, timeout=timedelta(seconds=timeout_s))


def join_next_round(gang: Membership, probe_timeout_s: float) -> tuple[Membership, Round]:
    """The gang's next round, on a new store connection where this seat's broke while the store
    answers a new one (it restarted: c10d's client never reconnects), whatever regroup this is:
    a leave, a lost peer or a join. Returns the seat the round was formed on, and the round."""
    try:
        return gang, gang.next_round()
    except Exception as error:  # RendezvousConnectionError, DistStoreError
        if not store_answers(gang.settings.rdzv_endpoint, timeout_s=probe_timeout_s):
            raise
        print(f"huorn: the rendezvous store dropped this member's connection ({error}); joining "
              "on a new one", file=sys.stderr, flush=True)
        gang = gang.reconnected()
        return gang, gang.next_round()


def store_answers(endpoint: str, timeout_s: float = 5.0) -> bool:
    """Whether the store at `endpoint` takes a new connection now."""
    host, _, port = endpoint.rpartition(":")
    try:
        dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    except Exception:  # DistNetworkError, timeouts: down (or not there yet)
        return False
    return True
