"""How the RL controller asks Ray for GPUs: a colocation group's model roles share its GPUs, so
the actors fit what the API counted for the job (before, each took whole GPUs, and a colocated
job the API accepted waited for GPUs that were never there until its start timeout)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from huorn.api import rl
from huorn.runtime.rl import algorithms
from huorn.runtime.rl.controller import check_trainers_on_gpus, cpu_shares, gpu_requests, idle_reference


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
    roles = rl.Roles(actor_train=train, rollout=rollout, reference=reference)
    asked = gpu_requests(roles, reference=kl)
    # the actors each role runs (controller.role_replicas): trainers data-parallel, references as
    # listed (one where spec.roles leaves the role out)
    replicas = {"actorTrain": train.replicas, "rollout": rollout.replicas,
                "reference": max(1, reference.replicas) if reference is not None else 1}
    total = sum(replicas[name] * gpus for name, gpus in asked.items())
    assert total <= rl.count_gpus_needed(roles) + 1e-9
    assert all(0 <= gpus <= 1 or gpus == int(gpus) for gpus in asked.values())  # what Ray accepts


def test_data_parallel_trainers_never_share_a_gpu() -> None:
    """NCCL refuses two members of a group on one GPU: trainers whose colocation group gives each
    half a GPU are refused, naming the field and the fixes; whole GPUs each are fine."""
    shared = rl.Roles(actor_train=rl.Role(replicas=2, colocation_group="g"),
                      rollout=rl.Role(replicas=2, colocation_group="g"))
    share = gpu_requests(shared, reference=False)["actorTrain"]
    assert share == 0.5
    with pytest.raises(ValueError, match=r"^spec\.roles\.actorTrain: 2 data-parallel trainers would get "
                                         r"0\.5 GPU each .*colocation group of its own"):
        check_trainers_on_gpus(2, share)
    check_trainers_on_gpus(1, share)  # one trainer shares its GPU with the rollout worker, as before
    check_trainers_on_gpus(4, gpu_requests(rl.Roles(actor_train=rl.Role(replicas=4)), False)["actorTrain"])
    # a KL term with the reference left out: it shares the trainers' GPUs, so they get half each
    unlisted = gpu_requests(rl.Roles(actor_train=rl.Role(replicas=2)), reference=True)["actorTrain"]
    with pytest.raises(ValueError, match=r"list spec\.roles\.reference with GPUs of its own"):
        check_trainers_on_gpus(2, unlisted)
    listed = rl.Roles(actor_train=rl.Role(replicas=2), reference=rl.Role())
    check_trainers_on_gpus(2, gpu_requests(listed, reference=True)["actorTrain"])


def test_a_reference_no_algorithm_asks_is_named_with_its_idle_gpus() -> None:
    """DAPO has no KL term: a reference listed with GPUs holds them for nothing, which the
    controller says at its start (naming both fields and the fixes); GRPO's is used."""
    spec = rl.RLJobSpec.model_validate({"virtualCluster": "x", "algorithm": {"name": "dapo"},
                                        "roles": {"reference": {"replicas": 1, "gpusPerReplica": 2}}})
    notice = idle_reference(spec, algorithms.resolve(spec.algorithm))
    assert notice is not None
    assert notice.startswith("spec.roles.reference asks 1 x 2 GPU(s), but spec.algorithm (dapo) has no "
                             "KL term")
    assert "leave spec.roles.reference out" in notice
    grpo = spec.model_copy(update={"algorithm": rl.AlgorithmSpec(name=rl.Algorithm.GRPO)})
    assert idle_reference(grpo, algorithms.resolve(grpo.algorithm)) is None


