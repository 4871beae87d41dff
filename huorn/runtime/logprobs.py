"""Log-probabilities of an answer's tokens, in the shapes of OpenAI's two APIs.

Evaluation harnesses score answers with them, RL pipelines compare a policy's probabilities with
the server's, and clients calibrate on them; a server that ignored `logprobs` would hand them an
answer with nothing where they look. They are the model's own distribution over the next token
(`log_softmax` of its logits over the byte vocabulary), before temperature or top_p reshape it
for sampling, as vLLM reports them by default: the same answer has the same numbers however it
was sampled.

Tokens are bytes (huorn.runtime.data.tokenizer). A byte that is a character by itself (ASCII) is
shown as that character; any other is part of a longer UTF-8 character and is shown as OpenAI
shows such partial tokens, `bytes:\\xNN`, with its value in the chat API's `bytes` field.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# OpenAI's limits: the completions API's `logprobs` takes up to 5 alternatives, the chat API's
# `top_logprobs` up to 20
MAX_COMPLETION_ALTERNATIVES = 5
MAX_CHAT_ALTERNATIVES = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One chosen token's log-probability and the most likely tokens at its position. An echoed
    prompt's first token has neither (nothing comes before it), as OpenAI shows it: null."""

    token: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] | None  # (token, log-probability), the likeliest first


def measure(logits: torch.Tensor, chosen: Sequence[int], alternatives: Sequence[int]) -> list[TokenLogprob]:
    """For each row of `logits` [rows, vocabulary] (fp32), its chosen token's log-probability and
    its `alternatives[i]` likeliest tokens; one transfer from the device for the whole step."""
    logprobs = torch.log_softmax(logits, dim=-1)
    index = torch.tensor(list(chosen), dtype=torch.long, device=logits.device)[:, None]
    picked = logprobs.gather(1, index)[:, 0].tolist()
    k = max(alternatives, default=0)
    top_values, top_tokens = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, tokens = top_values.tolist(), top_tokens.tolist()
    return [TokenLogprob(token, logprob, tuple(zip(tokens[i][:n], values[i][:n], strict=True)))
            for i, (token, logprob, n) in enumerate(zip(chosen, picked, alternatives, strict=True))]


def measure_prompt(logits: torch.Tensor, prompts: torch.Tensor, start: int,
                   alternatives: int) -> list[list[TokenLogprob]]:
    """An echoed prompt's log-probabilities, a prefill chunk at a time: `logits` [slots, chunk,
    vocabulary] (fp32) are those of positions start, start + 1, ... of `prompts` [slots, length],
    each the distribution of the token after it; the last position's is the answer's first token's,
    measured when it is chosen. Each slot's entries, in order."""
    slots, length = prompts.shape
    scored = min(logits.shape[1], length - 1 - start)  # positions whose next token is the prompt's
    if scored <= 0:
        return [[] for _ in range(slots)]
    chosen = prompts[:, start + 1: start + 1 + scored].reshape(-1).tolist()
    flat = measure(logits[:, :scored].reshape(slots * scored, -1), chosen, [alternatives] * len(chosen))
    return [flat[i * scored:(i + 1) * scored] for i in range(slots)]


def token_text(token: int) -> str:
    """A byte as the APIs show a token: the character, or `bytes:\\xNN` for part of one."""
    return chr(token) if token < 0x80 else f"bytes:\\x{token:02x}"


def text_offsets(entries: Sequence[TokenLogprob], offset: int = 0) -> list[int]:
    """Each token's `text_offset`: the characters of the answer's text decoded before it (from
    `offset`), as its text is decoded a byte at a time (a token inside a multi-byte character
    shares that character's offset). A stream counts them as it decodes: a chunk may begin inside
    a character, and decoded on its own it would count that character's bytes apart."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], offset
    for entry in entries:
        offsets.append(at)
        at += len(decoder.decode(bytes([entry.token])))
    return offsets


def completion_logprobs(entries: Sequence[TokenLogprob], offsets: Sequence[int] | None = None) -> dict:
    """The completions API's `logprobs` object; `text_offset` from `offsets` (a stream's, counted
    across its chunks), else counted from the text's start. `top_logprobs` holds the alternatives
    asked for and the chosen token, as OpenAI and vLLM do; null for an echoed prompt's first."""
    offsets = text_offsets(entries) if offsets is None else list(offsets)
    return {"tokens": [token_text(e.token) for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.top is None or e.logprob is None else
                             {**{token_text(t): v for t, v in e.top}, token_text(e.token): e.logprob}
                             for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict:
    """The chat API's `logprobs` object: `content`, one item per token (never an echoed prompt's)."""
    return {"content": [{"token": token_text(e.token), "logprob": e.logprob, "bytes": [e.token],
                         "top_logprobs": [{"token": token_text(t), "logprob": v, "bytes": [t]}
                                          for t, v in e.top or ()]}
                        for e in entries]}

