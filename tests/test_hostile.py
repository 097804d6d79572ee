"""A hostile or careless client against the live service: every case gets a 4xx in OpenAI's
error shape, or an effect that stays bounded (other tenants served, /health answering).

All traffic goes to the test service on loopback, bounded in count and time.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from telemetry.clock import server_timing_count
from tests.conftest import ADMIN_KEY, RETRYING_KEY, TRIMMED_TIER, assert_greedy_agrees
from tests.test_serving import NO_CACHE, SMALL, TARGET, _error, _post

# The worst /health answer allowed while an attack runs: a stalled event loop shows here. Wide,
# so a noisy 2-core box never trips it; the tight figures are `python -m bench hostile`'s.
HEALTH_MAX_MS = 1000.0


def _body(**fields) -> str:
    return json.dumps({"model": TARGET, "max_tokens": 4, "temperature": 0, **fields}, separators=(",", ":"))


def _chat(content: str = "hi", **fields) -> str:
    return _body(messages=[{"role": "user", "content": content}], **fields)


def _many_messages(n: int, words: str = "hello there") -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": words} for i in range(n - 1)] + [
        {"role": "user", "content": "and now?"}
    ]


# --------------------------------------------------------------------------- one request


@pytest.mark.parametrize(
    "body, code",
    [
        (_chat(seed=2**64), None),  # torch's generator takes 64-bit signed seeds only
        (_chat(seed=-(2**63) - 1), None),
        (_chat(stop=["x" * 10_000]), None),  # the detokenizer's hold-back grows with its length
        (_chat(max_tokens=10**30), None),
        (_chat(temperature=1e308), None),
        (_body(messages=_many_messages(30_000, "hi")), "too_many_messages"),
        (_chat("a" * 500_000), "prompt_too_long"),
        ('{"model": "%s", "messages": [{"role": "user", "content": "\\ud800 lone"}]}' % TARGET, "invalid_encoding"),
        ('{"model": "%s", "messages": [{"role": "user", "content": "ok"}], "stop": ["\\udfff"]}' % TARGET, "invalid_encoding"),
        ("[" * 100_000 + "]" * 100_000, "invalid_json"),  # deeper than any parser's recursion
        ('{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}' % TARGET, None),
    ],
    ids=["seed-2^64", "seed-below-int64", "stop-10k", "max-tokens-1e30", "temperature-1e308", "30k-messages",
         "500k-chars", "lone-surrogate", "lone-surrogate-in-stop", "deep-nesting", "inf-max-tokens"],
)
def test_hostile_bodies_get_a_clear_400(service, body, code):
    _error(_post(service, body), 400, code)


def test_odd_but_valid_input_is_served(service):
    """Emoji (a surrogate pair when escaped), right-to-left text, zero-width and combining
    characters, the largest seed: all real text, all answered."""
    odd = "😀 \\ud83d\\ude00 مرحبا \u200b\u200d e\u0301 \U0001f9d1\u200d\U0001f4bb"
    body = '{"model": "%s", "max_tokens": 4, "temperature": 0.7, "seed": %d, "messages": [{"role": "user", "content": "%s"}]}' % (
        TARGET, 2**63 - 1, odd
    )
    resp = _post(service, body.encode("utf-8"), headers=NO_CACHE)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] is not None


def test_a_trimmed_long_conversation_is_answered_quickly(service):
    """1,000 turns in a tier with a 200-token input budget: trimmed (oldest turns dropped) in
    linear time and answered, the trim said in a header."""
    start = time.monotonic()
    resp = _post(service, _body(messages=_many_messages(1000)), headers={"x-slo-tier": TRIMMED_TIER, **NO_CACHE})
    assert resp.status_code == 200, resp.text
    assert "dropped_messages=" in resp.headers["x-context-trimmed"]
    assert time.monotonic() - start < 30


def test_the_client_request_id_is_echoed_but_never_shared(service):
    """Two tenants send the same x-request-id at once: both are answered, each with its own
    response id, and the id they sent comes back to each."""
    def ask(key: str) -> httpx.Response:
        return service.http.post(
            "/v1/chat/completions", content=_chat("Say one word."),
            headers={"authorization": f"Bearer {key}", "x-request-id": "same-id-1", "content-type": "application/json", **NO_CACHE},
        )

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a, b = pool.map(ask, ["sk-hostile-a", "sk-hostile-b"])
    assert a.status_code == b.status_code == 200, (a.text, b.text)
    assert a.headers["x-request-id"] == b.headers["x-request-id"] == "same-id-1"
    assert a.json()["id"] != b.json()["id"] and "same-id-1" not in a.json()["id"]


def test_cache_invalidation_needs_an_admin_key(service):
    for headers in ({}, {"authorization": "Bearer sk-not-an-admin"}):
        _error(service.http.delete("/v1/cache", headers=headers), 403, "admin_key_required")
    resp = service.http.delete("/v1/cache", headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code == 200 and resp.json()["object"] == "cache.invalidation"


# --------------------------------------------------------------------------- prefix KV across tenants

# Longer than the largest KV block an engine shares (vLLM's CPU build: 128 tokens): a repeat reuses one.
PREFIX_PROMPT = (
    "You are a meticulous assistant for a logistics company. Our warehouse in Rotterdam ships pallets of "
    "machine parts to customers in Germany, Belgium and France every weekday morning. Trucks leave at six, "
    "the ferry to Harwich leaves at nine, and rail freight to Milan departs on Tuesdays and Fridays only. "
    "Every pallet carries a customs declaration, a packing list and a temperature log; pallets of bearings "
    "travel dry, pallets of hydraulic pumps travel upright, and pallets of glass sensors travel with foam "
    "corners. Returns come back through the depot in Antwerp, where they are inspected within two working "
    "days, photographed, and either restocked, repaired in the workshop in Eindhoven, or scrapped with a "
    "certificate. Invoices are issued in euros on the day of dispatch and are due within thirty days; "
    "customers in Switzerland are invoiced in francs. Claims for damage must reach us within seven days of "
    "delivery with photographs of the pallet and its wrapping. Answer in one word: which country is not "
    "mentioned twice?"
)


def _reused(service, tenant: str) -> float:
    resp = service.http.post(
        "/v1/chat/completions", content=_chat(PREFIX_PROMPT),
        headers={"authorization": f"Bearer {ADMIN_KEY}", "x-tenant": tenant, "content-type": "application/json", **NO_CACHE},
    )
    assert resp.status_code == 200, resp.text
    return server_timing_count(resp.headers["server-timing"], "prefix_reused_tokens")


def test_one_tenants_prompt_gets_no_prefix_reuse_from_anothers(service):
    """The engine's prefix KV is salted by tenant: tenant B's identical prompt reuses nothing of
    tenant A's (it could otherwise time, block by block, whether A's prompt starts with a
    guess), and A's repeat reuses its own. Read as an admin, whose Server-Timing carries the
    engine's count (two namespaces of one admin key are two tenants)."""
    stamp = str(time.time_ns())
    assert _reused(service, f"prefix-a-{stamp}") == 0
    assert _reused(service, f"prefix-b-{stamp}") == 0, "another tenant must not reuse tenant A's prefix KV"
    assert _reused(service, f"prefix-a-{stamp}") >= 32, "the same tenant reuses its own prefix"