def test_model_roles_share_the_cpus_of_the_gpu_nodes_they_can_run_on() -> None:
    """A head of 2 CPUs and a GPU worker of 1: three colocated model actors asked 0.92 CPU each
    (3 CPUs over 3.25 actors), and two never fitted on the worker; they now ask a third of its
    CPU. Without GPUs, or where GPU nodes have CPUs to spare, the cluster-wide share is kept."""
    counts = {"actorTrain": 1, "rollout": 1, "reference": 1, "reward": 1}
    head = {"Alive": True, "Resources": {"CPU": 2.0}}
    worker = {"Alive": True, "Resources": {"CPU": 1.0, "GPU": 1.0}}
    gone = {"Alive": False, "Resources": {"CPU": 64.0, "GPU": 8.0}}
    share, on_gpu = cpu_shares([head, worker, gone], counts, gpu=True)
    assert share == pytest.approx(3 / 3.25) and on_gpu == pytest.approx(1 / 3)
    assert 3 * on_gpu <= worker["Resources"]["CPU"]
    assert cpu_shares([head, worker], counts, gpu=False) == (pytest.approx(3 / 3.25),) * 2
    big = {"Alive": True, "Resources": {"CPU": 16.0, "GPU": 1.0}}
    assert cpu_shares([head, big], counts, gpu=True) == (1.0, 1.0)


def test_a_head_pods_controller_waits_for_its_worker_pods_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read at once, a GPU worker that joined a moment after the head was left unused; the
    controller now waits for the GPUs the operator says the pods bring, and names them if they
    never come. Only a head pod's first run waits: a local run or a KubeRay cluster (no variable)
    and a retry (the workers that are left) read the cluster as it is."""
    from huorn.backends.kubernetes import rl_manifests
    from huorn.runtime.rl import controller

    assert rl_manifests.WAIT_GPUS_ENV == controller.WAIT_GPUS_ENV  # the operator's name is the runtime's
    joined = iter([{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 3.0, "GPU": 1.0}])
    monkeypatch.setattr(controller.ray, "cluster_resources", lambda: next(joined))
    controller.wait_for_gpus(1, timeout_s=5, poll_s=0)
    assert next(joined, None) is None  # it looked until the worker had joined
    monkeypatch.setattr(controller.ray, "cluster_resources", lambda: {"CPU": 2.0})
    with pytest.raises(ValueError, match=r"holds 0 of the 2 GPUs .*spec\.gpus"):
        controller.wait_for_gpus(2, timeout_s=0.05, poll_s=0.01)
    controller.wait_for_gpus(0, timeout_s=0)  # nothing to wait for

    wait = controller.gpus_to_wait_for
    assert wait({}) == 0  # a local run, or a cluster joined through RAY_ADDRESS
    assert wait({"HUORN_RL_WAIT_GPUS": "4"}) == 4
    assert wait({"HUORN_RL_WAIT_GPUS": "4", "HUORN_CONTROLLER_ATTEMPT": "1"}) == 4
    assert wait({"HUORN_RL_WAIT_GPUS": "4", "HUORN_CONTROLLER_ATTEMPT": "2"}) == 0  # a retry
    assert wait({"HUORN_RL_WAIT_GPUS": "four"}) == 0


def test_a_role_given_gpus_whose_torch_has_no_cuda_fails_at_its_start_naming_the_fix() -> None:
    """The model roles were told the config's device ("auto" in a pod), and an actor whose torch
    was a CPU-only build trained on the CPU unnoticed while Ray held its GPUs for it."""
    from kube import builders

    from huorn.backends.kubernetes import manifests, rl_manifests
    from huorn.runtime.rl import controller, workers

    ref = manifests.JobRef("RLJob", "rl", "t", "uid")
    with_gpus = builders.make_rl_job("rl", "train")["spec"]
    assert rl_manifests.build_rl_config(ref, with_gpus)["device"] == "cuda"
    cpu_only = {**with_gpus, "gpus": 0, "resources": {"gpus": 0},
                "roles": {"actorTrain": {"replicas": 1, "gpusPerReplica": 0},
                          "rollout": {"replicas": 1, "gpusPerReplica": 0}}}
    assert "device" not in rl_manifests.build_rl_config(ref, cpu_only)  # "auto": the CPU
    # within a GPU job, a role of no GPUs runs on the CPU (Ray shows its actor none)
    requests = {"actorTrain": 1.0, "rollout": 0.0}
    assert controller.role_device("cuda", requests, "actorTrain") == "cuda"
    assert controller.role_device("cuda", requests, "rollout") == "cpu"
    if torch.cuda.is_available():
        pytest.skip("this machine's torch has CUDA: the failure cannot happen here")
    with pytest.raises(ValueError, match=r"given GPUs, but its torch has no CUDA.*-cu126"):
        workers._device("cuda")
    assert workers._device("cpu") == torch.device("cpu")
