"""Grammars under hostile input, without Ray: depth bounds, cached failures, the compiled-grammar
cache's byte bound and its per-tenant keys, and the end of the output winning over min_tokens."""

from __future__ import annotations

import json

import pytest
import torch

from engines.grammar import MAX_SPEC_DEPTH, GrammarCompiler, GrammarError, check, json_depth
from engines.types import StructuredOutput


def _deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def test_depth_is_counted_without_recursion_and_stops_at_the_limit():
    deep: list = []
    for _ in range(100_000):  # far deeper than Python's recursion limit
        deep = [deep]
    assert json_depth(deep, 10) == 11
    assert json_depth(_deep(5), 32) == 6


def test_a_schema_past_the_depth_bound_is_refused_before_it_is_converted():
    ok = StructuredOutput("json_schema", json.dumps(_deep(MAX_SPEC_DEPTH - 2)))
    check(ok, "t1")
    too_deep = StructuredOutput("json_schema", json.dumps(_deep(MAX_SPEC_DEPTH + 5)))
    with pytest.raises(GrammarError, match="deeper than"):
        check(too_deep, "t1")


def test_a_failing_spec_is_converted_once_per_tenant():
    from engines import grammar

    bad = StructuredOutput("regex", "(unclosed")
    grammar._checked.cache_clear()
    for _ in range(3):
        with pytest.raises(GrammarError):
            check(bad, "t1")
    info = grammar._checked.cache_info()
    assert info.misses == 1 and info.hits == 2
    with pytest.raises(GrammarError):
        check(bad, "t2")  # another tenant's first try pays its own conversion
    assert grammar._checked.cache_info().misses == 2


def test_compiled_grammars_are_cached_per_tenant_within_a_byte_bound(tokenizer):
    compiler = GrammarCompiler(tokenizer, frozenset({tokenizer.eos_token_id}), cache_bytes=1)
    spec = StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    compiler.compile(spec, "t1")
    assert compiler.held_bytes <= 1, "a grammar over the bound is never kept"
    roomy = GrammarCompiler(tokenizer, frozenset({tokenizer.eos_token_id}), cache_bytes=1 << 30)
    first = roomy.compile(spec, "t1")
    assert roomy.compile(spec, "t1") is first, "the same tenant reuses its compiled grammar"
    assert roomy.compile(spec, "t2") is not first, "another tenant compiles its own: nothing to time"
    held = roomy.held_bytes
    bounded = GrammarCompiler(tokenizer, frozenset({tokenizer.eos_token_id}), cache_bytes=held)
    for tenant in ("a", "b", "c"):
        bounded.compile(spec, tenant)
    assert bounded.held_bytes <= held


def test_a_row_with_nothing_allowed_ends_the_output():
    """The grammar allows only the end while min_tokens holds the end back: every logit is -inf.
    The output ends there (EOS), instead of a sampling error that fails the whole batch."""
    from engines.sampling import end_where_nothing_is_allowed

    dead = torch.full((4, 8), float("-inf"))
    dead[1, 5] = 0.0  # row 1 still has a token
    fixed = end_where_nothing_is_allowed(dead, frozenset({2}))
    assert fixed[0, 2] == 0.0 and fixed[2, 2] == 0.0 and fixed[3, 2] == 0.0
    assert fixed[1, 2] == float("-inf") and fixed[1, 5] == 0.0
    single = end_where_nothing_is_allowed(torch.full((8,), float("-inf")), frozenset({2}))
    assert int(torch.argmax(single)) == 2
