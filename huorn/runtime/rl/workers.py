"""The worker roles of a ROLL-style RL job, as plain classes that the controller turns into Ray
actors (so each runs in a process of its own, placed by Ray) and that tests can also call
directly.

- PolicyTrainer (actor-train) holds the policy and its optimiser, recomputes the sampled
  responses' log-probabilities (π_old: the rollout's own for responses sampled by older
  weights), applies the clipped-surrogate update and writes checkpoints.
  Several are one data-parallel group (torch.distributed, gloo or NCCL): each takes its share of
  every mini-batch and their gradients are summed, so the update is the one a single trainer
  would make (`algorithms.Totals`); huorn.runtime.rl.pools forms and re-forms the group.
- RolloutWorker (actor-infer) holds a copy of the policy, refreshed from the trainer's weights
  each step (one put into Ray's object store, read by every worker), and samples groups.
- ReferenceWorker holds the frozen starting policy, for the KL term.
- RewardWorker (huorn.runtime.rl.rewarding, a module without torch) scores responses against
  the verifiable answers.
"""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from huorn import models
from huorn.api import rl, training
from huorn.models import decay
from huorn.runtime import checkpoint
from huorn.runtime import config as run_config
from huorn.runtime.rl import algorithms, policy

T = TypeVar("T")
_GROUP_TIMEOUT = datetime.timedelta(seconds=300)  # a member that never joins or answers


def _device(wanted: str) -> torch.device:
    if wanted == "cuda" and not torch.cuda.is_available():
        # Before the model is built: a role Ray gave GPUs to, whose torch is a CPU-only build,
        # trained on the CPU unnoticed while holding them (a GPU job's config asks for "cuda",
        # which the controller passes to the roles it gives GPUs: controller.role_device).
        raise ValueError("device cuda: this RL role was given GPUs, but its torch has no CUDA (a "
                         "CPU-only build, or no GPU visible); run a CUDA build of the image (the "
                         "chart's default job image, <tag>-cu126)")
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def build_policy(model_spec: training.ModelSpec, init: str | None, seed: int, device: torch.device
                 ) -> torch.nn.Module:
    """The spec's architecture, from `init` (a Huorn checkpoint of the same architecture) or, with
    none, freshly initialised from the seed."""
    torch.manual_seed(seed)
    model = models.build_model(run_config.build_model_config(model_spec)).to(device)
    if init:
        try:
            path = checkpoint.resolve(Path(init))
        except ValueError as error:  # NB: it named the path alone, not the field nor the fix
            raise ValueError(f"spec.initCheckpoint: {error}; point it at a Huorn checkpoint (a step-* "
                             "directory, or a root holding one) of spec.model's architecture, or leave "
                             "it out to start from fresh weights") from None
        meta = checkpoint.read_meta(path)
        if meta.get("model") is not None and training.ModelSpec.model_validate(meta["model"]) != model_spec:
            raise ValueError(f"spec.initCheckpoint: {path} holds a model other than spec.model "
                             f"({meta['model']}); set spec.model to that checkpoint's architecture")
        with warnings.catch_warnings():  # one process, no group: what DCP warns about is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            checkpoint.load_checkpoint(path, model, None)
    return model


def _one_thread() -> None:
    # Ray's worker processes would otherwise each start a thread per core and fight over them.
    # One whatever the node's environment says: the controller no longer gives its actors a
    # runtime environment with OMP_NUM_THREADS=1 (it started each in a fresh worker).
    torch.set_num_threads(1)


