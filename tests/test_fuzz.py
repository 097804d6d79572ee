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
            if response.status_code >= 500:
                failures.append(f"{operation.label} -> {response.status_code}: {response.text[:300]!r} for {case.headers!r} {case.body!r}")
            elif response.status_code >= 400:
                # Every error leaves in the OpenAI shape, whatever the input.
                error = response.json().get("error")
                if not (isinstance(error, dict) and error.get("message")):
                    failures.append(f"{operation.label} -> {response.status_code} without an OpenAI error body")

        run()
    assert not failures, "\n".join(failures[:10])
    # The fuzzer reached the models, not only the validator.
    if mode is GenerationMode.POSITIVE:
        assert seen.get("POST /v1/chat/completions 200", 0) > 0, seen
    else:  # and invalid input was generated and refused
        assert any(k.startswith("POST /v1/chat/completions 4") for k in seen), seen
