"""Fit a conversation into a tier's input-token budget: keep the system prompt and the latest
turns, drop the oldest ones. A conversation that can't fit even then is the caller's 400."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

M = TypeVar("M")


def trim_conversation(
    messages: Sequence[M], role: Callable[[M], str], count_tokens: Callable[[list[M]], int], budget: int
) -> tuple[list[M], int, int] | None:
    """(kept messages, messages dropped, their token count), or None if even the system
    prompt plus the last message is over the budget."""
    kept = list(messages)
    tokens = count_tokens(kept)
    dropped = 0
    while tokens > budget:
        # The oldest turn that is neither a system prompt nor the last message.
        idx = next((i for i, m in enumerate(kept[:-1]) if role(m) not in ("system", "developer")), None)
        if idx is None:
            return None
        del kept[idx]
        dropped += 1
        # Never start the dialogue on an assistant/tool turn whose question was dropped.
        while True:
            nxt = next((i for i, m in enumerate(kept[:-1]) if role(m) not in ("system", "developer")), None)
            if nxt is None or role(kept[nxt]) == "user":
                break
            del kept[nxt]
            dropped += 1
        tokens = count_tokens(kept)
    return kept, dropped, tokens
