"""What a completion request asks the model to continue, as tokens: the one reading that the
replica and the prefix router share, so the router places a request by the very tokens the
replica will prefill."""

from __future__ import annotations

from huorn.runtime import chat

# OpenAI's limit on the prompts of one completions request
MAX_PROMPTS = 2048


def _one(text: object) -> list[int] | None:
    """A prompt as a string or its token ids; None for anything else."""
    if isinstance(text, str) and text:
        return list(text.encode("utf-8"))
    if isinstance(text, list) and text and all(type(t) is int and 0 <= t < 256 for t in text):
        return text
    return None


def prompts_of(body: dict, is_chat: bool) -> list[list[int]]:
    """A chat's messages through the chat template, or the completions API's `prompt` in each of
    OpenAI's forms: a string, its token ids (here bytes, 0-255: a client that tokenises itself,
    as evaluation harnesses do, sends the prompt's UTF-8 bytes), or a list of either, each its own
    prompt (evaluation harnesses batch theirs so). ValueError naming the field otherwise."""
    if is_chat:
        return [list(chat.render(body.get("messages")).encode("utf-8"))]
    text = body["prompt"]
    if (single := _one(text)) is not None:
        return [single]
    if isinstance(text, list) and text and all(isinstance(p, str | list) for p in text):
        if len(text) > MAX_PROMPTS:
            raise ValueError(f"prompt: {len(text)} prompts; give at most {MAX_PROMPTS} a request")
        prompts = []
        for i, each in enumerate(text):
            if (tokens := _one(each)) is None:
                raise ValueError(f"prompt[{i}]: give a non-empty string, or its token ids (bytes: "
                                 "integers 0-255)")
            prompts.append(tokens)
        return prompts
    raise ValueError("prompt: give a non-empty string, its token ids (bytes: integers 0-255), or a "
                     "list of prompts")


def tokens_of(body: dict, is_chat: bool) -> list[int]:
    """The first prompt's tokens: where the prefix router places a request (the prompts an
    evaluation harness batches mostly share their leading blocks)."""
    return prompts_of(body, is_chat)[0]
