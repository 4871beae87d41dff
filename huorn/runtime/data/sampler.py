"""Batches whose content is a pure function of (seed, global step, micro-batch index).

No sampler state is carried between steps, so nothing about data order has to be saved in a
checkpoint beyond the step number, and a resize continues with exactly the samples the old
world size would have read next: micro-batch m of step s is the same tensor whichever rank
computes it. Each sequence is a random window of the training split of a source chosen by the
mixture weights (sampling with replacement, which makes "epoch" bookkeeping unnecessary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from huorn.runtime.data import build, corpora

# The validation set is drawn with this pseudo-step, which training (steps >= 0) never reaches.
_VALIDATION_STEP = 2**62
# The held-out tokens past this share steer training (DDK's reweighting, D-CPT's probes); the
# evaluation (validation loss, the evaluator) reads only the tokens before it. One split served
# both, so the weights were chosen on the very windows the evaluation then reported: a choice
# made on the test set.
_EVALUATION_SHARE = 0.8


def held_out_part(tokens: np.ndarray, part: str) -> np.ndarray:
    """The evaluation ("val") or steering ("steer") part of a source's held-out tokens."""
    cut = int(len(tokens) * _EVALUATION_SHARE)
    return tokens[:cut] if part == "val" else tokens[cut:]


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    train: np.ndarray
    val: np.ndarray


def _load_tokens(path: Path) -> np.ndarray:
    return np.memmap(path, dtype=np.uint8, mode="r")


def _source_problem(name: str, path: str | None) -> str | None:
    """Why a source cannot be opened, or None: a path without a built corpus, or a name that is
    neither a shipped corpus nor given a path."""
    if path:
        directory = Path(path)
        if not (directory / "train.bin").is_file() or not (directory / "val.bin").is_file():
            return (f"has path {path!r}, which must be a directory holding train.bin and val.bin (uint8 "
                    "byte tokens) as written by `python -m huorn.runtime.data.build`")
        return None
    if name not in corpora.CORPORA:
        return (f"is not a shipped corpus ({', '.join(corpora.CORPORA)}); set its path to a built "
                "corpus directory")
    return None


def check_sources(sources: Sequence[tuple[str, str | None]]) -> None:
    """Refuse a job's (name, path) sources before any process starts: a trainer would refuse them
    only after its gang formed (and under torchrun, again at every restart)."""
    for index, (name, path) in enumerate(sources):
        problem = _source_problem(name, path)
        if problem is not None:
            field = f"spec.data.sources[{index}].{'path' if path else 'name'}"
            raise ValueError(f"{field}: data source {name!r} {problem}")


def open_source(name: str, weight: float, path: str | None = None, data_dir: Path | None = None) -> Source:
    """A source from a built corpus directory (train.bin/val.bin): a shipped one by name, built on
    first use, or any directory given as `path`."""
    problem = _source_problem(name, path)
    if problem is not None:
        raise ValueError(f"data source {name!r} {problem}")
    directory = Path(path) if path else build.ensure_corpus(name, data_dir)
    return Source(name, weight, _load_tokens(directory / "train.bin"), _load_tokens(directory / "val.bin"))


class Mixture:
    """Weighted sources and the deterministic draw of micro-batches from them."""

    def __init__(self, sources: list[Source], seed: int, context: int) -> None:
        active = [s for s in sources if s.weight > 0]
        if not active:
            raise ValueError("data.sources: every weight is 0; give at least one source a positive weight")
        for source in active:
            if len(source.train) <= context + 1 or len(held_out_part(source.val, "val")) <= context + 1:
                raise ValueError(f"data source {source.name!r} is shorter than model.context+1 "
                                 f"({context + 1} tokens; the evaluation reads the first "
                                 f"{_EVALUATION_SHARE:.0%} of val.bin); lower model.context or use a "
                                 "larger corpus")
        self.sources = active
        self.seed = seed
        self.context = context
        weights = np.array([s.weight for s in active], dtype=np.float64)
        self.probabilities = weights / weights.sum()

    def with_probabilities(self, probabilities: list[float]) -> Mixture:
        """The same sources drawn with other probabilities (DDK's reweighting): still a pure
        function of (seed, step, index) once the probabilities are fixed."""
        if len(probabilities) != len(self.sources) or min(probabilities) < 0 or sum(probabilities) <= 0:
            raise ValueError(f"need {len(self.sources)} probabilities, non-negative with a positive sum, "
                             f"got {probabilities}")
        mixture = Mixture(self.sources, self.seed, self.context)
        mixture.probabilities = np.asarray(probabilities, dtype=np.float64) / sum(probabilities)
        return mixture

    def only(self, index: int) -> Mixture:
        """Source `index` alone: its own validation loss."""
        return Mixture([self.sources[index]], self.seed, self.context)

    def _draw(self, step: int, index: int, sequences: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, step, index])
        choice = rng.choice(len(self.sources), size=sequences, p=self.probabilities)
        uniform = rng.random(sequences)
        rows = np.empty((sequences, self.context + 1), dtype=np.int64)
        for row, (source_index, u) in enumerate(zip(choice, uniform, strict=True)):
            source = self.sources[source_index]
            tokens = source.train if split == "train" else held_out_part(source.val, split)
            if len(tokens) <= self.context + 1:  # only the steering part can be: __init__ checked
                raise ValueError(f"data source {source.name!r}: the held-out tokens that steer DDK and "
                                 f"D-CPT (the last {1 - _EVALUATION_SHARE:.0%} of val.bin, {len(tokens)} "
                                 f"tokens) are no longer than model.context+1 ({self.context + 1}); "
                                 "lower model.context or give the source a larger val.bin")
            start = int(u * (len(tokens) - self.context - 1))
            rows[row] = tokens[start : start + self.context + 1]
        data = torch.from_numpy(rows)
        return data[:, :-1], data[:, 1:]

    def micro_batch(self, step: int, index: int, sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, targets) of micro-batch `index` of global step `step`, each [sequences, context]."""
        if step < 0 or index < 0:
            raise ValueError(f"step and micro-batch index must be non-negative, got {step}, {index}")
        return self._draw(step, index, sequences, "train")

    def validation_batch(self, index: int, sequences: int,
                         part: str = "val") -> tuple[torch.Tensor, torch.Tensor]:
        """A fixed validation batch from the held-out documents, the same for every run with this
        seed: from the evaluation part ("val"), or from the part that steers training ("steer")."""
        if part not in ("val", "steer"):
            raise ValueError(f"part: 'val' or 'steer', got {part!r}")
        return self._draw(_VALIDATION_STEP, index, sequences, part)


def assign_micro_batches(total: int, world_size: int, rank: int) -> list[int]:
    """Micro-batch indices that `rank` computes: round-robin, so the set over all ranks is always
    0..total-1 exactly once whatever the world size (ranks differ by at most one micro-batch)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    return list(range(rank, total, world_size))


def build_mixture(sources: list[tuple[str, float, str | None]], seed: int, context: int,
                  data_dir: Path | None = None) -> Mixture:
    """Mixture from (name, weight, path) triples, as a TrainingJob's data.sources lists them."""
    return Mixture([open_source(n, w, p, data_dir) for n, w, p in sources], seed, context)
