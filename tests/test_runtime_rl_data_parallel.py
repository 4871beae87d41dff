"""Data-parallel training actors of an RLJob: the shares of a mini-batch give the whole one's
loss and gradient, a group of trainers over a real local Ray cluster (gloo) updates exactly as one
trainer does, and it grows and shrinks between steps without a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rl_batches import SPEC, make_batch

from huorn.api import rl
from huorn.runtime.rl import algorithms, pools, workers


@pytest.mark.parametrize("aggregation", ["token", "sequence"])
def test_the_shares_of_a_mini_batch_add_up_to_the_whole(aggregation: str) -> None:
    """Each share divides by the whole mini-batch's tokens or sequences: the parts' values and
    gradients sum to the whole's, even with a share of one group and an empty one."""
    spec = rl.AlgorithmSpec.model_validate({"name": "grpo", "lossAggregation": aggregation})
    settings = algorithms.resolve(spec)
    assert settings.aggregation == aggregation
    g = torch.Generator().manual_seed(1)
    rows, width = 6, 5
    new = torch.randn(rows, width, generator=g, requires_grad=True)
    old, reference = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    advantage = torch.randn(rows, generator=g)
    mask = (torch.rand(rows, width, generator=g) > 0.3).float()
    mask[:, 0] = 1
    whole = algorithms.policy_loss(new, old, advantage, mask, settings, reference)
    whole.loss.backward()
    want = new.grad.clone()
    new.grad = None
    totals = algorithms.Totals(float(mask.sum()), rows)
    parts = []
    for part in (slice(0, 1), slice(1, 6), slice(6, 6)):
        if part.start == part.stop:
            continue  # an empty share adds nothing
        parts.append(algorithms.policy_loss(new[part], old[part], advantage[part], mask[part], settings,
                                            reference[part], totals))
        parts[-1].loss.backward()
    assert sum(float(p.loss.detach()) for p in parts) == pytest.approx(float(whole.loss.detach()), rel=1e-6)
    assert sum(p.kl for p in parts) == pytest.approx(whole.kl, rel=1e-6)
    assert sum(p.clip_fraction for p in parts) == pytest.approx(whole.clip_fraction, rel=1e-6)
    torch.testing.assert_close(new.grad, want, rtol=1e-5, atol=1e-7)


def test_shares_cover_the_items_once_in_order_and_differ_by_at_most_one() -> None:
    for n in range(0, 9):
        for world in (1, 2, 3, 4):
            parts = [workers.share(list(range(n)), r, world) for r in range(world)]
            assert [i for p in parts for i in p] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the module's Ray tests: a start costs several seconds of CPU on
    a small machine. Each test kills the actors it made (_kill), so the next finds its CPUs free."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="huorn-dp-test")
    try:
        yield
    finally:
        ray.shutdown()


def _kill(*groups: Any) -> None:
    import ray

    for group in groups:
        for actor in [*group.members, *(actor for actor, _ in group.starting)]:
            ray.kill(actor)