def test_engine_counts_leave_responses_only_for_admins(service):
    for _ in range(2):  # the second is a prefix hit in the engine
        resp = _post(service, _chat(PREFIX_PROMPT), headers={"authorization": "Bearer sk-plain-caller", **NO_CACHE})
        assert resp.status_code == 200, resp.text
        assert "prefix_reused_tokens" not in resp.headers["server-timing"]
        assert "prefill" in resp.headers["server-timing"]  # the stage times stay


# --------------------------------------------------------------------------- a flood


def test_a_flood_of_huge_requests_leaves_health_and_other_tenants_served(service):
    """Bounded flood, loopback only: four clients each send 1 MiB bodies (30,000 tiny messages,
    or one ~390k-character prompt that passes the limits and must be tokenized) for ~15 s.
    Meanwhile /health never stalls past HEALTH_MAX_MS and another tenant's chat succeeds."""
    flood_bodies = [
        _body(messages=_many_messages(30_000, "hi")).encode(),
        _chat("lorem ipsum dolor sit amet " * 14_000, max_tokens=1).encode(),
    ]
    assert all(len(b) > 350_000 for b in flood_bodies)
    stop = threading.Event()
    statuses: list[int] = []

    def flood(i: int) -> None:
        with httpx.Client(base_url=service.base_url, timeout=60) as http:
            while not stop.is_set() and len(statuses) < 400:
                resp = http.post(
                    "/v1/chat/completions", content=flood_bodies[i % 2],
                    headers={"authorization": f"Bearer sk-flood-{i}", "content-type": "application/json"},
                )
                statuses.append(resp.status_code)

    health_ms: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        floods = [pool.submit(flood, i) for i in range(4)]
        try:
            time.sleep(1.0)  # the flood is under way
            with httpx.Client(base_url=service.base_url, timeout=30) as http:
                deadline = time.monotonic() + 12
                while time.monotonic() < deadline:
                    t = time.perf_counter()
                    assert http.get("/health").status_code == 200
                    health_ms.append((time.perf_counter() - t) * 1000)
                    time.sleep(0.02)
                other = http.post(
                    "/v1/chat/completions", content=_chat("Name a color."),
                    headers={"authorization": "Bearer sk-bystander", "content-type": "application/json", **NO_CACHE},
                )
        finally:
            stop.set()
            for f in floods:
                f.result(timeout=120)
    assert other.status_code == 200, other.text
    assert statuses and all(400 <= s < 500 for s in statuses), sorted(set(statuses))
    health_ms.sort()
    print(f"flood: {len(statuses)} huge requests refused, /health p50 {health_ms[len(health_ms) // 2]:.1f} ms, "
          f"max {health_ms[-1]:.1f} ms over {len(health_ms)} probes")
    assert health_ms[-1] <= HEALTH_MAX_MS, f"/health stalled {health_ms[-1]:.0f} ms under the flood"


