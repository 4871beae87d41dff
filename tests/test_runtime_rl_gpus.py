"""How the RL controller asks Ray for GPUs: a colocation group's model roles share its GPUs, so
the actors fit what the API counted for the job (before, each took whole GPUs, and a colocated
job the API accepted waited for GPUs that were never there until its start timeout)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.api import rl
from huorn.runtime.rl.controller import gpu_requests


def test_dedicated_roles_take_their_own_gpus() -> None:
    roles = rl.Roles(actor_train=rl.Role(gpus_per_replica=2), rollout=rl.Role(replicas=2),
                     reference=rl.Role())
    assert gpu_requests(roles, reference=True) == {"actorTrain": 2.0, "rollout": 1.0, "reference": 1.0}
    assert gpu_requests(roles, reference=False) == {"actorTrain": 2.0, "rollout": 1.0}


def test_a_colocation_group_shares_its_gpus_and_an_unlisted_reference_joins_the_trainer() -> None:
    shared = rl.Roles(actor_train=rl.Role(colocation_group="g"), rollout=rl.Role(colocation_group="g"))
    # three model actors on the one GPU the API counted for the group
    assert gpu_requests(shared, reference=True) == {"actorTrain": 1 / 3, "rollout": 1 / 3, "reference": 1 / 3}
    assert gpu_requests(shared, reference=False) == {"actorTrain": 0.5, "rollout": 0.5}
    # no group: the reference the API did not count shares the training actor's GPU
    plain = rl.Roles(actor_train=rl.Role(), rollout=rl.Role())
    assert gpu_requests(plain, reference=True) == {"actorTrain": 0.5, "rollout": 1.0, "reference": 0.5}
    # Ray takes fractions only up to 1: 4 GPUs over 3 roles is one whole GPU each
    big = rl.Roles(actor_train=rl.Role(gpus_per_replica=4, colocation_group="g"),
                   rollout=rl.Role(gpus_per_replica=4, colocation_group="g"),
                   reference=rl.Role(gpus_per_replica=4, colocation_group="g"))
    assert gpu_requests(big, reference=True) == {"actorTrain": 1.0, "rollout": 1.0, "reference": 1.0}


ROLE = st.builds(rl.Role, replicas=st.integers(1, 4), gpus_per_replica=st.integers(0, 8),
                 colocation_group=st.sampled_from([None, "a", "b"]))


@settings(max_examples=300, deadline=None)
@given(ROLE, ROLE, st.one_of(st.none(), ROLE), st.booleans())
def test_the_actors_never_ask_more_than_the_api_counted(train: rl.Role, rollout: rl.Role,
                                                        reference: rl.Role | None, kl: bool) -> None:
    train = train.model_copy(update={"replicas": 1})  # the runtime trains with one actor
    roles = rl.Roles(actor_train=train, rollout=rollout, reference=reference)
    asked = gpu_requests(roles, reference=kl)
    replicas = {"actorTrain": 1, "rollout": rollout.replicas, "reference": 1}  # one reference actor
    total = sum(replicas[name] * gpus for name, gpus in asked.items())
    assert total <= rl.count_gpus_needed(roles) + 1e-9
    assert all(0 <= gpus <= 1 or gpus == int(gpus) for gpus in asked.values())  # what Ray accepts
