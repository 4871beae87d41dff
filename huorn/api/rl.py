"""RLJob: ROLL-style reinforcement learning with verifiable rewards (GRPO, DAPO, Lite PPO)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field

from huorn.api import rules
from huorn.api.base import ApiModel, DnsLabel
from huorn.api.common import JobCommon, JobStatus
from huorn.api.training import ModelSpec


@rules.attach(
    rules.Rule(
        name="role-device-mapping-size",
        field="deviceMapping",
        cel="!has(self.deviceMapping) || size(self.deviceMapping) == self.replicas * self.gpusPerReplica",
        holds=lambda r: r.device_mapping is None or len(r.device_mapping) == r.replicas * r.gpus_per_replica,
        message="must list replicas × gpusPerReplica GPU indices",
        detail=lambda r: f"{len(r.device_mapping or [])} indices for {r.replicas} × {r.gpus_per_replica}",
        fix="list one GPU index per GPU of the role, or leave deviceMapping out",
    ),
)
class Role(ApiModel):
    replicas: int = Field(default=1, ge=0, le=4096)
    gpus_per_replica: int = Field(default=1, ge=0, le=16)
    colocation_group: DnsLabel | None = Field(
        default=None, description="Roles in one group share the same GPUs, offloading in turn."
    )
    device_mapping: list[Annotated[int, Field(ge=0, le=65535)]] | None = Field(
        default=None, max_length=1024, description="GPU indices (among the job's gpus) this role uses."
    )


class Roles(ApiModel):
    actor_train: Role = Field(default_factory=Role)
    rollout: Role = Field(default_factory=Role)
    reference: Role | None = None
    reward: Role | None = None
    environment: Role | None = None


class Algorithm(StrEnum):
    GRPO = "grpo"
    DAPO = "dapo"
    LITE_PPO = "lite-ppo"
    PPO = "ppo"


class Normalisation(StrEnum):
    GROUP = "group"
    BATCH = "batch"
    NONE = "none"


# Each algorithm is a preset of these choices (notes/papers.md; "Tricks or Traps?", DAPO, GRPO);
# a field the spec sets overrides its preset. Unset fields have no default in the CRD or the
# model: a default written into every stored spec would be indistinguishable from the user's
# choice, and every algorithm would train as the defaults (as it did until 2026-12-07).
ALGORITHM_PRESETS: dict[Algorithm, dict[str, Any]] = {
    # GRPO (DeepSeekMath): group-normalised advantages, per-sequence mean, a KL to the reference.
    Algorithm.GRPO: {"advantage_mean": Normalisation.GROUP, "advantage_std": Normalisation.GROUP,
                     "clip_low": 0.2, "clip_high": 0.2, "loss_aggregation": "sequence",
                     "kl_coefficient": 0.04, "dynamic_sampling": False},
    # DAPO: clip-higher, token-level loss, dynamic sampling, no KL.
    Algorithm.DAPO: {"advantage_mean": Normalisation.GROUP, "advantage_std": Normalisation.GROUP,
                     "clip_low": 0.2, "clip_high": 0.28, "loss_aggregation": "token",
                     "kl_coefficient": 0.0, "dynamic_sampling": True},
    # Lite PPO: group mean, batch std, token-level loss, plain clip, no KL.
    Algorithm.LITE_PPO: {"advantage_mean": Normalisation.GROUP, "advantage_std": Normalisation.BATCH,
                         "clip_low": 0.2, "clip_high": 0.2, "loss_aggregation": "token",
                         "kl_coefficient": 0.0, "dynamic_sampling": False},
}
PRESET_FIELDS = ("advantage_mean", "advantage_std", "clip_low", "clip_high", "loss_aggregation",
                 "kl_coefficient", "dynamic_sampling")


def algorithm_choices(spec: AlgorithmSpec) -> dict[str, Any]:
    """The preset of spec.name with the fields the spec sets on top (PPO, which the runtime
    refuses, judged against GRPO's)."""
    preset = ALGORITHM_PRESETS.get(spec.name, ALGORITHM_PRESETS[Algorithm.GRPO])
    return {**preset, **{f: v for f in PRESET_FIELDS if (v := getattr(spec, f)) is not None}}


def reference_for_kl_problem(spec: RLJobSpec) -> str | None:
    """Why the spec cannot run its KL term, or None: the term needs the reference policy, and a
    reference role of 0 replicas has none. GRPO's preset has one (0.04). The operator and
    `huorn validate` refuse it before any pod, the controller at its start."""
    kl = float(algorithm_choices(spec.algorithm)["kl_coefficient"])
    reference = spec.roles.reference
    if kl > 0 and reference is not None and reference.replicas < 1:
        return (f"spec.roles.reference.replicas: 0, but spec.algorithm ({spec.algorithm.name.value}) has a "
                f"KL term (klCoefficient {kl:g}), which needs the reference policy; set it to 1 or more, "
                "leave spec.roles.reference out (one reference then shares the training actors' GPUs), or "
                "set spec.algorithm.klCoefficient to 0")
    return None


def _clips(spec: AlgorithmSpec) -> tuple[float, float]:
    choices = algorithm_choices(spec)
    return float(choices["clip_low"]), float(choices["clip_high"])


@rules.attach(
    rules.Rule(
        name="algorithm-clip-high-ge-low",
        field="clipHigh",
        # an unset side is its algorithm's preset: 0.2 low everywhere, 0.28 high for DAPO
        cel="(has(self.clipHigh) ? self.clipHigh : (self.name == 'dapo' ? 0.28 : 0.2)) >= "
            "(has(self.clipLow) ? self.clipLow : 0.2)",
        holds=lambda a: _clips(a)[1] >= _clips(a)[0],
        message="must be ≥ clipLow (unset, each is its algorithm's: 0.2, and DAPO's clipHigh 0.28), as "
                "DAPO's clip-higher only widens the upper bound",
        detail=lambda a: f"{_clips(a)[1]} < {_clips(a)[0]}",
        fix="raise clipHigh to at least clipLow",
    ),
    rules.Rule(
        name="algorithm-overlong-buffer",
        field="overlongBuffer",
        cel=(
            "!has(self.overlongBuffer) || "
            "(has(self.overlongMaxLength) && self.overlongBuffer < self.overlongMaxLength)"
        ),
        holds=lambda a: a.overlong_buffer is None
        or (a.overlong_max_length is not None and a.overlong_buffer < a.overlong_max_length),
        message="needs overlongMaxLength and must be below it, as the penalty ramps over the last tokens",
        detail=lambda a: f"buffer {a.overlong_buffer}, max length {a.overlong_max_length}",
        fix="set overlongMaxLength above overlongBuffer, or remove overlongBuffer",
    ),
    rules.Rule(
        name="algorithm-overlong-max-length",
        field="overlongMaxLength",
        cel="!has(self.overlongMaxLength) || has(self.overlongBuffer)",
        holds=lambda a: a.overlong_max_length is None or a.overlong_buffer is not None,
        message="needs overlongBuffer, the last tokens before it over which DAPO's penalty ramps to −1; "
                "alone it would shape nothing",
        detail=lambda a: f"max length {a.overlong_max_length}, no buffer",
        fix="set overlongBuffer below overlongMaxLength (DAPO used 4096 of 20480), or remove "
            "overlongMaxLength",
    ),
)
class AlgorithmSpec(ApiModel):
    """The RL objective: `name` picks a preset (ALGORITHM_PRESETS) and each field set here
    overrides it."""

    name: Algorithm = Algorithm.GRPO
    group_size: int = Field(default=8, ge=1, le=1024, description="Responses sampled per prompt.")
    clip_low: float | None = Field(default=None, gt=0, lt=1, description=(
        "PPO's lower clip ε_low. Unset: the algorithm's, 0.2."))
    clip_high: float | None = Field(default=None, gt=0, lt=10, description=(
        "PPO's upper clip ε_high. Unset: the algorithm's, 0.2 (DAPO's clip-higher: 0.28)."))
    kl_coefficient: float | None = Field(default=None, ge=0, le=10, description=(
        "Weight of the k3 KL to the reference policy. Unset: the algorithm's, 0.04 for GRPO, 0 for "
        "DAPO and Lite PPO."))
    advantage_mean: Normalisation | None = Field(default=None, description=(
        "What rewards are centred on. Unset: the algorithm's, group."))
    advantage_std: Normalisation | None = Field(default=None, description=(
        "What rewards are scaled by. Unset: the algorithm's, group (Lite PPO: batch)."))
    loss_aggregation: Literal["token", "sequence"] | None = Field(default=None, description=(
        "Per-token losses averaged over every token of the batch, or per sequence first. Unset: the "
        "algorithm's, sequence for GRPO, token for DAPO and Lite PPO."))
    dynamic_sampling: bool | None = Field(default=None, description=(
        "Drop groups whose responses all scored alike and draw more prompts. Unset: the algorithm's, "
        "on for DAPO only."))
    overlong_max_length: int | None = Field(default=None, ge=1, description="L_max of DAPO shaping.")
    overlong_buffer: int | None = Field(default=None, ge=1, description="L_cache of DAPO shaping.")


class RewardSpec(ApiModel):
    type: Literal["math-exact", "code-tests", "format"] = "math-exact"
    dataset: str = Field(default="arithmetic", min_length=1)


class RolloutSpec(ApiModel):
    max_new_tokens: int = Field(default=64, ge=1, le=1 << 20)
    temperature: float = Field(default=1.0, ge=0, le=10)
    top_p: float = Field(default=1.0, gt=0, le=1)
    async_steps: int = Field(default=0, ge=0, le=1, description=(
        "Policy versions a step's responses may lag the trained policy. 1 generates step t+1's "
        "responses with step t's weights while step t trains (ROLL's async generation), so rollout "
        "and update overlap, and PPO's ratio is taken against the log-probabilities they were "
        "sampled with; 0 alternates them. More is not run: the controller generates one step "
        "ahead, and a clip measured from an older sampling policy leaves the update less room."))


@rules.attach(
    rules.Rule(
        name="rl-mini-batches-le-prompts",
        field="miniBatches",
        cel="self.miniBatches <= self.promptsPerStep",
        holds=lambda o: o.mini_batches <= o.prompts_per_step,
        message="must be ≤ promptsPerStep, since each optimiser step takes at least one prompt's group",
        detail=lambda o: f"{o.mini_batches} > {o.prompts_per_step}",
        fix="lower miniBatches or raise promptsPerStep",
    ),
)
class RLOptimization(ApiModel):
    learning_rate: float = Field(default=1e-5, gt=0, le=1)
    weight_decay: float = Field(default=0.0, ge=0, le=1)
    prompts_per_step: int = Field(default=8, ge=1, le=65536, description="Prompts per RL step, each "
                                  "answered groupSize times.")
    update_epochs: int = Field(default=1, ge=1, le=64, description="Passes over a step's responses.")
    mini_batches: int = Field(default=1, ge=1, le=65536, description="Optimiser steps per pass; above 1 "
                              "the policy moves within a step, and the clip takes effect.")
    seed: int = Field(default=0, ge=0, description="Prompts, sampling and (without initCheckpoint) the "
                      "initial weights.")


ROLE_FIELDS = ("actorTrain", "rollout", "reference", "reward", "environment")


def list_roles(roles: Roles) -> list[tuple[str, Role]]:
    """The roles that are present, by wire name, in a fixed order."""
    present = [(name, getattr(roles, _SNAKE[name])) for name in ROLE_FIELDS]
    return [(name, role) for name, role in present if role is not None]


def count_gpus_needed(roles: Roles) -> int:
    """GPUs the roles need: dedicated roles add up; a colocation group needs its largest member."""
    dedicated = 0
    groups: dict[str, int] = {}
    for _, role in list_roles(roles):
        demand = role.replicas * role.gpus_per_replica
        if role.colocation_group is None:
            dedicated += demand
        else:
            groups[role.colocation_group] = max(groups.get(role.colocation_group, 0), demand)
    return dedicated + sum(groups.values())


_SNAKE = {"actorTrain": "actor_train", "rollout": "rollout", "reference": "reference",
          "reward": "reward", "environment": "environment"}


def _cel_gpus_needed() -> str:
    """count_gpus_needed in plain CEL (no sum() or max() in the portable subset).

    A colocated role is counted only if it is the largest member of its group (ties go to the
    earlier role), so every group is counted once, at its largest demand.
    """
    terms = []
    for i, name in enumerate(ROLE_FIELDS):
        role = f"self.roles.{name}"
        demand = f"{role}.replicas * {role}.gpusPerReplica"
        larger = []
        for j, other_name in enumerate(ROLE_FIELDS):
            if j == i:
                continue
            other = f"self.roles.{other_name}"
            beats = ">=" if j < i else ">"
            larger.append(
                f"(has({other}) && has({other}.colocationGroup) && {other}.colocationGroup == "
                f"{role}.colocationGroup && {other}.replicas * {other}.gpusPerReplica {beats} {demand})"
            )
        counted = f"(!has({role}.colocationGroup) || !({' || '.join(larger)}))"
        terms.append(f"(has({role}) && {counted} ? {demand} : 0)")
    return " + ".join(terms)


def _cel_mappings_within_gpus() -> str:
    clauses = [
        f"(!has(self.roles.{name}) || !has(self.roles.{name}.deviceMapping) || "
        f"self.roles.{name}.deviceMapping.all(i, i < self.gpus))"
        for name in ROLE_FIELDS
    ]
    return "!has(self.gpus) || (" + " && ".join(clauses) + ")"


@rules.attach(
    rules.Rule(
        name="rl-colocated-roles-fit",
        field="gpus",
        cel=f"!has(self.gpus) || {_cel_gpus_needed()} <= self.gpus",
        holds=lambda s: s.gpus is None or count_gpus_needed(s.roles) <= s.gpus,
        message="must hold the roles: dedicated roles add up, each colocation group needs its largest role",
        detail=lambda s: f"roles need {count_gpus_needed(s.roles)}, gpus is {s.gpus}",
        fix="raise gpus, lower role replicas, or colocate roles in one group",
    ),
    rules.Rule(
        name="rl-gpus-fill-worker-pods",
        field="gpus",
        cel="!has(self.gpus) || self.gpus == 0 "
            "|| (self.resources.gpus > 0 && self.gpus % self.resources.gpus == 0)",
        holds=lambda s: s.gpus is None or s.gpus == 0
        or (s.resources.gpus > 0 and s.gpus % s.resources.gpus == 0),
        message="must be a multiple of resources.gpus: in a cluster the job's GPUs are Ray worker pods "
        "of resources.gpus each",
        detail=lambda s: f"gpus {s.gpus}, resources.gpus {s.resources.gpus}",
        fix="make gpus a multiple of resources.gpus, or change resources.gpus",
    ),
    rules.filesystem_path("rl-init-checkpoint-is-a-path", "initCheckpoint", "init_checkpoint"),
    rules.Rule(
        name="rl-device-mapping-within-gpus",
        field="roles",
        cel=_cel_mappings_within_gpus(),
        holds=lambda s: s.gpus is None
        or all(i < s.gpus for _, r in list_roles(s.roles) for i in (r.device_mapping or [])),
        message="deviceMapping indices must be below gpus",
        detail=lambda s: f"gpus is {s.gpus}",
        fix="use GPU indices 0 .. gpus-1, or raise gpus",
    ),
)
class RLJobSpec(JobCommon):
    model: ModelSpec = Field(default_factory=ModelSpec)
    roles: Roles = Field(default_factory=Roles)
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec)
    reward: RewardSpec = Field(default_factory=RewardSpec)
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    optimization: RLOptimization = Field(default_factory=RLOptimization)
    init_checkpoint: str | None = Field(
        default=None, min_length=1, description="The policy's (and the reference's) starting weights: a "
        "Huorn checkpoint of spec.model's architecture, e.g. a TrainingJob's; in a pod, under "
        "spec.checkpoint.path on the checkpoint volume.")
    steps: int = Field(default=100, ge=1)
    suspend: bool = Field(
        default=False,
        description="True stops the job's Ray cluster and frees its GPUs: the controller gets SIGTERM "
        "and checkpoints its step first. False again resumes it from that checkpoint. A job created "
        "with suspend true waits without pods (Kueue's suspend).",
    )
    gpus: int | None = Field(default=None, ge=0, description="GPUs the job holds, shared by colocated roles.")
    controller_retries: int = Field(default=2, ge=0, le=20, description=(
        "Times the head pod reruns a controller that failed (an actor lost to an OOM kill, an "
        "exception) on the same Ray cluster, resuming from the last checkpoint, before the pod fails "
        "and the gang restarts. Not counted against remediation.maxRestarts; a lost pod still "
        "restarts the gang."))


