"""The single controller of an RLJob (ROLL's structure): one process drives the worker roles,
each a group of Ray actors, through the data flow of one RL step.

    python -m huorn.runtime.rl.controller --config rl-config.json

One step: the trainer's weights go into Ray's object store once and every rollout worker loads
them; the step's prompts are dealt to the rollout workers, which sample `groupSize` responses
each; reward workers score them against the verifiable answers (DAPO's overlong shaping added);
with dynamic sampling, groups that all scored alike are dropped and more prompts are sampled,
up to three rounds, until the step has `promptsPerStep` informative groups; the reference
worker gives the log-probabilities for the KL term when the algorithm has one; advantages are
normalised as the algorithm says; the trainer updates. The step log (JSON lines, as the
trainer's) gets one `rl` record per step, `eval` records of greedy accuracy on held-out prompts
at the start and end, and checkpoints follow spec.checkpoint.intervalSteps (and the end).

Ray runs locally (`ray.init` starts a cluster of this machine's CPUs) unless RAY_ADDRESS names
one; the roles' replicas become actors of one CPU each, or of gpusPerReplica GPUs on a GPU
machine.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ray
import torch
from pydantic import Field

from huorn.api import base, rl
from huorn.runtime import config as run_config
from huorn.runtime.rl import algorithms, pools, progress, rewarding, tasks, workers

STEPS_FILE = "steps.jsonl"
# Set by the operator on a head pod only: the GPUs its gang's worker pods bring. An environment
# variable, not a config field: a controller of an older image re-reads the ConfigMap at every
# step and refuses fields it does not know, and a local run or a cluster joined through
# RAY_ADDRESS (KubeRay), which set none, wait for nothing.
WAIT_GPUS_ENV = "HUORN_RL_WAIT_GPUS"
_SAMPLING_ROUNDS = 3  # DAPO's dynamic sampling: prompt batches drawn before training on what there is


@dataclasses.dataclass
class Rollout:
    """One step's scored groups and what their generation measured (`policy_lag`: versions
    behind the policy they train)."""

    items: list[dict[str, Any]]
    stats: dict[str, Any]


class RLRunConfig(base.ApiModel):
    job_name: str = Field(min_length=1)
    spec: rl.RLJobSpec
    run_dir: Path = Field(description="The step log.")
    checkpoint_dir: Path | None = Field(default=None, description="Default: spec.checkpoint.path.")
    device: str = Field(default="auto", pattern="^(auto|cpu|cuda)$")
    eval_prompts: int = Field(default=64, ge=0, le=100_000, description="Held-out prompts scored greedily "
                              "at the start and the end; 0: none.")
    start_timeout_s: float = Field(default=300.0, gt=0, description="How long the roles' actors may take "
                                   "to start (a role asking for more than the cluster has never does).")
    ray_cpus: int | None = Field(default=None, ge=1, description="CPUs of the local Ray cluster; default: "
                                 "this machine's. Not with RAY_ADDRESS (a running cluster has its own).")
    progress_host: str = Field(default="127.0.0.1", min_length=1, description="Where GET /progress listens.")
    progress_port: int | None = Field(default=None, ge=0, le=65535, description="Serve the latest step as "
                                      "JSON on this port (0: any free one); default: not served.")

    @property
    def checkpoint_root(self) -> Path:
        return self.checkpoint_dir or Path(self.spec.checkpoint.path)


def check_runnable(spec: rl.RLJobSpec) -> algorithms.Settings:
    """What this runtime refuses in a valid spec, each naming the field and the fix; the resolved
    algorithm otherwise. `huorn run` calls it before creating anything."""
    settings = algorithms.resolve(spec.algorithm)  # ppo needs a critic
    tasks.check_reward(spec.reward)
    roles = spec.roles
    if roles.actor_train.replicas < 1:
        raise ValueError("spec.roles.actorTrain.replicas: 0, but the policy needs a training actor; "
                         "set it to 1 or more (they train data-parallel)")
    # NB: refused, not run as one: the API counts no GPU for a role of 0 replicas, so the one
    # actor started anyway waited on a GPU cluster for a GPU that was never there until the
    # start timeout (and was reported running where the spec says 0)
    if roles.rollout.replicas < 1:
        raise ValueError("spec.roles.rollout.replicas: 0, but the responses are sampled by rollout "
                         "workers; set it to 1 or more")
    if (problem := rl.reference_for_kl_problem(spec)) is not None:
        raise ValueError(problem)
    return settings


def check_trainers_on_gpus(trainers: int, gpus_each: float) -> None:
    """Data-parallel trainers on GPUs form an NCCL group, which refuses two members on one GPU.
    Ray gives an actor a GPU of its own only when it asks a whole one; a colocation group's share
    (gpu_requests) may put two trainers on one device. Refused before any actor starts."""
    if trainers > 1 and gpus_each < 1:
        raise ValueError(
            f"spec.roles.actorTrain: {trainers} data-parallel trainers would get {gpus_each:g} GPU each "
            "(their colocation group's share, or what a reference left out of spec.roles leaves them), "
            "so two could land on one GPU, which NCCL refuses; give actorTrain a colocation group of its "
            "own (and list spec.roles.reference with GPUs of its own), raise its gpusPerReplica so that "
            "each trainer's share is a whole GPU, or train with one replica")


def idle_reference(spec: rl.RLJobSpec, settings: algorithms.Settings) -> str | None:
    """A notice when spec.roles lists a reference that the algorithm never asks (no KL term):
    the API counted GPUs for it that no actor uses. Said, not refused: the job runs as asked."""
    reference = spec.roles.reference
    if reference is None or settings.kl_coefficient > 0:
        return None
    if reference.replicas * reference.gpus_per_replica == 0:
        return None
    return (f"spec.roles.reference asks {reference.replicas} x {reference.gpus_per_replica} GPU(s), but "
            f"spec.algorithm ({spec.algorithm.name.value}) has no KL term, so no reference runs and the job "
            "holds those GPUs unused; leave spec.roles.reference out, or set spec.algorithm.klCoefficient")


def role_replicas(spec: rl.RLJobSpec, settings: algorithms.Settings) -> dict[str, int]:
    """The actors each role runs: rollout at least one; a reference worker only for a KL term
    (one where spec.roles leaves it out); reward workers as spec.roles lists them (none where it
    leaves the role out or asks 0: the controller scores in its own process). check_runnable
    refuses a rollout, or a reference for a KL term, of 0 replicas; the floors here keep a
    running job whole where the file's algorithm has since dropped its KL term (a change that
    waits for the next start)."""
    roles = spec.roles
    reference = 0
    if settings.kl_coefficient > 0:
        reference = max(1, roles.reference.replicas) if roles.reference is not None else 1
    # NB: replicas 0 is no reward worker (it was one): how a user goes back to inline scoring
    # with a merge patch, which cannot drop the role from spec.roles without a null
    reward = roles.reward.replicas if roles.reward is not None else 0
    return {"actorTrain": roles.actor_train.replicas, "rollout": max(1, roles.rollout.replicas),
            "reference": reference, "reward": reward}


def wait_for_gpus(gpus: float, timeout_s: float, poll_s: float = 0.5) -> None:
    """Until the Ray cluster holds `gpus` GPUs. A head pod starts beside its worker pods, not
    after them: read at once, a GPU worker that joined a moment later was left unused, the model
    roles running on CPUs. ValueError naming what came, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    said = False
    while (have := float(ray.cluster_resources().get("GPU", 0))) < gpus:
        if not said:  # what `kubectl logs` of a head pod shows while its workers start
            print(f"huorn-rl: waiting for the worker pods' GPUs: {have:g} of {gpus:g} in the Ray cluster",
                  file=sys.stderr, flush=True)
            said = True
        if time.monotonic() >= deadline:
            raise ValueError(f"the Ray cluster holds {have:g} of the {gpus:g} GPUs its worker pods bring "
                             f"after {timeout_s:.0f} s (spec.gpus): are the worker pods running, and do "
                             "their nodes have the GPUs?")
        time.sleep(poll_s)


