"""Structured output: a grammar (a JSON schema, any JSON, a regex, a choice, a tool-call format)
that masks every logits row a request chooses from, on xgrammar.

xgrammar (what vLLM and SGLang use) was picked over llguidance: both mask a 49k-token
vocabulary cheaply in steady state, but llguidance's first mask of a new grammar takes far
longer, and xgrammar ships the tool-call formats (structural tags) the ingress
renders tools with. docs/api.md has the cost per token.

A request's `GrammarState` follows its emitted tokens. Speculation stays lossless: row i of a
verify pass is masked as the grammar stands after drafts[:i] (the drafts are accepted into the
matcher for the pass and rolled back after), and a draft the grammar forbids ends the proposal
before any model pass, since the target could never choose it.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any

import torch

from engines.types import StructuredOutput

# Whitespace a JSON value may carry between its tokens: at most this many characters at a time, so
# a model may indent as it was trained to, but cannot pad an answer with whitespace until
# max_tokens runs out.
_WHITESPACE = {"any_whitespace": True, "max_whitespace_cnt": 8}


ANY_OBJECT = '{"type": "object"}'


# Nesting a schema (or tool parameters) may have, in JSON containers: compiling a schema costs
# roughly the cube of its depth, so depth, not size, is what bounds the work. Real schemas
# (nested pydantic models, OpenAPI bodies) stay far below it.
MAX_SPEC_DEPTH = 32


class GrammarError(ValueError):
    """The grammar does not compile (an invalid schema or regex), or is over a bound."""


def json_depth(value: Any, limit: int) -> int:
    """Containers nested in `value`, counted without recursion and no further than `limit + 1`
    (so a value nested thousands deep costs no more than one at the limit)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


# A tool-call structural tag wraps each function's parameters in this many levels of its own.
_TAG_WRAPPING_DEPTH = 8


def check_depth(spec: Any, where: str, limit: int = MAX_SPEC_DEPTH) -> None:
    """`GrammarError` when a schema (parsed JSON) nests deeper than `limit`."""
    if json_depth(spec, limit) > limit:
        raise GrammarError(f"{where} nests deeper than {limit} levels")


def check(structured: StructuredOutput, tenant: str | None = None) -> None:
    """Raise `GrammarError` if it will not compile; needs no tokenizer (the ingress's 400). A spec
    a tenant sends again is not converted again: successes and failures are both remembered,
    per tenant, so no tenant can learn by timing whether another sent a schema."""
    reason = _checked(structured, tenant)
    if reason is not None:
        raise GrammarError(reason)


@functools.lru_cache(maxsize=1024)
def _checked(structured: StructuredOutput, tenant: str | None) -> str | None:
    """Why it will not compile, or None. Cached either way, so a spec that fails costs its
    conversion once, not on every request that sends it again."""
    import xgrammar as xgr

    if structured.kind in ("json_schema", "structural_tag"):
        wrapping = _TAG_WRAPPING_DEPTH if structured.kind == "structural_tag" else 0
        try:
            check_depth(json.loads(structured.spec), "the schema", MAX_SPEC_DEPTH + wrapping)
        except (ValueError, RecursionError) as exc:
            return _reason(exc)
    try:
        if structured.kind == "json_schema":
            xgr.Grammar.from_json_schema(structured.spec, **_WHITESPACE)
        elif structured.kind == "regex":
            xgr.Grammar.from_regex(structured.spec)
        elif structured.kind == "choice":
            xgr.Grammar.from_regex(_choice_regex(structured.spec))
        elif structured.kind == "structural_tag":
            xgr.Grammar.from_structural_tag(structured.spec)
    except Exception as exc:
        return _reason(exc)
    return None


