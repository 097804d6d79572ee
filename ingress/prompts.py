"""Prompt -> token ids in the ingress, once per request.

Tokenizing here (not in the model replica) lets the ingress reject over-long prompts with a
400 before any hop, gives admission and routing real token counts, and ships ids, not
text, to the engine.
"""

from __future__ import annotations

from typing import Any

from ingress.errors import bad_request
from ingress.protocol import ChatMessage
from ingress.tools import ToolSpec, render_call

# Tokens a chat template adds around one message (role and turn markers): ChatML's
# "<|im_start|>user\n ... <|im_end|>\n" is 5. Only an estimate: trimming checks the result.
TURN_MARKER_TOKENS = 5


class PromptBuilder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError("this tokenizer has no chat template; chat completions need one")
        # A template that renders `tools` itself (and tool calls and results) gets them as they are.
        self.native_tools = isinstance(template, str) and "tools" in template and "tool_calls" in template

    def chat(self, messages: list[ChatMessage], tools: ToolSpec | None = None) -> list[int]:
        extra: dict[str, Any] = {}
        if self.native_tools:
            turns = [_native_turn(m) for m in messages]
            if tools is not None:
                extra["tools"] = tools.tools
        else:
            turns = _plain_turns(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True, **extra)
        except Exception as exc:  # a template may reject e.g. a role order it does not support
            raise bad_request(f"messages do not fit the model's chat template: {exc}", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def message_tokens(self, messages: list[ChatMessage]) -> list[int]:
        """Each message's tokens, in one batched pass, plus the few its turn markers add: an
        estimate of its share of `chat(messages)`, for trimming (admission/budget.py)."""
        texts = [m.text() for m in messages]
        counts = self.tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        return [len(ids) + TURN_MARKER_TOKENS for ids in counts]

    def completion(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if all(isinstance(p, int) for p in prompt):
            ids = list(prompt)  # type: ignore[arg-type]
        elif len(prompt) == 1:
            only = prompt[0]
            ids = self.completion(only) if isinstance(only, str) else list(only)  # type: ignore[arg-type]
        else:
            raise bad_request("one prompt per request is supported (batch prompts: send separate requests)", "prompt")
        vocab = len(self.tokenizer)
        if any(not (0 <= t < vocab) for t in ids):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        return ids


def _native_turn(m: ChatMessage) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        turn["tool_calls"] = m.tool_calls
    if m.tool_call_id:
        turn["tool_call_id"] = m.tool_call_id
    return turn


def _plain_turns(messages: list[ChatMessage], tools: ToolSpec | None) -> list[dict[str, str]]:
    """For a template that knows nothing of tools: the tools' description joins the system
    prompt, earlier calls are written into the assistant's turn as the model writes them, and
    tool results come back as a user turn of <tool_response> blocks (consecutive ones merged)."""
    turns: list[dict[str, str]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content = m.text()
        if m.tool_calls:
            content = "\n".join([content, *(render_call(c) for c in m.tool_calls)]).strip()
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1].get("from_tool"):
                turns[-1]["content"] += "\n" + block
                continue
            turns.append({"role": "user", "content": block, "from_tool": "1"})
            continue
        turns.append({"role": role, "content": content})
    if tools is not None:
        if turns and turns[0]["role"] == "system":
            turns[0]["content"] = f"{turns[0]['content']}\n\n{tools.prompt()}"
        else:
            turns.insert(0, {"role": "system", "content": tools.prompt()})
    return [{"role": t["role"], "content": t["content"]} for t in turns]