# --------------------------------------------------------------------------- the newer surfaces

_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _deep_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    "body, param",
    [
        (_chat(logit_bias={"\u00b2": 5}), "logit_bias"),  # a superscript digit: str.isdigit, but no int
        (_chat(logit_bias={"9" * 5000: 5}), "logit_bias"),
        (_chat(tools=[_TOOL], tool_choice={"type": "function", "function": "get_weather"}), "tool_choice"),
        (_body(messages=[{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                                             "function": "get_weather"}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]), "messages"),
        (_chat(guided_json="[" * 5000 + "]" * 5000), "guided_json"),
        ('{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "guided_json": %s}'
         % (TARGET, '{"type": "array", "items": ' * 900 + '{"type": "string"}' + "}" * 900), "guided_json"),
        ('{"model": "%s", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
         '"content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '
         '"{\\"x\\": \\"\\\\ud800\\"}"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}' % TARGET,
         "messages"),
        (_chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": _deep_schema(40)}}),
         "response_format"),
        (_chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": _deep_schema(40)}}}}]), "tools"),
        (_chat(tools=[{"type": "function", "function": {"name": f"f{i}", "description": "d" * 2000}}
                      for i in range(60)]), "tools"),
    ],
    ids=["bias-superscript", "bias-5000-digits", "tool-choice-function-string", "history-function-string",
         "guided-json-string-deep", "guided-json-deep", "history-arguments-surrogate", "schema-depth-40",
         "tool-parameters-depth-40", "tools-120k-chars"],
)
def test_hostile_new_fields_get_a_400_naming_the_field(service, body, param):
    resp = _post(service, body, headers=NO_CACHE)
    _error(resp, 400)
    assert (resp.json()["error"]["param"] or "").startswith(param), resp.text