class RLJobStatus(JobStatus):
    step: int = Field(default=0, ge=0, description="RL steps done, resumed ones included.")
    spec_change_refused: str | None = Field(
        default=None, description="Why an edit of spec.model is not applied (the checkpoints hold the "
                                  "architecture the job started with), and what to do.")
    mean_reward: float | None = Field(default=None, description="The last step's mean reward.")
    progress_percent: int | None = Field(default=None, ge=0, le=100, description="step / spec.steps.")
    eval_accuracy: float | None = Field(default=None, description="Greedy accuracy on held-out prompts, "
                                        "at the start and the end of a run.")
    restarts: int = Field(default=0, ge=0, description="Gang restarts counted against "
                          "spec.remediation.maxRestarts.")
    start_time: str | None = None
    completion_time: str | None = None
    rollout_workers: int | None = Field(default=None, ge=0, description="Rollout workers the controller "
                                        "runs now (spec.roles.rollout.replicas, once started).")
    role_replicas: dict[str, Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="The actors each role ran the last step on (actorTrain, rollout, "
                                  "reference, reward): spec.roles.*.replicas once Ray has started them.")
    config_hash: str | None = Field(default=None, description="The run config in the job's ConfigMap, "
                                    "which the running controller re-reads at every step.")
    controller_restarts: int | None = Field(default=None, ge=0, description="Times the running gang's "
                                            "head reran its controller on the same Ray cluster "
                                            "(spec.controllerRetries).")


