"""The worker roles of a ROLL-style RL job, as plain classes that the controller turns into Ray
actors (so each runs in a process of its own, placed by Ray) and that tests can also call
directly.

- PolicyTrainer (actor-train) holds the policy and its optimiser, recomputes the sampled
  responses' log-probabilities, applies the clipped-surrogate update and writes checkpoints.
- RolloutWorker (actor-infer) holds a copy of the policy, refreshed from the trainer's weights
  each step (one put into Ray's object store, read by every worker), and samples groups.
- ReferenceWorker holds the frozen starting policy, for the KL term.
- RewardWorker (huorn.runtime.rl.rewarding, a module without torch) scores responses against
  the verifiable answers.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from huorn import models
from huorn.api import rl, training
from huorn.runtime import checkpoint
from huorn.runtime import config as run_config
from huorn.runtime.rl import algorithms, policy


def _device(wanted: str) -> torch.device:
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
        path = checkpoint.resolve(Path(init))
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
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


class PolicyTrainer:
    def __init__(self, spec_wire: dict, init: str | None, checkpoint_root: str, device: str) -> None:
        _one_thread()
        self.spec = rl.RLJobSpec.model_validate(spec_wire)
        self.settings = algorithms.resolve(self.spec.algorithm)
        self.device = _device(device)
        opt = self.spec.optimization
        self.model = build_policy(self.spec.model, init, opt.seed, self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=opt.learning_rate, betas=(0.9, 0.95),
                                           weight_decay=opt.weight_decay)
        self.root = Path(checkpoint_root)

    def resume(self) -> int:
        """The step to start at: after the newest checkpoint of this run, or 0."""
        latest = checkpoint.find_latest(self.root)
        if latest is None:
            return 0
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            meta = checkpoint.load_checkpoint(latest, self.model, self.optimizer)
        return int(meta["step"])

    def weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def update(self, batch: list[dict[str, Any]]) -> dict[str, float]:
        """updateEpochs passes over the batch in miniBatches optimiser steps. The first pass's
        log-probabilities, taken before any step, are π_old (recomputed here rather than trusted
        from sampling, whose temperature and top-p make another distribution)."""
        opt = self.spec.optimization
        self.model.train()
        with torch.no_grad():
            old = [policy.response_logprobs(self.model, item["prompt"], item["tokens"]) for item in batch]
        order = list(range(len(batch)))
        per_step = max(1, -(-len(batch) // opt.mini_batches))
        totals = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, "clip_fraction": 0.0, "grad_norm": 0.0}
        updates = 0
        for _ in range(opt.update_epochs):
            for begin in range(0, len(order), per_step):
                chosen = order[begin:begin + per_step]
                new = [policy.response_logprobs(self.model, batch[i]["prompt"], batch[i]["tokens"])
                       for i in chosen]
                parts = algorithms.policy_loss(
                    _pad(new), _pad([old[i] for i in chosen]),
                    torch.cat([batch[i]["advantages"] for i in chosen]).to(self.device),
                    _pad([batch[i]["mask"] for i in chosen]).to(self.device), self.settings,
                    _pad([batch[i]["reference"] for i in chosen]).to(self.device)
                    if self.settings.kl_coefficient > 0 else None)
                self.optimizer.zero_grad(set_to_none=True)
                parts.loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                self.optimizer.step()
                updates += 1
                totals["loss"] += float(parts.loss.detach())
                totals["policy_loss"] += parts.policy
                totals["kl"] += parts.kl
                totals["clip_fraction"] += parts.clip_fraction
                totals["grad_norm"] += float(norm)
        return {k: v / max(1, updates) for k, v in totals.items()} | {"updates": updates}

    def save(self, step: int, job: str) -> str:
        path = checkpoint.save_checkpoint(self.root, step, self.model, self.optimizer,
                                          {"step": step, "job": job, "model": self.spec.model.to_wire()},
                                          rank=0, barrier=lambda: None)
        return str(path)


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

    def generate(self, prompts: list[tuple[str, str]], seed: int, greedy: bool = False
                 ) -> list[dict[str, Any]]:
        rollout = self.spec.rollout
        generator = torch.Generator(device=self.device).manual_seed(seed)
        group = 1 if greedy else self.spec.algorithm.group_size
        out = []
        for text, answer in prompts:
            prompt = list(text.encode("utf-8"))
            samples = policy.sample(self.model, prompt, group, rollout.max_new_tokens,
                                    0.0 if greedy else rollout.temperature, rollout.top_p, generator)
            out.append({"prompt": prompt, "text": text, "answer": answer, "tokens": samples.tokens,
                        "mask": samples.mask, "responses": samples.texts(), "version": self.version})
        return out


class ReferenceWorker:
    def __init__(self, spec_wire: dict, init: str | None, device: str) -> None:
        _one_thread()
        self.spec = rl.RLJobSpec.model_validate(spec_wire)
        self.model = build_policy(self.spec.model, init, self.spec.optimization.seed, _device(device))
        self.model.eval()

    @torch.no_grad()
    def logprobs(self, items: list[dict[str, Any]]) -> list[torch.Tensor]:
        return [policy.response_logprobs(self.model, item["prompt"], item["tokens"]).cpu() for item in items]
