"""The chat template: how OpenAI-style `messages` become the one prompt a Huorn model reads.

The models are byte-level decoders trained on plain text, with no special tokens, so a
conversation is written out as text: one line per message, `role: content`, then `assistant: `
for the model to continue (the space written, so that the answer, sent back as the next
request's assistant message, renders to exactly the bytes the model produced). The answer ends
where the model would start the next turn (`STOPS`), since there is no end-of-turn token to
stop on. The serving replica and the prefix router render a conversation the same way, so the
router sees the prompt the replica will prefill, and a conversation's next request starts with
its last one's prompt and answer: the prefix cache holds all but the new message.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")
STOPS = ("\nuser:", "\nsystem:")  # the model writing the next turn itself: the answer is over


def render(messages: Any) -> str:
    """The prompt of a conversation; ValueError naming the message and field otherwise."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages: give a non-empty list of {role, content}")
    lines = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}]: give an object with role and content")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role: {role!r}; give one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content: give a string")
        lines.append(f"{role}: {content}\n")
    return "".join(lines) + "assistant: "
