"""A data-parallel RL test's spec and batches, without Ray: the GPU test's member processes
import them on machines that carry no Ray."""

from __future__ import annotations

import torch

MODEL = {"layers": 2, "width": 32, "heads": 2, "context": 64}
SPEC = {"virtualCluster": "x", "model": MODEL, "algorithm": {"name": "grpo", "groupSize": 2},
        "optimization": {"learningRate": 3e-3, "promptsPerStep": 3, "miniBatches": 2, "updateEpochs": 2}}


def make_batch(seed: int, groups: int = 5) -> list[dict]:
    """Groups of two responses of unequal lengths, some tokens masked, as the controller builds."""
    g = torch.Generator().manual_seed(seed)
    batch = []
    for k in range(groups):
        length = 3 + (k + seed) % 3
        mask = torch.ones(2, length)
        mask[1, -1] = 0
        batch.append({"prompt": list(f"Q: What is {k} + {seed}?\nA:".encode()),
                      "tokens": torch.randint(32, 120, (2, length), generator=g), "mask": mask,
                      "advantages": torch.randn(2, generator=g),
                      "reference": torch.randn(2, length, generator=g) * 0.1 - 4})
    return batch