class GrammarCompiler:
    """Compiled grammars for one tokenizer. xgrammar's own cache is off: this one is bounded in
    bytes (LRU) and keyed by the tenant's salt too, so one tenant can neither fill the replica's
    memory with grammars nor learn by timing whether another tenant sent a schema."""

    def __init__(self, tokenizer: Any, stop_ids: frozenset[int], cache_bytes: int = 64 << 20) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size = len(tokenizer)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_ids))
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[tuple[str | None, StructuredOutput], tuple[Any, int]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held_bytes(self) -> int:
        return self._held

    def compile(self, structured: StructuredOutput, salt: str | None = None) -> Any:
        key = (salt, structured)
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found[0]
        compiled = self._compile(structured)
        size = _memory_size(compiled)
        with self._lock:
            if key not in self._cache and size <= self.cache_bytes:
                self._cache[key] = (compiled, size)
                self._held += size
                while self._held > self.cache_bytes:
                    _, (_, dropped) = self._cache.popitem(last=False)
                    self._held -= dropped
        return compiled

    def _compile(self, structured: StructuredOutput) -> Any:
        c = self._compiler
        try:
            if structured.kind == "json":  # any object (strict mode would allow only {})
                return c.compile_json_schema(ANY_OBJECT, strict_mode=False, **_WHITESPACE)
            if structured.kind == "json_schema":
                return c.compile_json_schema(structured.spec, **_WHITESPACE)
            if structured.kind == "regex":
                return c.compile_regex(structured.spec)
            if structured.kind == "choice":
                return c.compile_regex(_choice_regex(structured.spec))
            return c.compile_structural_tag(structured.spec)
        except Exception as exc:
            raise GrammarError(_reason(exc)) from None

    def state(self, structured: StructuredOutput, salt: str | None = None) -> GrammarState:
        return GrammarState(self._xgr, self.compile(structured, salt), self.vocab_size)


def _memory_size(compiled: Any) -> int:
    try:
        return int(compiled.memory_size_bytes)
    except Exception:  # an xgrammar without the figure: count the vocabulary-sized tables roughly
        return 1 << 20


class GrammarState:
    """One request's place in its grammar."""

    MAX_ROLLBACK = 64  # rows masked per verify pass, at most (target.k_max is 32)

    def __init__(self, xgr: Any, compiled: Any, vocab_size: int) -> None:
        self._xgr = xgr
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(self.MAX_ROLLBACK + 1, vocab_size)
        self.vocab_size = vocab_size
        self.mask_ms = 0.0  # time spent masking, for the bench's cost per token
        self.masked_rows = 0

    def accept(self, token: int) -> bool:
        """An emitted token; False if the grammar forbids it (never, for tokens chosen from masked rows)."""
        return bool(self._matcher.accept_token(token))

    def forced_text(self) -> str:
        """The text the grammar allows alone from here ("" where the model has a choice)."""
        return str(self._matcher.find_jump_forward_string())

    def allowed_prefix(self, drafts: list[int]) -> int:
        """How many of `drafts`, in order, the grammar allows: a draft past that is never proposed."""
        n = 0
        for token in drafts[: self.MAX_ROLLBACK]:
            if not self._matcher.accept_token(token):
                break
            n += 1
        if n:
            self._matcher.rollback(n)
        return n

    def mask(self, logits: torch.Tensor, drafts: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Logits with forbidden tokens at -inf. `logits` is [vocab], or [rows, vocab] with row i the
        position after drafts[:i] (all of them allowed: see `allowed_prefix`)."""
        start = time.perf_counter()
        single = logits.dim() == 1
        x = (logits.unsqueeze(0) if single else logits).float().clone()
        rows = min(x.shape[0], len(drafts) + 1, self.MAX_ROLLBACK + 1)
        accepted = 0
        for i in range(rows):
            self._matcher.fill_next_token_bitmask(self._bitmask, i)
            if i < rows - 1:
                if not self._matcher.accept_token(drafts[i]):
                    rows = i + 1  # rows past a forbidden draft are never chosen from
                    break
                accepted += 1
                if self._matcher.is_terminated():  # a stop token: the output ends there
                    rows = i + 1
                    break
        if accepted:
            self._matcher.rollback(accepted)
        if x.shape[1] > self.vocab_size:  # the model's padding past the tokenizer's vocabulary
            x[:, self.vocab_size :] = float("-inf")
        self._xgr.apply_token_bitmask_inplace(x[:rows], self._bitmask[:rows], vocab_size=self.vocab_size)
        self.mask_ms += (time.perf_counter() - start) * 1000
        self.masked_rows += rows
        return x[0] if single else x


_compilers: dict[int, GrammarCompiler] = {}
_lock = threading.Lock()


def compiler_for(tokenizer: Any, stop_ids: frozenset[int]) -> GrammarCompiler:
    """The replica's compiler for a tokenizer (one per engine, made on first use)."""
    key = id(tokenizer)
    with _lock:
        found = _compilers.get(key)
        if found is None:
            found = _compilers[key] = GrammarCompiler(tokenizer, stop_ids)
        return found


def _choice_regex(spec: str) -> str:
    choices = json.loads(spec)
    return "(" + "|".join(re.escape(str(c)) for c in choices) + ")"


def _reason(exc: Exception) -> str:
    """xgrammar's message without its C++ source location."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return re.sub(r"^\[[\d:]+\] \S+: ", "", text)[:300]
