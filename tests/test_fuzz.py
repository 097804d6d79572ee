"""Hostile input: schemathesis fuzzes the ingress's OpenAPI schema against the real service.

Valid and invalid requests alike must get an answer below 500 (a 503 shed is the one 5xx a
healthy server may give, and the test service is idle, so none is expected either).
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

EXAMPLES_PER_OPERATION = 25  # x 2 modes x every operation: ~1 minute on a 2-core box
MAX_FUZZ_TOKENS = 4  # generation length is not what is fuzzed here; keep each example short
MAX_FUZZ_CHOICES = 2  # nor how many choices one request generates


def _short(case) -> None:
    """Cap generated output budgets (tokens, choices), so an example costs a few decode steps, and lift deadlines
    that are met by a 504 by design (tests/test_serving.py checks those on purpose)."""
    headers = case.headers or {}
    try:
        if float(headers.get("x-request-deadline-ms", "x")) < 60_000:
            headers["x-request-deadline-ms"] = "60000"
    except ValueError:
        pass  # not a number: the 400 it earns is part of the fuzzing
    if isinstance(case.body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = case.body.get(key)
            if key in case.body and value is None or (
                isinstance(value, int) and not isinstance(value, bool) and value > MAX_FUZZ_TOKENS
            ):
                case.body[key] = MAX_FUZZ_TOKENS
        if "max_tokens" not in case.body and "max_completion_tokens" not in case.body:
            case.body["max_tokens"] = MAX_FUZZ_TOKENS
        n = case.body.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and MAX_FUZZ_CHOICES < n <= 16:  # over 16: its 400 is fuzzed
            case.body["n"] = MAX_FUZZ_CHOICES


def _failure(response, what: str) -> str | None:
    """What is wrong with an answer to fuzzed input: a 5xx, or an error not in OpenAI's shape."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]!r} for {what[:400]}"
    if response.status_code >= 400:
        error = response.json().get("error")
        if not (isinstance(error, dict) and error.get("message")):
            return f"{response.status_code} without an OpenAI error body for {what[:300]}"
    return None


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=["valid", "invalid"])
def test_fuzzed_requests_never_get_a_5xx(service, mode):
    raw = service.http.get("/openapi.json").json()
    assert "/v1/chat/completions" in raw["paths"], "the schema documents the OpenAI routes"
    assert raw["paths"]["/v1/chat/completions"]["post"]["requestBody"], "request bodies are in the schema"
    schema = schemathesis.openapi.from_dict(raw)
    operations = [op.ok() for op in schema.get_all_operations()]
    labels = {op.label for op in operations}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= labels
    failures: list[str] = []
    seen: dict[str, int] = {}

    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not list(operation.iter_parameters()) and not operation.body:
            continue  # nothing in it that could be made invalid (GET /v1/models, /health)

        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            database=None,  # no .hypothesis/ files in the checkout
            suppress_health_check=list(HealthCheck),
            derandomize=True,  # the same examples in every CI run
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case) -> None:
            _short(case)
            response = case.call(base_url=service.base_url, timeout=60)
            seen[f"{operation.label} {response.status_code}"] = seen.get(f"{operation.label} {response.status_code}", 0) + 1
            failure = _failure(response, f"{operation.label}: {case.headers!r} {case.body!r}")
            if failure:
                failures.append(failure)

        run()
    assert not failures, "\n".join(failures[:10])
    # The fuzzer reached the models, not only the validator.
    if mode is GenerationMode.POSITIVE:
        assert seen.get("POST /v1/chat/completions 200", 0) > 0, seen
    else:  # and invalid input was generated and refused
        assert any(k.startswith("POST /v1/chat/completions 4") for k in seen), seen


# --------------------------------------------------------------------------- the newer fields, with a watchdog

FIELD_EXAMPLES = 60
WATCHDOG_MAX_MS = 1000.0  # the worst /health answer allowed while the fuzzer runs


def _json_values(max_leaves: int = 12):
    from hypothesis import strategies as st

    scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
                        st.text(max_size=40), st.sampled_from(["\ud800", "²", "9" * 400, "", "object", "array"]))
    return st.recursive(scalars, lambda kids: st.one_of(st.lists(kids, max_size=4),
                                                        st.dictionaries(st.text(max_size=12), kids, max_size=4)),
                        max_leaves=max_leaves)


def _deep(depth: int, leaf=None):
    value = leaf if leaf is not None else {"type": "string"}
    for _ in range(depth):
        value = {"type": "array", "items": value}
    return value


