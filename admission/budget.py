"""Fit a conversation into a tier's input-token budget: keep the system prompt and the latest
turns, drop the oldest ones. A conversation that can't fit even then is the caller's 400.

Linear in the conversation: each message's tokens are counted once, the cut is found on their
running sum, and only conversations that already about fit the budget are rendered in full to
check it (a template adds a few tokens per message that the estimate may miss)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import TypeVar

M = TypeVar("M")


def trim_conversation(
    messages: Sequence[M],
    role: Callable[[M], str],
    message_tokens: Sequence[int],
    count_tokens: Callable[[list[M]], int],
    budget: int,
    total_tokens: int,
) -> tuple[list[M], int, int] | None:
    """(kept messages, messages dropped, their token count), or None if even the system
    prompt plus the last message is over the budget. `message_tokens[i]` estimates message i's
    share of `total_tokens`, the whole conversation's count (the text alone will do)."""
    if total_tokens <= budget:
        return list(messages), 0, total_tokens
    last = len(messages) - 1
    droppable = [i for i in range(last) if role(messages[i]) not in ("system", "developer")]
    # Drop the oldest turns first; never start the dialogue on an assistant/tool turn whose
    # question was dropped: a cut lands just before a user turn, or drops every droppable one.
    cuts = [j for j in range(1, len(droppable) + 1) if j == len(droppable) or role(messages[droppable[j]]) == "user"]
    # What the template adds beyond the counted text, spread over the messages: the estimate
    # is then exact on average, and the check below corrects the rest.
    extra = (total_tokens - sum(message_tokens)) / max(1, len(messages))
    saved = [0, *accumulate(message_tokens[i] + extra for i in droppable)]
    need = total_tokens - budget  # tokens to shed, by the estimate
    for j in cuts:
        if saved[j] < need:
            continue
        gone = set(droppable[:j])
        kept = [m for i, m in enumerate(messages) if i not in gone]
        tokens = count_tokens(kept)
        if tokens <= budget:
            return kept, j, tokens
        need = saved[j] + (tokens - budget)  # the estimate fell short by this much: cut further
    return None
