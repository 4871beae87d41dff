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
            self.value = 0

        def state(self) -> int:
            return self.value

        def load_state(self, value: int) -> None:
            self.value = value

        def leave_group(self) -> None:
            pass

        def host_group(self) -> tuple[str, int]:
            return "127.0.0.1", 1

        def join_group(self, rank: int, world: int, host: str, port: int) -> int:
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