def gpus_to_wait_for(environ: Mapping[str, str]) -> float:
    """The GPUs a head pod's controller waits for before it decides where the model roles run:
    its first run only (a retry finds the workers that are left, which a shrink may have made
    fewer), and 0 where the operator set none (a local run, a KubeRay cluster)."""
    if environ.get("HUORN_CONTROLLER_ATTEMPT", "1") != "1":
        return 0.0
    try:
        return max(0.0, float(environ.get(WAIT_GPUS_ENV, "0")))
    except ValueError:
        return 0.0


def cpu_shares(nodes: Sequence[Mapping[str, Any]], counts: Mapping[str, int],
               gpu: bool) -> tuple[float, float]:
    """The CPUs each actor asks: (the cluster-wide share, that of a model role on a GPU node).

    Actors share the CPUs: one each where there are enough, a fair fraction where not (a laptop
    runs every role), so no actor waits for a CPU that never frees; actors added at run time get
    the same share; a reward worker, which only checks strings, a quarter. Model roles that take
    GPUs can only run on the nodes that have them, so their share is of those nodes' CPUs: from
    the whole cluster's, a head of 2 CPUs and a GPU worker of 1 gave each of three colocated
    actors 0.92 CPU, and two of them never fitted on the worker (found when the worker joined
    before the controller looked; a later one hid it, the actors then running without GPUs)."""
    alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", True)]
    heavy = counts["actorTrain"] + counts["rollout"] + counts["reference"]
    cpus = sum(float(r.get("CPU", 0)) for r in alive) or 1.0
    share = min(1.0, cpus / (heavy + 0.25 * counts["reward"]))
    if not gpu:
        return share, share
    gpu_cpus = sum(float(r.get("CPU", 0)) for r in alive if r.get("GPU", 0) > 0)
    return share, (min(share, gpu_cpus / heavy) if gpu_cpus > 0 else share)


