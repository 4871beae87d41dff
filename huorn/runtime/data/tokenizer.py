"""Byte-level tokenizer: every UTF-8 byte is a token, so the vocabulary is exactly 256.

Why bytes and not a trained BPE: the runtime must work on a machine with no network and no
prebuilt vocabulary file, every string round-trips exactly, and a corpus file is simply the
raw bytes stored as uint8, which can be memory-mapped without any decoding step.
"""

from __future__ import annotations

import numpy as np

VOCABULARY = 256


def encode(text: str) -> np.ndarray:
    """Token ids of `text` as uint8 (the storage dtype of every corpus file)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens: np.ndarray | list[int]) -> str:
    """Text of `tokens`; bytes that do not form valid UTF-8 become U+FFFD rather than raising,
    because a model's samples are arbitrary byte sequences."""
    array = np.asarray(tokens)
    if array.size and (array.min() < 0 or array.max() >= VOCABULARY):
        raise ValueError(f"token ids must lie in [0, {VOCABULARY}); got {array.min()}..{array.max()}")
    return array.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