def _field_strategy():
    """A chat body whose new fields (tools, tool_choice, response_format, guided_*, logit_bias,
    logprobs, n, stop, history tool calls) take well-formed, odd and hostile values."""
    from hypothesis import strategies as st

    anything = _json_values()
    schema = st.one_of(anything, st.integers(0, 60).map(_deep),
                       st.just({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}))
    tool = st.one_of(anything, st.builds(lambda name, params: {"type": "function", "function": {"name": name, "parameters": params}},
                                         st.text(max_size=70), schema))
    tool_call = st.one_of(anything, st.builds(
        lambda name, args: {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}},
        st.text(max_size=20), st.one_of(st.text(max_size=40), anything, st.just('{"x": "\\ud800"}'),
                                        st.integers(0, 3000).map(lambda n: "[" * n + "]" * n))))
    fields = {
        "tools": st.lists(tool, max_size=3),
        "tool_choice": st.one_of(anything, st.sampled_from(["none", "auto", "required"]),
                                 st.builds(lambda f: {"type": "function", "function": f}, anything)),
        "response_format": st.one_of(anything, st.builds(
            lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schema)),
        "guided_json": st.one_of(schema, st.integers(0, 3000).map(lambda n: "[" * n + "]" * n)),
        "guided_regex": st.one_of(st.text(max_size=60), st.just("(a|aa)*" * 50), st.just("((((x{1,9}){1,9}){1,9}){1,9})")),
        "guided_choice": st.one_of(anything, st.lists(st.text(max_size=8), min_size=1, max_size=4)),
        "logit_bias": st.one_of(anything, st.dictionaries(st.one_of(st.text(max_size=6), st.sampled_from(["²", "9" * 5000, "12"])),
                                                          st.floats(-200, 200), max_size=3)),
        "logprobs": st.one_of(anything, st.booleans()),
        "top_logprobs": st.one_of(anything, st.integers(-2, 30)),
        "n": st.one_of(anything, st.integers(-1, 20)),
        "stop": st.one_of(anything, st.lists(st.text(max_size=10), max_size=6)),
        "min_tokens": st.integers(0, 4),
        "ignore_eos": st.booleans(),
        "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    }
    history = st.lists(tool_call, min_size=1, max_size=2).map(lambda calls: [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}, {"role": "user", "content": "and?"}])
    chosen = st.fixed_dictionaries({}, optional=fields)
    messages = st.one_of(st.just([{"role": "user", "content": "Answer briefly."}]), history)
    return st.builds(lambda f, m: {"model": "auto", "messages": m, "max_tokens": 2, **f}, chosen, messages)


def test_fuzzed_new_fields_never_get_a_5xx_nor_stall_health(service):
    """Property-based: the new request fields with hostile values, against the live app, while a
    watchdog asks /health every 50 ms. No 5xx, every error in OpenAI's shape, and no /health
    answer slower than WATCHDOG_MAX_MS throughout. Embeddings inputs are fuzzed alongside."""
    import json
    import threading
    import time

    import httpx
    from hypothesis import strategies as st

    stop = threading.Event()
    health_ms: list[float] = []
    current = [""]  # the request in flight, named when /health was slow beside it
    slow: list[str] = []

    def watchdog() -> None:
        with httpx.Client(base_url=service.base_url, timeout=30) as http:
            while not stop.is_set():
                t = time.perf_counter()
                http.get("/health")
                health_ms.append((time.perf_counter() - t) * 1000)
                if health_ms[-1] > WATCHDOG_MAX_MS / 4:
                    slow.append(f"{health_ms[-1]:.0f} ms beside {current[0][:300]}")
                time.sleep(0.05)

    failures: list[str] = []
    statuses: dict[int, int] = {}
    http = httpx.Client(base_url=service.base_url, timeout=120)

    def check(resp: httpx.Response, what: str) -> None:
        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
        failure = _failure(resp, what)
        if failure:
            failures.append(failure)

    @settings(max_examples=FIELD_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=_field_strategy(), embed=st.one_of(st.none(), _json_values(6),
                                                   st.lists(st.text(max_size=300), max_size=70)))
    def run(body, embed) -> None:
        try:
            raw = json.dumps(body)
        except (ValueError, RecursionError):
            return
        current[0] = raw
        check(http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json",
                                                                       "cache-control": "no-cache"}), raw)
        if embed is not None:
            payload = json.dumps({"model": "all-MiniLM-L6-v2", "input": embed})
            current[0] = payload
            check(http.post("/v1/embeddings", content=payload, headers={"content-type": "application/json"}), payload)

    guard = threading.Thread(target=watchdog)
    guard.start()
    try:
        run()
    finally:
        stop.set()
        guard.join(timeout=60)
        http.close()
    assert not failures, "\n".join(failures[:10])
    assert health_ms and max(health_ms) <= WATCHDOG_MAX_MS, f"/health stalled {max(health_ms):.0f} ms: {slow}"
    assert statuses.get(200, 0) > 0 and any(400 <= s < 500 for s in statuses), statuses