def role_device(device: str, requests: dict[str, float], role: str) -> str:
    """The run config's device for a model role Ray gives GPUs, the CPU for one it gives none: a
    job's `cuda` (a pod of a GPU job) made a role of `gpusPerReplica: 0` refuse to start, its
    actor seeing no GPU."""
    return device if requests.get(role, 0) > 0 else "cpu"


def gpu_requests(roles: rl.Roles, reference: bool) -> dict[str, float]:
    """Ray's `num_gpus` for one actor of each model role ("actorTrain", "rollout", "reference").

    The roles of a colocation group share its GPUs, as ROLL colocates them (they take turns on
    the same devices), so each asks its gpusPerReplica over the group's number of model roles.
    That keeps the actors within what the API counted for the group, its largest member
    (api.rl.count_gpus_needed): before, each took whole GPUs, and a colocated job that the API
    accepted waited for GPUs its cluster did not have until the start timeout. A reference that
    spec.roles leaves out (the API counts no GPU for it) shares the training actor's GPUs. Ray
    takes fractions only up to 1, so a larger share is rounded down to whole GPUs: each actor
    drives one device."""
    model = {"actorTrain": roles.actor_train, "rollout": roles.rollout}
    group = {name: role.colocation_group for name, role in model.items()}
    if reference and roles.reference is not None:
        model["reference"], group["reference"] = roles.reference, roles.reference.colocation_group
    elif reference:
        model["reference"] = rl.Role(gpus_per_replica=roles.actor_train.gpus_per_replica)
        group["reference"] = group["actorTrain"] = roles.actor_train.colocation_group or "huorn-reference"
    members = collections.Counter(g for g in group.values() if g is not None)
    out = {}
    for name, role in model.items():
        share = role.gpus_per_replica / (members[group[name]] if group[name] is not None else 1)
        out[name] = share if share <= 1 else float(int(share))
    return out


