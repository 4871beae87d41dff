"""What a completion request asks the model to continue, as tokens: the one reading that the
replica and the prefix router share, so the router places a request by the very tokens the
replica will prefill."""

from __future__ import annotations

from huorn.runtime import chat


def tokens_of(body: dict, is_chat: bool) -> list[int]:
    """A chat's messages through the chat template, or the completions API's `prompt`: a
    string, or its token ids as OpenAI also takes them (here bytes, 0-255: a client that
    tokenises itself, as evaluation harnesses do, sends the prompt's UTF-8 bytes). ValueError
    naming the field otherwise. A list of one prompt is that prompt, as OpenAI reads it (LangChain
    and evaluation harnesses send that form); several prompts in one request are refused (send
    one each)."""
    if is_chat:
        return list(chat.render(body.get("messages")).encode("utf-8"))
    text = body["prompt"]
    if isinstance(text, list) and len(text) == 1 and isinstance(text[0], str | list):
        text = text[0]
    if isinstance(text, str) and text:
        return list(text.encode("utf-8"))
    if isinstance(text, list) and text and all(type(t) is int and 0 <= t < 256 for t in text):
        return text
    if isinstance(text, list) and text and all(isinstance(p, str | list) for p in text):
        raise ValueError("prompt: one prompt per request (a string or its token ids); send the others "
                         "as requests of their own")
    raise ValueError("prompt: give a non-empty string, or its token ids (bytes: integers 0-255)")