class PolicyTrainer:
    def __init__(self, spec_wire: dict, init: str | None, checkpoint_root: str, device: str) -> None:
        _one_thread()
        self.spec = rl.RLJobSpec.model_validate(spec_wire)
        self.settings = algorithms.resolve(self.spec.algorithm)
        self.device = _device(device)
        opt = self.spec.optimization
        self.model = build_policy(self.spec.model, init, opt.seed, self.device)
        self.optimizer = decay.adamw(self.model, opt.learning_rate, opt.weight_decay)
        self.root = Path(checkpoint_root)
        self.rank, self.world = 0, 1
        self._store: dist.TCPStore | None = None  # the group's store, held by its rank 0

    # -- the data-parallel group ---------------------------------------------------------------
    def host_group(self, host: str | None = None) -> tuple[str, int]:
        """Where the group this trainer will lead (as rank 0) meets: `host` (default: its Ray
        node's address) and the port of a store opened here on a free port (port 0: no race for
        a port picked earlier)."""
        if host is None:
            import ray  # in the actor's process, which Ray started: already imported there

            host = ray.util.get_node_ip_address()
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                    timeout=_GROUP_TIMEOUT)
        return host, int(self._store.port)

    def join_group(self, rank: int, world: int, host: str, port: int) -> int:
        """Enter the group formed by `host_group`; each member calls it at once (it returns
        when all have). The state must already be the group's (`load_state` for a joiner)."""
        store = self._store if rank == 0 else dist.TCPStore(host, port, is_master=False,
                                                            timeout=_GROUP_TIMEOUT)
        assert store is not None, "rank 0 must call host_group first"
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world, timeout=_GROUP_TIMEOUT)
        self.rank, self.world = rank, world
        return rank

    def leave_group(self) -> None:
        """Out of the group (before it is formed again at another size); the state stays."""
        if dist.is_initialized():
            dist.destroy_process_group()
        self._store = None
        self.rank, self.world = 0, 1

    def state(self) -> dict[str, Any]:
        """The policy and its optimiser, for a trainer that joins: copies on the CPU (Ray's object
        store carries host memory; load_state puts each on the joiner's device). Copies even on
        a CPU trainer, where `.cpu()` would alias: a joiner that received the live moments
        through shared memory (or in one process) stepped them a second time."""
        def snapshot(value: Any) -> Any:
            return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value

        optimizer = self.optimizer.state_dict()
        moments = {i: {k: snapshot(v) for k, v in s.items()} for i, s in optimizer["state"].items()}
        return {"model": {k: snapshot(v) for k, v in self.model.state_dict().items()},
                "optimizer": {**optimizer, "state": moments}}

    def load_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])  # moves the moments to the model's device

    def resume(self) -> int:
        """The step to start at: after the newest checkpoint of this run, or 0."""
        latest = checkpoint.find_latest(self.root)
        if latest is None:
            return 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            meta = checkpoint.load_checkpoint(latest, self.model, self.optimizer, local=True)
        return int(meta["step"])

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def update(self, batch: list[dict[str, Any]]) -> dict[str, float]:
        """updateEpochs passes over the batch in miniBatches optimiser steps. π_old is the policy
        that sampled each group: an item's `behaviour` log-probabilities where the controller
        gives them (a group sampled by older weights than these: asyncSteps 1), else the
        log-probabilities recomputed here before any step (the same weights that sampled), at
        the rollout's temperature as π is (policy.response_logprobs)."""
        opt = self.spec.optimization
        temperature = self.spec.rollout.temperature
        # Eval mode, gradients on: π and π_old must be the distribution the rollout sampled and
        # the reference scores, both in eval mode. In train mode an MoE policy dropped the tokens
        # past each expert's capacity (capacityFactor), so π_old was another distribution and the
        # KL to an identical reference was not 0 at the first step. (Dropout is a training
        # regulariser RL does without, as its frameworks do.)
        self.model.eval()
        # miniBatches optimiser steps a pass, sizes differing by at most one: ceil-sized chunks gave
        # fewer steps than asked (4 prompts in 3 made 2 of 2), and fewer again as dynamic sampling
        # dropped groups
        count = min(opt.mini_batches, len(batch))
        minibatches = [share(list(range(len(batch))), k, count) for k in range(count)]
        shares = [share(chosen, self.rank, self.world) for chosen in minibatches]
        old = {i: self._old(batch[i], temperature) for mine in shares for i in mine}
        sums = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0}
        updates = 0
        for _ in range(opt.update_epochs):
            for chosen, mine in zip(minibatches, shares, strict=True):
                # One trainer: its plain loss. A group: each member's part of the mini-batch's loss,
                # whose gradients add up to the whole one's (even a member with no row takes part).
                totals = algorithms.Totals.of([batch[i]["mask"] for i in chosen]) if self.world > 1 else None
                self.optimizer.zero_grad(set_to_none=True)
                values = torch.zeros(4, dtype=torch.float64, device=self.device)
                if mine:
                    new = [policy.response_logprobs(self.model, batch[i]["prompt"], batch[i]["tokens"],
                                                    temperature)
                           for i in mine]
                    parts = algorithms.policy_loss(
                        _pad(new), _pad([old[i] for i in mine]),
                        torch.cat([batch[i]["advantages"] for i in mine]).to(self.device),
                        _pad([batch[i]["mask"] for i in mine]).to(self.device), self.settings,
                        _pad([batch[i]["reference"] for i in mine]).to(self.device)
                        if self.settings.kl_coefficient > 0 else None, totals)
                    parts.loss.backward()
                    values += torch.tensor([float(parts.loss.detach()), parts.policy, parts.kl,
                                            parts.clip_fraction], dtype=torch.float64, device=self.device)
                if self.world > 1:
                    self._sum_gradients()
                    dist.all_reduce(values)
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
                updates += 1
                for key, value in zip(("loss", "policy_loss", "kl", "clip_fraction"), values.tolist(),
                                      strict=True):
                    sums[key] += value
                sums["grad_norm"] += float(norm)
        means = {k: v / max(1, updates) for k, v in sums.items()}
        return means | {"updates": updates, "trainers": self.world}

    @torch.no_grad()
    def _old(self, item: dict[str, Any], temperature: float) -> torch.Tensor:
        if item.get("behaviour") is not None:
            return item["behaviour"].to(self.device)
        return policy.response_logprobs(self.model, item["prompt"], item["tokens"], temperature)

    def _sum_gradients(self) -> None:
        """One all-reduce of every gradient, flattened (a parameter that got none counts zero).
        Not DDP: its mean over members would weigh a short share like a full one, and it needs
        a forward pass on every member, which one with no row of the mini-batch has not."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def save(self, step: int, job: str) -> str:
        path = checkpoint.save_checkpoint(self.root, step, self.model, self.optimizer,
                                          {"step": step, "job": job, "model": self.spec.model.to_wire()},
                                          rank=0, barrier=lambda: None, local=True)
        return str(path)


def share(items: list[T], rank: int, world: int) -> list[T]:
    """Member `rank`'s contiguous part of `items`: sizes differ by at most one, earlier members
    take the larger parts."""
    base, extra = divmod(len(items), world)
    begin = rank * base + min(rank, extra)
    return items[begin:begin + base + (1 if rank < extra else 0)]


def _pad(rows: list[torch.Tensor]) -> torch.Tensor:
    """Responses of different prompts stacked to one [B, T] (right-padded; the mask hides it)."""
    width = max(r.shape[1] for r in rows)
    return torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in rows])


class RolloutWorker:
    def __init__(self, spec_wire: dict, device: str) -> None:
        _one_thread()
        self.spec = rl.RLJobSpec.model_validate(spec_wire)
        self.device = _device(device)
        self.model = build_policy(self.spec.model, None, 0, self.device)
        self.version = -1

    def load(self, weights: dict[str, torch.Tensor], version: int) -> int:
        self.model.load_state_dict(weights)
        self.version = version
        return version

    def generate(self, prompts: list[tuple[str, str, int]], greedy: bool = False) -> list[dict[str, Any]]:
        """Each prompt's group, sampled from its own seed (the third field): a prompt's responses
        are the same whichever worker it is dealt to and however many there are."""
        rollout = self.spec.rollout
        group = 1 if greedy else self.spec.algorithm.group_size
        out = []
        for text, answer, seed in prompts:
            generator = torch.Generator(device=self.device).manual_seed(seed)
            prompt = list(text.encode("utf-8"))
            samples = policy.sample(self.model, prompt, group, rollout.max_new_tokens,
                                    0.0 if greedy else rollout.temperature, rollout.top_p, generator)
            # the sampling log-probabilities and the weights' version: π_old of a group the
            # trainer gets after its weights have moved on (controller.training_batch)
            out.append({"prompt": prompt, "text": text, "answer": answer, "tokens": samples.tokens,
                        "mask": samples.mask, "responses": samples.texts(), "version": self.version,
                        "logprobs": samples.sampled_logprobs})
        return out


class ReferenceWorker:
    def __init__(self, spec_wire: dict, init: str | None, device: str) -> None:
        _one_thread()
        self.spec = rl.RLJobSpec.model_validate(spec_wire)
        self.model = build_policy(self.spec.model, init, self.spec.optimization.seed, _device(device))
        self.model.eval()

    @torch.no_grad()
    def logprobs(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        """π_ref of each group's responses, at the rollout's temperature as the trainer's π."""
        temperature = self.spec.rollout.temperature
        return [policy.response_logprobs(self.model, item["prompt"], item["tokens"], temperature).cpu()
                for item in items]