@dataclass(frozen=True)
class RayLayout:
    """An RLJob's pods in a cluster: one head (Ray's head node and the single controller, no
    GPU) and `workers` Ray worker nodes of `gpus_per_worker` GPUs each."""

    gpus: int
    gpus_per_worker: int
    workers: int


def ray_layout(spec: RLJobSpec) -> RayLayout:
    """How the job's GPUs become Ray worker pods, or ValueError naming the field and the fix.

    The job holds `spec.gpus` (default: what its roles need) in pods of `spec.resources.gpus`
    each, the Kubernetes unit of one Ray node. A role replica is one Ray actor, and an actor's
    GPUs lie on one node, so no role may ask for more GPUs a replica than one pod has."""
    gpus = spec.gpus if spec.gpus is not None else count_gpus_needed(spec.roles)
    if gpus == 0:
        return RayLayout(0, 0, 0)
    per = spec.resources.gpus
    if per < 1:
        raise ValueError(f"spec.resources.gpus: 0, but the job holds {gpus} GPU(s) (spec.gpus or its "
                         "roles) in Ray worker pods of spec.resources.gpus each; set it to at least 1")
    if gpus % per:
        held = f"spec.gpus: {gpus}" if spec.gpus is not None else f"spec.gpus: unset, so the roles' {gpus}"
        raise ValueError(f"{held} is not a multiple of spec.resources.gpus ({per}), the GPUs of one Ray "
                         f"worker pod; set spec.gpus to a multiple of {per}, or change spec.resources.gpus")
    for name, role in list_roles(spec.roles):
        if role.gpus_per_replica > per:
            raise ValueError(f"spec.roles.{name}.gpusPerReplica: {role.gpus_per_replica} exceeds "
                             f"spec.resources.gpus ({per}): a replica is one Ray actor, which runs on "
                             "one worker pod; raise spec.resources.gpus or lower gpusPerReplica")
    return RayLayout(gpus, per, gpus // per)