def test_logprobs_of_forbidden_tokens_are_finite_json(service):
    """guided_choice with top_logprobs: the alternatives the grammar forbids have log-probability
    -inf, which JSON cannot carry; they come back at OpenAI's finite floor, streamed or not."""
    fields = dict(guided_choice=["yes", "no"], logprobs=True, top_logprobs=5, max_tokens=3)
    resp = _post(service, _chat("Is the sky blue?", **fields), headers=NO_CACHE)
    assert resp.status_code == 200, resp.text
    values = [alt["logprob"] for tok in resp.json()["choices"][0]["logprobs"]["content"] for alt in tok["top_logprobs"]]
    assert values and min(values) >= -9999.0
    stream = _post(service, _chat("Is the sky blue?", stream=True, **fields), headers=NO_CACHE)
    assert stream.status_code == 200 and "Infinity" not in stream.text and "NaN" not in stream.text
    for line in stream.text.splitlines():
        if line.startswith("data: {"):
            json.loads(line[6:])  # every event is JSON


def test_a_deep_schema_never_stalls_the_event_loop(service):
    """A schema at the depth limit with a fresh title each time (no cache helps): each request is
    answered (200 or a 400 naming the field) while /health keeps answering."""
    stop = threading.Event()
    statuses: list[int] = []

    def attack() -> None:
        with httpx.Client(base_url=service.base_url, timeout=60) as http:
            i = 0
            while not stop.is_set() and i < 40:
                schema = {**_deep_schema(15), "title": f"t{time.time_ns()}-{i}"}
                resp = http.post("/v1/chat/completions", content=_chat("hi", guided_json=schema, max_tokens=2),
                                 headers={"authorization": "Bearer sk-schema-attacker", "content-type": "application/json",
                                          **NO_CACHE})
                statuses.append(resp.status_code)
                i += 1

    health_ms: list[float] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        job = pool.submit(attack)
        with httpx.Client(base_url=service.base_url, timeout=30) as http:
            deadline = time.monotonic() + 8
            while time.monotonic() < deadline and not job.done():
                t = time.perf_counter()
                assert http.get("/health").status_code == 200
                health_ms.append((time.perf_counter() - t) * 1000)
                time.sleep(0.02)
        stop.set()
        job.result(timeout=120)
    assert statuses and all(s in (200, 400) for s in statuses), sorted(set(statuses))
    assert max(health_ms) <= HEALTH_MAX_MS, f"/health stalled {max(health_ms):.0f} ms"


def test_one_poisoned_sequence_never_fails_its_batch_mates(service):
    """A grammar that allows one short answer, with min_tokens and sampling: nothing is left to
    choose once the answer is written. That sequence ends (the grammar wins); the bystanders in
    the same batched steps finish with the output they get without it."""
    prompts = ["Name a fruit and say why you like it."]  # the test service runs two requests at once

    def bystander(prompt: str) -> str:
        resp = service.http.post("/v1/chat/completions", content=_body(
            model=SMALL, messages=[{"role": "user", "content": prompt}], max_tokens=24),
            headers={"content-type": "application/json", **NO_CACHE})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]

    alone = [bystander(p) for p in prompts]
    poison = _body(model=SMALL, messages=[{"role": "user", "content": "Yes or no?"}], guided_choice=["y"],
                   min_tokens=8, temperature=0.9, max_tokens=16)
    with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
        poisons = [pool.submit(_post, service, poison, "/v1/chat/completions", NO_CACHE)]
        together = list(pool.map(bystander, prompts))
        for f in poisons:
            resp = f.result()
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] == "y"
    for a, b in zip(alone, together):
        assert_greedy_agrees(a, b)


