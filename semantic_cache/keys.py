"""Cache keys: everything that changes the answer is part of the key.

GPTCache's classic false hit is keying a multi-turn chat on its last message only. Here:
- the exact key covers the tenant (separate namespaces), the model asked for, the whole
  conversation and the sampling parameters;
- the semantic *scope* covers the same, except the last user turn, which is what gets
  embedded and compared. A paraphrase can only match inside its own scope: same tenant,
  model, system prompt, earlier turns and sampling.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any


def normalize_text(text: str) -> str:
    """Normalization that never changes meaning: Unicode NFC, and no leading or trailing
    whitespace. Whitespace inside is kept: code that differs only in indentation is other code."""
    return unicodedata.normalize("NFC", text).strip()


def _message(m: dict[str, Any]) -> list[Any]:
    """A turn as the keys see it: its role and text, and every other field that changes the
    answer (the sender's name, an assistant's tool calls, the call a tool result answers)."""
    return [m["role"], normalize_text(m["content"]), *([{k: m[k] for k in _EXTRA if m.get(k)}] if any(
        m.get(k) for k in _EXTRA) else [])]


_EXTRA = ("name", "tool_calls", "tool_call_id")


def _digest(payload: dict[str, Any]) -> str:
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def exact_key(*, tenant: str, model: str, messages: list[dict[str, str]], sampling: dict[str, Any]) -> str:
    return _digest({
        "tenant": tenant,
        "model": model,
        "messages": [_message(m) for m in messages],
        "sampling": sampling,
    })


def split_query(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], str | None]:
    """(context, last user turn). No semantic matching when the chat does not end on a user turn."""
    if not messages or messages[-1]["role"] not in ("user", "prompt"):
        return messages, None
    return messages[:-1], messages[-1]["content"]


def scope_key(*, tenant: str, model: str, context: list[dict[str, str]], sampling: dict[str, Any]) -> str:
    return _digest({
        "scope": 1,
        "tenant": tenant,
        "model": model,
        "context": [_message(m) for m in context],
        "sampling": sampling,
    })
