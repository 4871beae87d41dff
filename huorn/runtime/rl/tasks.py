"""Prompts with verifiable answers, and the rewards that check them.

The datasets ask the questions the shipped math corpus teaches ("Q: What is 12 + 7?\\nA: 19"),
so a policy pretrained on that corpus knows the format and RL improves what it answers:
`arithmetic` with the corpus's operands (up to 999), `arithmetic-small` with operands up to 20,
which a small model can learn on a CPU. Prompts are a pure function of (seed, step, round,
index), like the trainer's batches: a resumed run asks the questions the stopped one would have
asked next, and held-out prompts (a step stream training never reaches) are never trained on.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from huorn.api import rl
from huorn.runtime.data import corpora

DATASETS = {"arithmetic": 999, "arithmetic-small": 20}  # name → largest operand
REWARDS = ("math-exact", "format")
_HELD_OUT = 2**40
_INTEGER = re.compile(r"^-?\d+$")


@dataclass(frozen=True)
class Prompt:
    text: str  # what the policy continues, ending in "A:"
    answer: str


def check_reward(reward: rl.RewardSpec) -> None:
    """Refuse, naming the field, what this runtime cannot score."""
    if reward.type not in REWARDS:
        raise ValueError(f"spec.reward.type: {reward.type} needs a code sandbox, which Huorn's RL runtime "
                         f"does not ship; use one of {', '.join(REWARDS)}")
    if reward.dataset not in DATASETS:
        raise ValueError(f"spec.reward.dataset: {reward.dataset!r} is not a shipped dataset; use one of "
                         f"{', '.join(DATASETS)}")


def prompts(dataset: str, seed: int, step: int, count: int, round_: int = 0) -> list[Prompt]:
    """`count` prompts of training step `step` (round > 0: DAPO's extra draws within a step)."""
    rng = random.Random(f"{seed}/{step}/{round_}")
    out = []
    for _ in range(count):
        question, answer = corpora.arithmetic_question(rng, DATASETS[dataset])
        out.append(Prompt(f"Q: {question}\nA:", answer))
    return out


def held_out(dataset: str, seed: int, count: int) -> list[Prompt]:
    """Evaluation prompts, drawn apart from every training step's."""
    return prompts(dataset, seed, _HELD_OUT, count)


def first_line(response: str) -> str:
    """The answer as the corpus writes it: the text up to the first newline, stripped."""
    return response.split("\n", 1)[0].strip()


def score(reward: rl.RewardSpec, prompt: Prompt, response: str) -> float:
    """math-exact: 1 when the first line is the answer; format: 1 when it is an integer at all."""
    line = first_line(response)
    if reward.type == "math-exact":
        return 1.0 if line == prompt.answer else 0.0
    return 1.0 if _INTEGER.match(line) else 0.0
