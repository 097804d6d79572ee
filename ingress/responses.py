"""OpenAI response bodies and SSE framing for chat and text completions."""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from ingress.tools import ToolCallParser, split_output

Kind = Literal["chat", "completion"]
# Which build of the service answered (OpenAI's field, for clients that log it).
SYSTEM_FINGERPRINT = "fp_latency_serve_0_1"


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
    logprobs: list[TokenLogprob] | None = None, tools: bool = False,
) -> dict[str, Any]:
    """A whole answer's body; with `tools`, calls in the text become the message's `tool_calls`."""
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tools:
            content, calls = split_output(text)
            message["content"] = content
            if calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in calls]
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        choice = {"index": 0, "message": message,
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
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    }


class SSEWriter:
    """Frames stream chunks as `data: {...}\\n\\n`; the chat role goes out with the first delta.
    With `tools`, a call goes out as one `tool_calls` delta once its closing tag has streamed."""

    def __init__(self, kind: Kind, response_id: str, model: str, tools: bool = False) -> None:
        self.tools = ToolCallParser() if tools and kind == "chat" else None
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
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices,
        }
        if usage_block is not None:
            obj["usage"] = usage_block
        return b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8") + b"\n\n"

    def delta(self, text: str, finish_reason: str | None = None, logprobs: list[TokenLogprob] | None = None) -> bytes:
        if self.tools is not None:
            return self._tool_delta(text, finish_reason, logprobs)
        return self._delta(text, finish_reason, logprobs)

    def _tool_delta(self, text: str, finish_reason: str | None, logprobs: list[TokenLogprob] | None) -> bytes:
        assert self.tools is not None
        content, calls = self.tools.feed(text)
        if finish_reason is not None:
            content += self.tools.finish()
        frames = []
        if content or logprobs or (not calls and finish_reason is None):
            frames.append(self._delta(content, None, logprobs))
        for call in calls:
            frames.append(self._frame([{"index": 0, "delta": {**self._role(), "tool_calls": [call]},
                                        "logprobs": None, "finish_reason": None}]))
        if finish_reason is not None:
            if self.tools.calls and finish_reason == "stop":
                finish_reason = "tool_calls"
            frames.append(self._delta("", finish_reason, None))
        return b"".join(frames)

    def _role(self) -> dict[str, str]:
        if self._sent_role:
            return {}
        self._sent_role = True
        return {"role": "assistant"}

    def _delta(self, text: str, finish_reason: str | None = None, logprobs: list[TokenLogprob] | None = None) -> bytes:
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
        body = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"
