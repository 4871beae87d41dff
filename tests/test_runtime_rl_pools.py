"""A role's actors as the RL controller scales them between steps (huorn.runtime.rl.pools), with
stand-in actors on a small local Ray cluster: what joins, what is stopped, and what an actor
that never starts, or fails to, does to the pool."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray")

from huorn.runtime.rl import pools  # noqa: E402


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="huorn-pools-test")
    try:
        yield
    finally:
        ray.shutdown()


def _worker_class() -> type:
    """A stand-in worker (defined here so that Ray ships it by value): `fail` makes its
    constructor raise, as one whose node went while it started or whose model did not fit."""
    class Worker:
        def __init__(self, fail: bool = False) -> None:
            if fail:
                raise RuntimeError("no room for the policy on this node")

        def ping(self) -> int:
            return 1

    return Worker


def _trainer_class() -> type:
    """A stand-in PolicyTrainer: the group calls, no torch.distributed."""
    class Trainer:
        def __init__(self, fail: bool = False) -> None:
            if fail:
                raise RuntimeError("no room for the policy on this node")
            self.value, self.world = 0, 1

        def size(self) -> int:  # the process group it is in (1: none)
            return self.world

        def state(self) -> int:
            return self.value

        def load_state(self, value: int) -> None:
            self.value = value

        def leave_group(self) -> None:
            self.world = 1

        def host_group(self) -> tuple[str, int]:
            return "127.0.0.1", 1

        def join_group(self, rank: int, world: int, host: str, port: int) -> int:
            self.world = world
            return rank

    return Trainer


def _settle(pool: pools.ActorPool, timeout: float = 30.0) -> None:
    """admit until nothing is starting (every new actor started or failed)."""
    deadline = time.monotonic() + timeout
    while pool.starting:
        assert time.monotonic() < deadline, "the new actors neither started nor failed"
        pool.admit()
        time.sleep(0.05)


@pytest.mark.parametrize("group", [False, True], ids=["rollout", "actorTrain"])
def test_an_actor_that_fails_to_start_is_dropped_and_asked_for_again(cluster: None, group: bool) -> None:
    """It was admitted as a member: the controller's next call to it (a generate, a trainer's
    load_state when the group formed) failed the whole job, and a trainer group stopped every
    member with it. Now it is dropped with the reason, the job goes on with those it has, and
    the next resize to the config file's count asks for it again."""
    cls = _trainer_class() if group else _worker_class()
    fail = [False]

    def new_actor() -> Any:
        return ray.remote(cls).options(num_cpus=0.1).remote(fail[0])

    kind = pools.TrainerGroup if group else pools.ActorPool
    pool = kind("actorTrain" if group else "rollout", new_actor, 1)
    ray.get([a.__ray_ready__.remote() for a in pool.members])
    if group:
        pool.form()
    fail[0] = True
    pool.resize(2)
    _settle(pool)
    assert len(pool.members) == 1 and pool.wanted == 1
    assert len(pool.failed) == 1 and "no room for the policy" in pool.failed[0]
    if group:
        assert ray.get(pool.members[0].state.remote()) == 0  # rank 0 is still up
        assert pool.formed == 1
    else:
        assert ray.get([m.ping.remote() for m in pool.members]) == [1]
    fail[0] = False
    pool.resize(2)  # the controller's next step boundary: the file still says 2
    _settle(pool)
    assert len(pool.members) == 2
    if group:
        assert pool.formed == 2


def test_a_trainer_ray_never_starts_leaves_the_group_as_is_until_the_file_asks_fewer(cluster: None) -> None:
    """Not a fix, the behaviour the controller relies on: a trainer that Ray cannot place (no
    CPU or GPU for it) waits in `starting` while the group trains at its size; the file asking
    fewer again stops it first (the group is not re-formed); shrinking to one while another
    starts stops both and leaves no process group; growing again re-forms at the new size."""
    cls = _trainer_class()
    cpus = [0.1]

    def new_actor() -> Any:
        return ray.remote(cls).options(num_cpus=cpus[0]).remote()

    group = pools.TrainerGroup("actorTrain", new_actor, 2)
    ray.get([a.__ray_ready__.remote() for a in group.members])
    group.form()
    first = list(group.members)
    cpus[0] = 64  # more than the cluster has: Ray never starts it
    group.resize(3)
    group.admit()
    assert (len(group.members), len(group.starting), group.formed) == (2, 1, 2)
    group.resize(2)  # the file asks 2 again before it started
    group.admit()
    assert (group.members, group.starting, group.formed) == (first, [], 2)
    group.resize(3)
    group.admit()
    group.resize(1)  # to one while the third still starts: it and the newest member go
    group.admit()
    assert (group.members, group.starting, group.formed) == (first[:1], [], 1)
    assert ray.get(first[0].size.remote()) == 1
    cpus[0] = 0.1
    group.resize(2)
    _settle(group)
    assert len(group.members) == 2 and group.members[0] == first[0] and group.formed == 2
    assert ray.get([a.size.remote() for a in group.members]) == [2, 2]
