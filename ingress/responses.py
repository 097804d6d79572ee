"""OpenAI response bodies and SSE framing for chat and text completions."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

Kind = Literal["chat", "completion"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    kind: Kind, response_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


class SSEWriter:
    """Frames stream chunks as `data: {...}\\n\\n`; the chat role goes out with the first delta."""

    def __init__(self, kind: Kind, response_id: str, model: str) -> None:
        self.kind = kind
        self.response_id = response_id
        self.model = model
        self.created = int(time.time())
        self._sent_role = False

    def _frame(self, choices: list[dict[str, Any]], usage_block: dict[str, int] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage_block is not None:
            obj["usage"] = usage_block
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"

    def delta(self, text: str, finish_reason: str | None = None) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._frame([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._frame([], usage(prompt_tokens, completion_tokens))

    @staticmethod
    def error(message: str, code: str) -> bytes:
        body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": code}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
