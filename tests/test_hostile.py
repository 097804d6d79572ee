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
from tests.conftest import ADMIN_KEY, TRIMMED_TIER
from tests.test_serving import NO_CACHE, TARGET, _error, _post

HEALTH_P99_MS = 100.0


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

PREFIX_PROMPT = (
    "You are a meticulous assistant for a logistics company. Our warehouse in Rotterdam ships pallets of "
    "machine parts to customers in Germany, Belgium and France every weekday morning. Answer in one word: "
    "which country is not mentioned twice?"
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
    Meanwhile /health answers within HEALTH_P99_MS at p99 and another tenant's chat succeeds."""
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
    p99 = health_ms[int(0.99 * (len(health_ms) - 1))]
    print(f"flood: {len(statuses)} huge requests refused, /health p50 {health_ms[len(health_ms) // 2]:.1f} ms, "
          f"p99 {p99:.1f} ms over {len(health_ms)} probes")
    assert p99 <= HEALTH_P99_MS, f"/health p99 {p99:.1f} ms under the flood (median {health_ms[len(health_ms) // 2]:.1f})"
