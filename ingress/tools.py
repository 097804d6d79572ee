"""Function calling: `tools` and `tool_choice` into a prompt and a grammar, and the model's output
back into OpenAI's `tool_calls`.

The format is the Hermes / Qwen one that many open models are trained on: the tools are listed in
the system prompt, and a call is

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A model whose chat template takes `tools` renders them itself; others (the shipped SmolLM2) get
`TOOLS_PROMPT` as a system message. The output is constrained by an xgrammar structural tag
(`ToolSpec.grammar`): with `auto`, free text, then optionally calls; with `required`, calls
only; with a named function, calls of that one only. So every call's arguments parse as JSON and validate against the declared schema (as far
as JSON-schema-to-grammar goes: xgrammar's strict mode).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from engines.types import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_WHITESPACE = 2  # inside a call's JSON: a small model can't pad it until max_tokens

TOOLS_PROMPT = """# Tools

You may call one or more functions to help with the user's request. The functions, as JSON
signatures, are listed within <tools></tools>:
<tools>
{tools}
</tools>

To call a function, reply with a JSON object holding its name and arguments within
<tool_call></tool_call> tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolSpec:
    """A request's tools as the pipeline needs them."""

    tools: list[dict[str, Any]]  # OpenAI's [{"type": "function", "function": {...}}]
    choice: Any  # "auto" | "required" | {"type": "function", "function": {"name": ...}}
    parallel: bool

    def prompt(self) -> str:
        return TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools))

    def grammar(self) -> StructuredOutput:
        """The output's shape as an xgrammar structural tag: `auto`, text with no call in it,
        optionally followed by calls; `required` or a named function, calls only. Calls are one
        or more (one, without `parallel_tool_calls`), each `<tool_call>` block holding one
        declared function's name and arguments valid for its parameters, and nothing follows them."""
        named = self.choice.get("function", {}).get("name") if isinstance(self.choice, dict) else None
        tags = [
            {"type": "tag", "begin": f'{OPEN}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": t["function"]["parameters"], "style": "json",
                         "max_whitespace_cnt": MAX_WHITESPACE},
             "end": f"}}\n{CLOSE}"}
            for t in self.tools if named is None or t["function"]["name"] == named
        ]
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
                 "stop_after_first": not self.parallel}
        if self.choice == "auto":
            text = {"type": "any_text", "excludes": [OPEN]}
            shape = {"type": "or", "elements": [text, {"type": "sequence", "elements": [text, calls]}]}
        else:
            shape = calls
        return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag", "format": shape}))

    def key(self) -> dict[str, Any]:
        """What changes the answer, for the cache key."""
        return {"tools": self.tools, "tool_choice": self.choice, "parallel": self.parallel}


def tool_spec(tools: list[dict[str, Any]] | None, choice: Any, parallel: bool | None) -> ToolSpec | None:
    """The request's tools, or None when it has none or `tool_choice` is "none" (then the model
    answers in text, and is not told of the tools). Raises ValueError naming what is wrong."""
    if choice is not None and choice not in ("none", "auto", "required") and not isinstance(choice, dict):
        raise ValueError("tool_choice: 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice: asks for a tool call but the request declares no tools")
        return None
    if choice == "none":
        return None
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if tool.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools.{i}: only {{'type': 'function', 'function': {{...}}}} tools are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise ValueError(f"tools.{i}.function.name: a name of 1-64 characters is required")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools.{i}.function.parameters: a JSON schema object is required")
        names.append(name)
    if len(set(names)) != len(names):
        raise ValueError("tools: function names must be unique")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if name not in names:
            raise ValueError(f"tool_choice: names no declared function ({name!r}); declared: {', '.join(names)}")
    normalized = [{"type": "function", "function": {**t["function"], "parameters": t["function"].get("parameters")
                                                    or {"type": "object", "properties": {}}}} for t in tools]
    return ToolSpec(normalized, choice, True if parallel is None else bool(parallel))


def render_call(call: dict[str, Any]) -> str:
    """An assistant message's earlier tool call, as the model would have written it."""
    fn = call.get("function") or {}
    arguments = fn.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):
        pass
    return f"{OPEN}\n" + json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False) + f"\n{CLOSE}"


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    """Splits output text, as it streams, into content and tool calls. Text that may be the start
    of `<tool_call>` is held back until it is known not to be."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content that can go out now, calls completed by this text)."""
        self._buffer += text
        content, done = [], []
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE)
                if end < 0:
                    break
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE):]
                self._in_call = False
                call = _parse_call(body, len(self.calls))
                if call is not None:
                    self.calls.append(call)
                    done.append(call)
                continue
            start = self._buffer.find(OPEN)
            if start >= 0:
                content.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN):]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buffer, OPEN)
            content.append(self._buffer[: len(self._buffer) - keep])
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        return "".join(content), done

    def finish(self) -> str:
        """The end of the output: the text still held back. A call left unclosed (the output was
        cut at max_tokens) is dropped: it is neither a call nor part of the answer's text."""
        rest = "" if self._in_call else self._buffer
        self._buffer, self._in_call = "", False
        return rest


def split_output(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer's (content or None, tool calls)."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    content += parser.finish()
    content = content.strip() if parser.calls else content
    return (content or None) if parser.calls else content, parser.calls


def _parse_call(body: str, index: int) -> dict[str, Any] | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    return {
        "index": index, "id": call_id(), "type": "function",
        "function": {"name": obj["name"], "arguments": json.dumps(arguments, ensure_ascii=False)},
    }


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