def test_a_cached_answer_never_serves_a_conversation_with_other_tool_calls(service):
    """Two agent histories that differ only in a tool call's arguments are two conversations."""
    def history(city: str) -> str:
        return _body(messages=[
            {"role": "user", "content": "What's the weather?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "It is sunny."},
            {"role": "user", "content": "Summarize in three words."}], max_tokens=8)

    tenant = {"authorization": f"Bearer sk-tools-{time.time_ns()}"}
    first = _post(service, history("Paris"), headers=tenant)
    assert first.status_code == 200, first.text
    again = _post(service, history("Paris"), headers=tenant)
    assert again.headers.get("x-cache") == "hit"
    other = _post(service, history("Rome"), headers=tenant)
    assert other.status_code == 200 and other.headers.get("x-cache") != "hit"


def test_embeddings_are_bounded_per_request(service):
    """Past the configured count of inputs or tokens: a 400 naming input, at once; within them,
    answered."""
    limits = service.config.args.ingress.limits
    _error(_post(service, json.dumps({"model": "all-MiniLM-L6-v2", "input": ["x"] * (limits.max_embedding_inputs + 1)}),
                 "/v1/embeddings"), 400)
    many_tokens = ["word " * 200] * (limits.max_embedding_tokens // 200 + 2)
    many_tokens = many_tokens[: limits.max_embedding_inputs]
    resp = _post(service, json.dumps({"model": "all-MiniLM-L6-v2", "input": many_tokens}), "/v1/embeddings")
    _error(resp, 400)
    assert resp.json()["error"]["param"] == "input"
    ok = _post(service, json.dumps({"model": "all-MiniLM-L6-v2", "input": ["a short text"] * 8}), "/v1/embeddings")
    assert ok.status_code == 200 and len(ok.json()["data"]) == 8


def test_a_client_retrying_its_429s_without_pause_is_paced(service):
    """A tenant over its rate that retries at once, on four connections, gets its 429s a hold
    apart on each (`ingress.over_limit_hold_s`), each in OpenAI's shape with a Retry-After
    shortened by the hold, instead of hundreds a second; /health answers and other tenants are
    served meanwhile."""
    hold_s = service.config.args.ingress.over_limit_hold_s
    assert hold_s >= 0.5
    headers = {"authorization": f"Bearer {RETRYING_KEY}", "content-type": "application/json", **NO_CACHE}
    stop = time.monotonic() + 3 * hold_s

    def retry() -> list[tuple[int, str | None, str | None]]:
        codes: list[tuple[int, str | None, str | None]] = []
        with httpx.Client(base_url=service.base_url, timeout=30) as http:
            while time.monotonic() < stop and len(codes) <= 50:
                resp = http.post("/v1/chat/completions", content=_chat("hi", max_tokens=1), headers=headers)
                codes.append((resp.status_code, resp.json().get("error", {}).get("code") if resp.status_code != 200
                              else None, resp.headers.get("retry-after")))
        return codes

    health_ms: list[float] = []

    def probe() -> None:
        with httpx.Client(base_url=service.base_url, timeout=30) as http:
            while time.monotonic() < stop:
                start = time.perf_counter()
                http.get("/health")
                health_ms.append((time.perf_counter() - start) * 1000)
                time.sleep(0.05)

    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        health = pool.submit(probe)
        per_connection = list(pool.map(lambda _: retry(), range(4)))
        health.result()
    codes = [c for one in per_connection for c in one]
    refused = [c for c in codes if c[0] != 200]
    assert refused and all(status == 429 and code == "rate_limit_requests" for status, code, _ in refused), codes
    for one in per_connection:
        assert len(one) <= 5, f"{len(one)} answers in {3 * hold_s:.1f} s on one connection: the 429s were not paced"
    assert all(after is not None and int(after) >= 0 for *_, after in refused)
    assert health_ms and max(health_ms) < HEALTH_MAX_MS, max(health_ms)
    other = _post(service, _chat("still there?"))
    assert other.status_code == 200, other.text
