"""Prompts with verifiable answers, and the rewards that check them.

The datasets ask the questions the shipped math corpus teaches ("Q: What is 12 + 7?\\nA: 19"),
so a policy pretrained on that corpus knows the format and RL improves what it answers:
`arithmetic` with the corpus's operands (up to 999), `arithmetic-small` with operands up to 20,
which a small model can learn on a CPU. Prompts are a pure function of (seed, step, round,
index), like the trainer's batches: a resumed run asks the questions the stopped one would have
asked next.

Held-out questions are split off by their content: a question is held out iff a stable hash of
its text (blake2b, not Python's per-process salted hash()) is 0 mod 10. Training draws none of
them, and the held-out set is deduplicated, so no question of it is ever trained on. Before, it
was another random stream over the same question space, which `arithmetic-small` (1,763
distinct questions) makes small: 46-52 % of 256 held-out prompts were among those a 60-step
GRPO or Lite PPO run trained on, 80-84 % among those DAPO drew, and the set repeated
questions. `arithmetic-small` has 179 held-out questions, so asking more gives all 179.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

from huorn.api import rl
from huorn.runtime.data import corpora

DATASETS = {"arithmetic": 999, "arithmetic-small": 20}  # name → largest operand
REWARDS = ("math-exact", "format")
_HELD_OUT_MODULUS = 10  # one question in ten is held out
# Consecutive draws without a new held-out question after which a dataset's held-out set is taken
# as exhausted: arithmetic-small's rarest question comes once in 2,205 draws, so one is missed
# with probability e^-22.
_EXHAUSTED = 50_000
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


def is_held_out(question: str) -> bool:
    """Whether a question belongs to the held-out split: by its text alone, the same in every
    process, run and seed."""
    digest = hashlib.blake2b(question.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % _HELD_OUT_MODULUS == 0


def prompts(dataset: str, seed: int, step: int, count: int, round_: int = 0) -> list[Prompt]:
    """`count` prompts of training step `step` (round > 0: DAPO's extra draws within a step):
    the stream's questions, skipping the held-out ones."""
    rng = random.Random(f"{seed}/{step}/{round_}")
    out: list[Prompt] = []
    while len(out) < count:
        question, answer = corpora.arithmetic_question(rng, DATASETS[dataset])
        if not is_held_out(question):
            out.append(Prompt(f"Q: {question}\nA:", answer))
    return out


def held_out(dataset: str, seed: int, count: int) -> list[Prompt]:
    """Evaluation prompts: `count` distinct held-out questions (none of which training draws),
    in the order a stream of the seed first draws them; all of them where the dataset has
    fewer (arithmetic-small: 179)."""
    rng = random.Random(f"{seed}/held-out")
    seen: set[str] = set()
    out: list[Prompt] = []
    misses = 0
    while len(out) < count and misses < _EXHAUSTED:
        question, answer = corpora.arithmetic_question(rng, DATASETS[dataset])
        if question in seen or not is_held_out(question):
            misses += 1
            continue
        misses = 0
        seen.add(question)
        out.append(Prompt(f"Q: {question}\nA:", answer))
    return out


def first_line(response: str) -> str:
    """The answer as the corpus writes it: the text up to the first newline, stripped."""
    return response.split("\n", 1)[0].strip()


def score(reward: rl.RewardSpec, prompt: Prompt, response: str) -> float:
    """math-exact: 1 when the first line is the answer; format: 1 when it is an integer at all."""
    line = first_line(response)
    if reward.type == "math-exact":
        return 1.0 if line == prompt.answer else 0.0
    return 1.0 if _INTEGER.match(line) else 0.0
