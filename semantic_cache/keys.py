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
    """Normalization that never changes meaning: Unicode NFC, collapsed whitespace."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def _digest(payload: dict[str, Any]) -> str:
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def exact_key(*, tenant: str, model: str, messages: list[dict[str, str]], sampling: dict[str, Any]) -> str:
    return _digest({
        "tenant": tenant,
        "model": model,
        "messages": [[m["role"], normalize_text(m["content"])] for m in messages],
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
        "context": [[m["role"], normalize_text(m["content"]), *([m["tool_calls"]] if m.get("tool_calls") else [])]
                    for m in context],
        "sampling": sampling,
    })
