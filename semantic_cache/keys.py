"""Cache keys: everything that changes the answer is part of the key.

GPTCache's classic false hit is keying a multi-turn chat on its last message only. Here the
key covers the tenant (separate namespaces), the model asked for, the whole conversation
(system prompt and earlier turns included) and the sampling parameters.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any


def normalize_text(text: str) -> str:
    """Normalization that never changes meaning: Unicode NFC, collapsed whitespace."""
    return " ".join(unicodedata.normalize("NFC", text).split())


def exact_key(*, tenant: str, model: str, messages: list[dict[str, str]], sampling: dict[str, Any]) -> str:
    payload = {
        "tenant": tenant,
        "model": model,
        "messages": [[m["role"], normalize_text(m["content"])] for m in messages],
        "sampling": sampling,
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()