def _params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in state.items()}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_trainer_group_updates_as_one_trainer_and_resizes_between_steps(
        tmp_path: Path, ray_cluster: None) -> None:
    """Two trainers (gloo) take one step's update as one trainer takes it; a third joins with
    rank 0's policy and optimiser state, handed over through Ray's object store, and the next
    update still matches; shrunk back to one, it goes on alike. The hand-overs write no checkpoint;
    the one rank 0 saves while the group is up, a new group resumes from."""
    import ray

    alone = workers.PolicyTrainer(SPEC, None, str(tmp_path / "alone"), "cpu")
    groups: list[pools.TrainerGroup] = []
    try:
        group = pools.TrainerGroup("actorTrain", lambda: ray.remote(workers.PolicyTrainer).options(
            num_cpus=0.5).remote(SPEC, None, str(tmp_path / "group"), "cpu"), 2)
        groups.append(group)
        ray.get([a.__ray_ready__.remote() for a in group.members])
        group.form()

        def check(step: int, size: int) -> None:
            batch = make_batch(step)
            want = alone.update(batch)
            got = group.update(batch)
            assert got["trainers"] == size and want["trainers"] == 1 and got["updates"] == want["updates"]
            for key in ("loss", "policy_loss", "kl", "clip_fraction", "grad_norm"):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
            states = [_params(s) for s in ray.get([a.weights.remote() for a in group.members])]
            mine = _params(alone.weights())
            for name, value in mine.items():
                torch.testing.assert_close(states[0][name], value, rtol=1e-4, atol=1e-5)
                for other in states[1:]:  # every member holds the same bits
                    assert torch.equal(other[name], states[0][name]), name

        check(0, 2)
        # rank 0 alone writes the checkpoint while the group is up (no collective it would wait in)
        saved = Path(group.save(1, "dp"))
        at_save = ray.get(group.weights())
        group.resize(3)
        while len(group.members) < 3:
            group.admit()
        assert group.formed == 3
        check(1, 3)
        group.resize(1)
        group.admit()
        assert len(group.members) == 1 and group.formed == 1
        check(2, 1)
        assert [p.name for p in (tmp_path / "group").iterdir() if p.name.startswith("step")] == [saved.name]

        # A new group resumes from it: its rank 0 reads it. (One trainer, a process importing
        # torch fewer: that the others then take rank 0's state is the same TrainerGroup.resume
        # that test_only_rank_0_reads_the_init_checkpoint_and_the_group_starts_from_it runs.)
        again = pools.TrainerGroup("actorTrain", lambda: ray.remote(workers.PolicyTrainer).options(
            num_cpus=0.5).remote(SPEC, None, str(tmp_path / "group"), "cpu"), 1)
        groups.append(again)
        again.form()
        assert again.resume() == 1
        for state in ray.get([a.weights.remote() for a in again.members]):
            for name, value in at_save.items():
                assert torch.equal(state[name], value), name
    finally:
        _kill(*groups)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_lost_trainer_fails_the_update_at_once_and_stops_the_others(
        tmp_path: Path, ray_cluster: None) -> None:
    """A member that dies (its node gone) leaves the others in the update's all-reduce until the
    group's 300 s timeout; the group finds it among the answers, stops the others and raises, so
    the controller fails now and is run again from the last checkpoint."""
    import time

    import ray

    group = pools.TrainerGroup("actorTrain", lambda: ray.remote(workers.PolicyTrainer).options(
        num_cpus=0.5, max_restarts=0).remote(SPEC, None, str(tmp_path / "group"), "cpu"), 2)
    try:
        group.form()
        group.update(make_batch(0))
        ray.kill(group.members[1])
        started = time.monotonic()
        with pytest.raises(ray.exceptions.RayActorError):
            group.update(make_batch(1))
        assert time.monotonic() - started < 60  # not the collective's 300 s
        with pytest.raises(ray.exceptions.RayActorError):  # the survivor was stopped too
            ray.get(group.members[0].weights.remote(), timeout=60)
    finally:
        _kill(group)


def test_a_joiner_takes_a_copy_of_the_state_not_the_live_moments(tmp_path: Path) -> None:
    """state() is a snapshot: a trainer that loads it and the one that gave it go on alike (it
    once handed out the live Adam moments on CPU, which both then stepped)."""
    giver = workers.PolicyTrainer(SPEC, None, str(tmp_path / "a"), "cpu")
    giver.update(make_batch(0))
    joiner = workers.PolicyTrainer(SPEC, None, str(tmp_path / "b"), "cpu")
    joiner.load_state(giver.state())
    assert giver.update(make_batch(1)) == joiner.update(make_batch(1))
    for name, value in giver.weights().items():
        assert torch.equal(joiner.weights()[name], value), name


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_only_rank_0_reads_the_init_checkpoint_and_the_group_starts_from_it(
        tmp_path: Path, ray_cluster: None) -> None:
    """The controller's trainers: only rank 0 is given spec.initCheckpoint, the other takes rank
    0's state at the start (so its node needs no copy of the checkpoint): both hold its weights,
    not the seed's fresh ones."""
    import ray

    from huorn.runtime.rl import controller

    source = workers.PolicyTrainer(SPEC, None, str(tmp_path / "init"), "cpu")
    source.update(make_batch(0))  # weights no fresh trainer of the seed has
    source.save(1, "init")
    cfg = controller.RLRunConfig.model_validate({
        "jobName": "dp-init", "runDir": str(tmp_path / "run"), "checkpointDir": str(tmp_path / "ckpt"),
        "evalPrompts": 0,  # on the module's cluster (ray_cluster), of 2 CPUs
        "spec": {**SPEC, "initCheckpoint": str(tmp_path / "init"), "algorithm": {"name": "lite-ppo"},
                 "roles": {"actorTrain": {"replicas": 2}, "rollout": {"replicas": 1}}}})
    run = controller.Controller(cfg)
    try:
        assert run.trainers.resume() == 0  # no checkpoint of its own yet: the init is the start
        held = ray.get([a.weights.remote() for a in run.trainers.members])
    finally:
        _kill(*run.pools)
    want = source.weights()
    for weights in held:
        for name, value in want.items():
            assert torch.equal(weights[name], value), name
