"""The reward role of a ROLL-style RL job: scores responses against the verifiable answers.

It lives apart from the model roles (huorn.runtime.rl.workers) because Ray imports an actor's
module in the actor's process: this one needs no torch, so a reward worker starts in the 0.4 s
of CPU its imports take instead of the 4-5 s of a model role's, and a job can run many of them
on spare CPUs."""

from __future__ import annotations

from typing import Any

from huorn.api import rl
from huorn.runtime.rl import tasks


class RewardWorker:
    def __init__(self, spec_wire: dict) -> None:
        self.spec = rl.RLJobSpec.model_validate(spec_wire)

    def score(self, items: list[dict[str, Any]]) -> list[list[float]]:
        prompt = tasks.Prompt
        return [[tasks.score(self.spec.reward, prompt(item["text"], item["answer"]), response)
                 for response in item["responses"]] for item in items]
