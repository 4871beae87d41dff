"""PeerWatch: the heartbeats that find a dead peer of an in-place NCCL gang, on a real TCPStore."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from huorn.runtime.peer_watch import PeerWatch


@pytest.fixture()
def store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))


def client(master: dist.TCPStore) -> dist.Store:
    """A connection of its own per member, as in a gang, under one round's prefix."""
    own = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    return dist.PrefixStore("round-7/", own)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_whose_counter_stands_still_past_the_timeout_is_dead(store: dist.TCPStore) -> None:
    clock = FakeClock()
    watches = [PeerWatch(client(store), rank, 3, lambda dead: None, interval_s=1, timeout_s=5, clock=clock)
               for rank in range(3)]
    for _ in range(10):  # all three beat for 10 s: nobody is dead
        clock.now += 1
        assert [w.check() for w in watches] == [[], [], []]
    # Rank 2 stops beating. Its last beat came after the others' looks at t = 10, so they saw it
    # move at t = 11: dead once more than 5 s have passed since, at t = 17 and not before.
    for _ in range(6):
        clock.now += 1
        assert [w.check() for w in watches[:2]] == [[], []]
    clock.now += 1
    assert [w.check() for w in watches[:2]] == [[2], [2]]


def test_a_peer_that_never_beats_is_dead_after_the_timeout_from_the_first_look(store: dist.TCPStore) -> None:
    clock = FakeClock()
    watch = PeerWatch(client(store), 0, 2, lambda dead: None, interval_s=1, timeout_s=5, clock=clock)
    assert watch.check() == []
    clock.now += 5
    assert watch.check() == []
    clock.now += 0.5
    assert watch.check() == [1]


def test_the_thread_reports_a_stopped_peer_once_and_then_ends(store: dist.TCPStore) -> None:
    reported: list[list[int]] = []
    found = threading.Event()

    def on_lost(dead: list[int]) -> None:
        reported.append(dead)
        found.set()

    survivor = PeerWatch(client(store), 0, 2, on_lost, interval_s=0.05, timeout_s=0.5).start()
    victim = PeerWatch(client(store), 1, 2, lambda dead: None, interval_s=0.05, timeout_s=0.5).start()
    try:
        assert not found.wait(1.0), "a live peer was reported dead"
        victim.stop()
        assert found.wait(5.0), "the stopped peer was not reported"
        survivor._thread.join(timeout=5)
        assert not survivor._thread.is_alive()
        assert reported == [[1]] and survivor.lost == [1]
    finally:
        survivor.stop()
        victim.stop()


def test_bad_settings_name_the_field() -> None:
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    with pytest.raises(ValueError, match="rank"):
        PeerWatch(master, 2, 2, lambda dead: None)
    with pytest.raises(ValueError, match="interval_s < timeout_s"):
        PeerWatch(master, 0, 2, lambda dead: None, interval_s=5, timeout_s=5)
