"""The OpenAI request schemas we accept, validated once at the HTTP edge.

Unknown fields are ignored (as OpenAI-compatible servers do); known fields we cannot honor
are rejected with a 400 that names them, instead of being silently dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

# A logit_bias key: a token id in ASCII digits (str.isdigit also takes "²", which int() refuses).
_TOKEN_ID = re.compile(r"\s*[0-9]{1,9}\s*", re.ASCII)

# A seed is a 64-bit signed integer, as in vLLM's server: torch's generator takes no more.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1

Role = Literal["system", "developer", "user", "assistant", "tool"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


# Containers nested in a tool call's arguments (parsed from their JSON string), at most.
MAX_ARGUMENT_DEPTH = 32


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[dict[str, Any]] | None = Field(None, max_length=128)  # an assistant's earlier calls
    tool_call_id: str | None = Field(None, max_length=256)  # a tool message: the call it answers

    @field_validator("tool_calls")
    @classmethod
    def _calls(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """OpenAI's shape, {"id", "type": "function", "function": {"name", "arguments"}}, checked
        here so the prompt builders and the cache key can trust it."""
        for i, call in enumerate(value or []):
            fn = call.get("function")
            if not isinstance(fn, dict):
                raise ValueError(f"{i}.function: an object with a name and arguments is required")
            if not isinstance(fn.get("name"), str) or not fn["name"] or len(fn["name"]) > 64:
                raise ValueError(f"{i}.function.name: a name of 1-64 characters is required")
            arguments = fn.get("arguments")
            if arguments is not None and not isinstance(arguments, (str, dict)):
                raise ValueError(f"{i}.function.arguments: a JSON string is required")
            if not isinstance(call.get("id", ""), (str, type(None))):
                raise ValueError(f"{i}.id: a string is required")
            if isinstance(arguments, str):
                _check_arguments(arguments, i)
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(_Request):
    model: str = Field(..., min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = Field(None, validate_default=True)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=16)  # choices: each one a generation of its own (ingress/choices.py)
    user: str | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, max_length=1024)
    # vLLM's extensions, as its OpenAI server takes them
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=0.01, le=10.0)  # vLLM: > 0; below 0.01 it overflows
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    # vLLM's structured-output fields (guided_grammar is not served: 400, never ignored)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, max_length=4096)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=256)
    guided_grammar: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if _TOKEN_ID.fullmatch(token) is None:
                raise ValueError(f"keys are token ids; {token[:40]!r} is not one")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"a bias is between -100 and 100; token {token} has {bias}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops

    def unsupported(self) -> list[str]:
        bad = ["guided_grammar"] if self.guided_grammar is not None else []
        if self.response_format and self.response_format.get("type") not in (None, "text", "json_object", "json_schema"):
            bad.append("response_format")
        return bad


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}: ingress/tools.py

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any) -> Any:
        if value is None or value in ("none", "auto", "required"):
            return value
        fn = value.get("function") if isinstance(value, dict) else None
        if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str):
            raise ValueError("'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for i, tool in enumerate(value or []):
            params = tool.get("function", {}).get("parameters") if isinstance(tool.get("function"), dict) else None
            if isinstance(params, dict) and _depth(params) > MAX_ARGUMENT_DEPTH:
                raise ValueError(f"{i}.function.parameters: nests deeper than {MAX_ARGUMENT_DEPTH} levels")
        return value
    parallel_tool_calls: bool | None = None
    # The deprecated forms of tools: a 400 that says to use tools, never ignored.
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.functions:
            bad.append("functions")
        if self.function_call not in (None, "none"):
            bad.append("function_call")
        return bad

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_asked(self) -> int | None:
        """None: no log-probabilities; N: each token's and the N likeliest alternatives'."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> list[str]:
        bad = super().unsupported()
        if self.echo:
            bad.append("echo")
        if self.suffix:
            bad.append("suffix")
        if self.best_of not in (None, 1):
            bad.append("best_of")
        return bad

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_asked(self) -> int | None:
        return self.logprobs


def _depth(value: Any) -> int:
    from engines.grammar import json_depth

    return json_depth(value, MAX_ARGUMENT_DEPTH)


def _check_arguments(arguments: str, index: int) -> None:
    """A history call's arguments: what the prompt builder will parse must be bounded and text."""
    if _SURROGATE_ESCAPE.search(arguments) is None and "[" * (MAX_ARGUMENT_DEPTH + 1) not in arguments \
            and arguments.count("{") + arguments.count("[") <= MAX_ARGUMENT_DEPTH:
        return
    try:
        parsed = json.loads(arguments)
    except RecursionError:
        raise ValueError(f"{index}.function.arguments: nests deeper than {MAX_ARGUMENT_DEPTH} levels") from None
    except ValueError:
        return  # not JSON: the prompt carries it as the text it is
    if _depth(parsed) > MAX_ARGUMENT_DEPTH:
        raise ValueError(f"{index}.function.arguments: nests deeper than {MAX_ARGUMENT_DEPTH} levels")
    where = lone_surrogate_at(arguments, parsed)
    if where is not None:
        raise ValueError(f"{index}.function.arguments: a lone UTF-16 surrogate is not text")


# JSON can spell a UTF-16 surrogate as an escape; only there can a lone one come from.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def lone_surrogate_at(text: str, parsed: Any) -> str | None:
    """Where the parsed body holds a string with a lone UTF-16 surrogate ("\\ud800"), which no
    UTF-8 text can carry: the path to it, or None. A C-speed scan of the raw text first, so a
    body without such escapes costs no walk."""
    if _SURROGATE_ESCAPE.search(text) is None:
        return None
    stack: list[tuple[Any, str]] = [(parsed, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path))
                stack.append((item, f"{path}.{key}" if path else str(key)))
        elif isinstance(value, list):
            stack.extend((item, f"{path}.{i}") for i, item in enumerate(value))
    return None