def training_batch(items: Sequence[Mapping[str, Any]], advantages: torch.Tensor, references: Sequence[Any],
                   version: int) -> list[dict[str, Any]]:
    """What the trainer gets of each group, holding weights `version` (the step it trains). A
    group sampled by an older version (asyncSteps 1: the one before) carries the rollout's
    sampling log-probabilities as `behaviour`, its π_old: PPO's ratio and clip are then against
    the policy that sampled it. Recomputed by the trainer, π_old was the trained policy itself,
    the ratio exactly 1 at the first optimiser step whatever the lag. A group sampled by the
    trainer's own weights gets none: the trainer recomputes π_old, the same policy."""
    return [{"prompt": item["prompt"], "tokens": item["tokens"], "mask": item["mask"],
             "advantages": advantages[k], "reference": references[k],
             "behaviour": item["logprobs"] if item["version"] < version else None}
            for k, item in enumerate(items)]


def reward_inputs(items: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What a reward worker scores of each group: its strings. NB: not the whole item, whose
    tensors, unpickled in the worker, imported torch there at its first call (2-3 s of CPU),
    which its module (huorn.runtime.rl.rewarding) is kept free of."""
    return [{"text": i["text"], "answer": i["answer"], "responses": i["responses"]} for i in items]


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """Set environment variables for the processes started in the block, then put them back."""
    before = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class Controller:
    _config_error: str | None = None  # the config file's last refusal, printed once (_wanted_replicas)

    def __init__(self, cfg: RLRunConfig) -> None:
        address = os.environ.get("RAY_ADDRESS") or None
        if address and cfg.ray_cpus is not None:
            # NB: refused before anything starts; Ray itself refuses num_cpus for a cluster it
            # only connects to, in words that name neither the field nor the variable.
            raise ValueError(f"rayCpus: {cfg.ray_cpus} sizes a Ray cluster this controller starts, but "
                             f"RAY_ADDRESS={address} names a running one, whose CPUs are its own; drop "
                             "rayCpus, or unset RAY_ADDRESS to start a local cluster")
        self.cfg = cfg
        self.spec = cfg.spec
        self.settings = check_runnable(self.spec)
        self.stop_signal: str | None = None  # set by SIGTERM or SIGINT; the step ends, then the run
        self.progress = progress.Progress(cfg.job_name, cfg.spec.steps)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not ray.is_initialized():
            # Actors run one intra-op thread each (workers._one_thread sets torch's). A cluster
            # started here also takes OMP_NUM_THREADS=1 from this process's environment when
            # ray.init spawns the raylet. NB: no runtime environment, for a named cluster either
            # (it had one with OMP_NUM_THREADS): with one, Ray starts each actor in a fresh worker
            # through setup_worker and leaves the workers it prestarted idle, about 2.4 CPU-s an
            # actor (the two-run RL test: 82 → 66 CPU-s; a local cluster: 70 → 62 before).
            with _environment(OMP_NUM_THREADS="1"):
                # "local": a cluster of its own, even where an old `ray start` left its address
                # in the temp dir (ray_current_cluster), which a plain ray.init() would try to
                # join: long gone, it hung `huorn run` for minutes before failing
                ray.init(address=address or "local", num_cpus=cfg.ray_cpus, include_dashboard=False,
                         log_to_driver=False, namespace=cfg.job_name)
        # The model roles take GPUs where the cluster has any (gpu_requests). NB: the cluster's, not this
        # process's: in a pod the controller runs on Ray's head node, which holds no GPU, while
        # the worker nodes hold them all (huorn.runtime.rl.node), which may join a moment later.
        if cfg.device != "cpu":
            wait_for_gpus(gpus_to_wait_for(os.environ), cfg.start_timeout_s)
        gpu = cfg.device == "cuda" or (cfg.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
        wire, roles = self.spec.to_wire(), self.spec.roles
        init = self.spec.init_checkpoint
        counts = role_replicas(self.spec, self.settings)
        if (idle := idle_reference(self.spec, self.settings)) is not None:
            print(f"huorn-rl: {idle}", file=sys.stderr)
        # The model roles take GPUs on a GPU machine (shared within a colocation group), and
        # their CPUs on the GPU nodes (cpu_shares).
        requests = gpu_requests(roles, counts["reference"] > 0)
        self._trainer_gpus = requests["actorTrain"] if gpu else None
        self.check_trainers(counts["actorTrain"])
        share, gpu_share = cpu_shares(ray.nodes(), counts, gpu)

        def actor(cls: type, role: str) -> Any:
            return ray.remote(cls).options(num_cpus=gpu_share if gpu else share,
                                           num_gpus=requests[role] if gpu else 0)

        self.config_path: Path | None = None  # re-read at step boundaries (main sets it)
        made = itertools.count()

        def new_trainer() -> Any:
            # Only the first (rank 0: members keep their order, and shrinks stop the newest)
            # reads spec.initCheckpoint; every other trainer takes rank 0's state, at the start
            # (TrainerGroup.resume) or as a joiner, so its node needs no copy and loads nothing.
            first = next(made) == 0
            return actor(workers.PolicyTrainer, "actorTrain").remote(
                wire, init if first else None, str(cfg.checkpoint_root),
                role_device(cfg.device, requests, "actorTrain"))

        self.trainers = pools.TrainerGroup("actorTrain", new_trainer, counts["actorTrain"])
        self.rollouts = pools.ActorPool(
            "rollout", lambda: actor(workers.RolloutWorker, "rollout").remote(
                wire, role_device(cfg.device, requests, "rollout")),
            counts["rollout"])
        self.references = pools.ActorPool(
            "reference", lambda: actor(workers.ReferenceWorker, "reference").remote(
                wire, init, role_device(cfg.device, requests, "reference")),
            counts["reference"])
        self.rewards = pools.ActorPool(
            "reward", lambda: ray.remote(rewarding.RewardWorker).options(num_cpus=0.25 * share).remote(wire),
            counts["reward"])
        self.pools = (self.trainers, self.rollouts, self.references, self.rewards)
        ready = {a.__ray_ready__.remote(): pool.role for pool in self.pools for a in pool.members}
        try:
            ray.get(list(ready), timeout=cfg.start_timeout_s)
        except ray.exceptions.GetTimeoutError:
            # NB: each role that did not start, by its field: "the roles' N actors" left the user
            # to guess which one asked for what the cluster lacks
            done, _ = ray.wait(list(ready), num_returns=len(ready), timeout=0)
            asked = collections.Counter(ready.values())
            waiting = collections.Counter(role for ref, role in ready.items() if ref not in done)
            named = " and ".join(f"spec.roles.{role} ({asked[role] - waiting[role]} of {asked[role]} started)"
                                 for role in waiting)
            have = ray.cluster_resources()
            raise ValueError(
                f"the actors of {named} did not start within {cfg.start_timeout_s:.0f} s on a Ray cluster "
                f"of {have.get('CPU', 0):g} CPU and {have.get('GPU', 0):g} GPU; lower those roles' replicas "
                "or gpusPerReplica, or give the cluster more") from None
        except ray.exceptions.RayError as error:  # an actor's constructor refused (a bad checkpoint)
            cause = getattr(error, "cause", None) or error
            raise ValueError(str(cause).strip().splitlines()[-1]) from None
        self.trainers.form()

    # -- bookkeeping ---------------------------------------------------------------------------
    def log(self, record: dict[str, Any]) -> None:
        with open(self.run_dir / STEPS_FILE, "a") as handle:
            handle.write(json.dumps({"time": time.time(), **record}) + "\n")
        self.progress.record(record)
        if record.get("event") in ("rl", "eval", "checkpoint", "done"):
            # one line each on stdout as well: what `kubectl logs` of a head pod shows
            shown = " ".join(f"{k}={record[k]}" for k in ("step", "reward_mean", "accuracy", "reason", "path")
                             if k in record)
            print(f"huorn-rl {record['event']}: {shown}", flush=True)

    # -- one step ------------------------------------------------------------------------------
    def sync_weights(self, version: int) -> None:
        weights = self.trainers.weights()  # an object ref: stored once, read by every worker
        ray.get([worker.load.remote(weights, version) for worker in self.rollouts.members])

    def generate(self, prompts: list[tasks.Prompt], seed: int, greedy: bool = False) -> list[dict[str, Any]]:
        # one seed a prompt (promptsPerStep is at most 65,536, so no two prompts of a run share
        # one): the samples do not depend on how the prompts are dealt
        seeded = [(p.text, p.answer, seed * 65_536 + k) for k, p in enumerate(prompts)]
        futures = [worker.generate.remote(chunk, greedy)
                   for worker, chunk in zip(self.rollouts.members, self.rollouts.deal(seeded), strict=True)
                   if chunk]
        return [item for chunk in ray.get(futures) for item in chunk]

    def score(self, items: list[dict[str, Any]]) -> list[list[float]]:
        if not self.rewards.members:
            reward = self.spec.reward
            return [[tasks.score(reward, tasks.Prompt(i["text"], i["answer"]), r) for r in i["responses"]]
                    for i in items]
        chunks = self.rewards.deal(reward_inputs(items))
        scored = ray.get([w.score.remote(c) for w, c in zip(self.rewards.members, chunks, strict=True) if c])
        return [s for chunk_scores in scored for s in chunk_scores]

    def rollout_step(self, step: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """The step's groups with their rewards: `promptsPerStep` of them, informative ones only
        under dynamic sampling (as many as three rounds of prompts could give)."""
        want = self.spec.optimization.prompts_per_step
        kept: list[dict[str, Any]] = []
        drawn = dropped = 0
        raw: list[float] = []
        for round_ in range(_SAMPLING_ROUNDS if self.settings.dynamic_sampling else 1):
            prompts = tasks.prompts(self.spec.reward.dataset, self.spec.optimization.seed, step, want,
                                    round_=round_)
            items = self.generate(prompts, seed=step * _SAMPLING_ROUNDS + round_)
            drawn += len(items)
            limit, buffer = self.settings.overlong_max_length, self.settings.overlong_buffer
            for item, scores in zip(items, self.score(items), strict=True):
                item["scores"] = torch.tensor(scores)
                raw.extend(scores)
                rewards = item["scores"]
                if limit is not None and buffer is not None:
                    rewards = rewards + algorithms.overlong_penalty(item["mask"].sum(dim=1), limit, buffer)
                item["rewards"] = rewards
                # DAPO drops the groups that are all right or all wrong, by the verifier's scores:
                # an all-wrong group kept for one long answer's length penalty would train on
                # length alone, at full size once the group's std normalised it
                informative = bool(algorithms.informative_groups(item["scores"][None])[0])
                if self.settings.dynamic_sampling and not informative:
                    dropped += 1
                    continue
                if len(kept) < want:
                    kept.append(item)
            if len(kept) >= want:
                break
        stats = {"reward_mean": sum(raw) / max(1, len(raw)), "groups_drawn": drawn, "groups_dropped": dropped,
                 "groups_trained": len(kept)}
        return kept, stats

    def rescale(self, step: int) -> None:
        """Each role's actors as the config file asks now (`spec.roles.*.replicas`), at a step
        boundary, without a restart (huorn.runtime.rl.pools says how each role follows). Other
        changes in the file wait for the next start."""
        wanted = self._wanted_replicas()
        for pool in self.pools:
            before, asked = len(pool.members), pool.wanted
            if wanted is not None and wanted[pool.role] != pool.wanted:
                pool.resize(wanted[pool.role])
            pool.admit()
            # actors that failed to start are dropped (pools.ActorPool.ready): asked again next time
            failed, pool.failed = pool.failed, []
            for reason in failed:
                print(f"huorn-rl: a {pool.role} actor failed to start, asked again next step: {reason}",
                      file=sys.stderr)
            # a record when the role's actors or the ask changed, not at every step they start
            if len(pool.members) != before or pool.wanted != asked:
                self.log({"event": "scale", "step": step, "role": pool.role, "from": before,
                          "to": len(pool.members), "starting": len(pool.starting),
                          **({"failed": failed} if failed else {})})

    def check_trainers(self, trainers: int) -> None:
        if self._trainer_gpus is not None:
            check_trainers_on_gpus(trainers, self._trainer_gpus)

    def _wanted_replicas(self) -> dict[str, int] | None:
        """Each role's actors as the config file says now; None where it cannot be read."""
        if self.config_path is None:
            return None
        try:
            spec = load_config(self.config_path).spec
            check_runnable(spec)
            wanted = role_replicas(spec, self.settings)
            self.check_trainers(wanted["actorTrain"])  # the count it asks now, as at the start
        except (OSError, ValueError) as error:  # a file being replaced, or a bad edit: keep what runs
            # once an edit, not at every step boundary, which flooded the head pod's log with the
            # same error until the ConfigMap was fixed
            if str(error) != self._config_error:
                print(f"huorn-rl: {self.config_path} unusable, roles unchanged: {error}", file=sys.stderr)
            self._config_error = str(error)
            return None
        self._config_error = None
        return wanted

    def running_replicas(self) -> dict[str, int]:
        return {pool.role: len(pool.members) for pool in self.pools}

    def timed_rollout(self, step: int, lag: int) -> Rollout:
        started = time.monotonic()
        items, stats = self.rollout_step(step)
        return Rollout(items, {**stats, "rollout_seconds": time.monotonic() - started, "policy_lag": lag})

    def train_step(self, step: int, rollout: Rollout, waited: float) -> None:
        """One update from the step's responses; `waited`: seconds the loop stood still for them
        (the whole rollout when it was not generated ahead, else what outlasted the last update)."""
        started = time.monotonic()
        items, stats = rollout.items, {**rollout.stats, "rollout_wait_seconds": waited}
        if not items:  # every group alike through every round: nothing to learn from this step
            self.log({"event": "rl", "step": step, **stats, "skipped": True})
            return
        rewards = torch.stack([item["rewards"] for item in items])
        advantages = algorithms.advantages(rewards, self.settings)
        references: list[Any] = [None] * len(items)
        if self.references.members:
            parts = ray.get([worker.logprobs.remote(chunk) for worker, chunk in
                             zip(self.references.members, self.references.deal(items), strict=True) if chunk])
            references = [r for part in parts for r in part]
        metrics = self.trainers.update(training_batch(items, advantages, references, version=step))
        lengths = torch.cat([item["mask"].sum(dim=1) for item in items])
        self.log({"event": "rl", "step": step, **stats, **metrics,
                  "rollout_workers": len(self.rollouts.members), "role_replicas": self.running_replicas(),
                  # by the verifier's scores: a right answer in the overlong buffer is still right
                  "accuracy": float((torch.stack([item["scores"] for item in items]) > 0.5).float().mean()),
                  "response_length": float(lengths.float().mean()),
                  "update_seconds": time.monotonic() - started})

    def evaluate(self, step: int) -> dict[str, Any] | None:
        """Greedy accuracy on held-out prompts, with the weights the rollout workers hold."""
        if not self.cfg.eval_prompts:
            return None
        spec = self.spec
        prompts = tasks.held_out(spec.reward.dataset, spec.optimization.seed, self.cfg.eval_prompts)
        items = self.generate(prompts, seed=0, greedy=True)
        scores = [s[0] for s in self.score(items)]
        record = {"event": "eval", "step": step, "accuracy": sum(scores) / len(scores),
                  "prompts": len(scores),
                  "examples": [{"prompt": i["text"], "response": i["responses"][0], "answer": i["answer"]}
                               for i in items[:3]]}
        self.log(record)
        return record

    def _request_stop(self, signum: int, frame: object) -> None:
        self.stop_signal = signal.Signals(signum).name.lower()

    def run(self) -> int:
        server = (progress.ProgressServer(self.progress, self.cfg.progress_host, self.cfg.progress_port)
                  if self.cfg.progress_port is not None else None)
        try:
            return self._run()
        finally:
            if server is not None:
                server.close()

    def _run(self) -> int:
        step = self.trainers.resume()
        total = self.spec.steps
        self.log({"event": "start", "resumed_from": step, "algorithm": self.spec.algorithm.name.value,
                  "attempt": int(os.environ.get("HUORN_CONTROLLER_ATTEMPT", "1")),
                  "settings": {k: (v.value if hasattr(v, "value") else v)
                               for k, v in vars(self.settings).items()},
                  "rollout_workers": len(self.rollouts.members), "reward_workers": len(self.rewards.members),
                  "reference": bool(self.references.members), "role_replicas": self.running_replicas(),
                  "model_roles_on_gpus": self._trainer_gpus is not None})
        self.sync_weights(step)
        if step == 0:
            self.evaluate(0)
        interval = self.spec.checkpoint.interval_steps
        # SIGTERM (a pod being stopped) or SIGINT (Ctrl-C under huorn run): finish the step, save
        # it, go. The next start resumes there, as the trainer of a TrainingJob does.
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self._request_stop)
        # spec.rollout.asyncSteps 1: the next step's responses are generated (with the weights
        # rollout workers hold, one version behind) in a thread while this step trains; the
        # weights are synced only once that generation is done, so a step's responses all come
        # from one policy version and lag training by exactly one step
        ahead = concurrent.futures.ThreadPoolExecutor(1, "rollout") if self.spec.rollout.async_steps else None
        pending: concurrent.futures.Future[Rollout] | None = None
        waited = 0.0  # seconds the step about to train waited for its responses after training ended
        try:
            while step < total:
                started = time.monotonic()
                if pending is not None:
                    rollout = pending.result()
                else:
                    rollout = self.timed_rollout(step, lag=0)
                    waited = time.monotonic() - started
                pending = (ahead.submit(self.timed_rollout, step + 1, 1)
                           if ahead is not None and step + 1 < total else None)
                self.train_step(step, rollout, waited)
                step += 1
                if pending is not None:
                    barrier = time.monotonic()
                    concurrent.futures.wait([pending])  # before the weights move on
                    waited = time.monotonic() - barrier
                if self.stop_signal is not None:
                    self.log({"event": "checkpoint", "step": step, "reason": self.stop_signal,
                              "path": self.trainers.save(step, self.cfg.job_name)})
                    self.log({"event": "stopped", "step": step, "signal": self.stop_signal})
                    # 128 + the signal, as a shell reports it: a head pod stopped mid-run (a node
                    # drained) must not read as a controller that finished every step
                    return 128 + signal.Signals[self.stop_signal.upper()].value
                # the step's checkpoint before the rescale: a rescale that fails (a joining trainer
                # lost before it has the group's state stops the group) must not lose a step that
                # was due one, as it did when the save came after it
                if (interval and step % interval == 0) or step == total:
                    reason = "final" if step == total else "interval"
                    self.log({"event": "checkpoint", "step": step, "reason": reason,
                              "path": self.trainers.save(step, self.cfg.job_name)})
                self.rescale(step)
                self.sync_weights(step)
        finally:
            if ahead is not None:
                ahead.shutdown(wait=True, cancel_futures=True)
        self.evaluate(step)
        self.log({"event": "done", "step": step})
        return 0


def load_config(path: Path) -> RLRunConfig:
    return run_config.read_config(path, RLRunConfig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m huorn.runtime.rl.controller", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config)
        controller = Controller(cfg)
        controller.config_path = args.config
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        # a start refused once Ray was up (actors that cannot start): its actors, still asking
        # for resources, and the cluster it started go now, as after a run, not with the process
        ray.shutdown()
        return 2
    try:
        return controller.run()
    finally:
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
