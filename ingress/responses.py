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


# (token text, log-probability, [(text, log-probability) of the likeliest at that position])
TokenLogprob = tuple[str, float, list[tuple[str, float]]]


def logprobs_block(kind: Kind, entries: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice: chat's `content` list, or completions' parallel lists
    (`text_offset` counted from `offset`, the characters already sent)."""
    if entries is None:
        return None
    if kind == "chat":
        return {"content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8")),
             "top_logprobs": [{"token": t, "logprob": l, "bytes": list(t.encode("utf-8"))} for t, l in top]}
            for text, lp, top in entries
        ]}
    offsets = []
    for text, _, _ in entries:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": [text for text, _, _ in entries],
        "token_logprobs": [lp for _, lp, _ in entries],
        "top_logprobs": [dict(top) for _, _, top in entries],
        "text_offset": offsets,
    }


def full_response(
    kind: Kind, response_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int,
    logprobs: list[TokenLogprob] | None = None,
) -> dict[str, Any]:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": logprobs_block(kind, logprobs), "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs_block(kind, logprobs), "finish_reason": finish_reason}
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
        self._chars = 0  # text sent so far: completions' text_offset

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

    def delta(self, text: str, finish_reason: str | None = None, logprobs: list[TokenLogprob] | None = None) -> bytes:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": logprobs_block(self.kind, logprobs),
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs_block(self.kind, logprobs, self._chars),
                      "finish_reason": finish_reason}
        self._chars += len(text)
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
