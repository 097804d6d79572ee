"""The semantic cache end to end: real Ray Serve, MiniLM, Qdrant (edge), SmolLM2, openai SDK."""

from __future__ import annotations

import threading

from ingress.context import tenant_from_headers
from tests.conftest import ADMIN_KEY, assert_greedy_agrees
from tests.test_serving import TARGET

NO_CACHE = {"Cache-Control": "no-cache, no-store"}


def _ask(client, text: str, *, headers: dict | None = None, history: list | None = None, **kwargs):
    messages = (history or []) + [{"role": "user", "content": text}]
    params = dict(model=TARGET, messages=messages, temperature=0, max_tokens=16)
    params.update(kwargs)
    return client.chat.completions.with_raw_response.create(extra_headers=headers or {}, **params)


def _text(raw) -> str:
    return raw.parse().choices[0].message.content


def test_a_semantic_match_is_verified_and_an_exact_repeat_replayed_as_a_stream(service):
    """The shipped `semantic.mode: verify`: a paraphrase is not served the cached answer as is;
    the model checks it as a draft, so the text is the model's own."""
    client = service.openai(api_key="sk-tenant-para")
    before = service.model_stats("SemanticCache")
    streams_before = service.model_stats("TargetModel")["generate_by_channel"]
    first = _ask(client, "What is the capital of France?")
    assert first.headers["x-cache"] == "miss"
    para = _ask(client, "Which city is the capital of France?")
    assert para.headers["x-cache"] == "verified", para.headers
    assert para.headers["x-cache-match"].startswith("verify;score=")
    assert "accepted=" in para.headers["x-cache-accepted"]
    timing = para.headers["server-timing"]
    assert "lookup.embed;dur=" in timing and "lookup.cache_semantic;dur=" in timing
    plain = _ask(client, "Which city is the capital of France?", headers=NO_CACHE)
    assert _text(para) == _text(plain)
    # Streamed, an exact repeat replays in several SSE chunks that join back to the answer.
    stream = client.chat.completions.create(
        model=TARGET, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=16, stream=True,
    )
    pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(pieces) > 1 and "".join(pieces) == _text(first)
    # The ingress shares the cache replica's node: its lookups took the side channel, not the
    # handle (deployments/channel.py), and a hit came back through it all the same.
    after = service.model_stats("SemanticCache")
    assert after["lookups_by_channel"] - before["lookups_by_channel"] >= 2, after
    assert after["lookups_by_handle"] == before["lookups_by_handle"], after
    # So did the miss's model call (target.channel: the model runs one replica, on this node).
    assert service.model_stats("TargetModel")["generate_by_channel"] > streams_before


def test_a_verified_hit_is_the_models_own_greedy_answer_whether_the_cached_one_is_right_or_not(service):
    """A close paraphrase (its cached answer right) and an opposite question that scores as high
    (its cached answer wrong: descending, not ascending): either way the text is token for token
    what the model answers with no cache at all."""
    client = service.openai(api_key="sk-tenant-verify")
    cached = _ask(client, "How do I sort a list in ascending order in Python?", max_tokens=40)
    assert cached.headers["x-cache"] == "miss"
    for question in ("How can I sort a list in ascending order in Python?",
                     "How do I sort a list in descending order in Python?"):
        served = _ask(client, question, max_tokens=40)
        assert served.headers["x-cache"] in ("verified", "hint"), served.headers
        plain = _ask(client, question, max_tokens=40, headers=NO_CACHE)
        assert _text(served) == _text(plain), (question, served.headers)
    assert served.headers["x-cache"] == "verified", "the opposite question passed the guards: verification decides"
    assert _text(served) != _text(cached), "the cached answer was the wrong one"


def test_tenant_b_never_gets_tenant_a_answer(service):
    alice = service.openai(api_key="sk-alice")
    bob = service.openai(api_key="sk-bob")
    question = "What is the largest planet in our solar system?"
    answer = _text(_ask(alice, question))
    # Bob writes nothing (no-store), so a hit could only be Alice's answer.
    for client, text, headers in (
        (bob, question, {}),
        (bob, "Which planet in the solar system is the biggest?", {}),
        (bob, question, {"x-tenant": "anonymous"}),  # a header cannot reach another key's namespace
    ):
        raw = _ask(client, text, headers={"Cache-Control": "no-store", **headers})
        assert raw.headers["x-cache"] != "hit", "one tenant's answer must never serve another"
    assert _ask(alice, question).headers["x-cache"] == "hit"
    assert _text(_ask(alice, question)) == answer


def test_context_and_negation_are_not_false_hits(service):
    client = service.openai(api_key="sk-tenant-guards")
    _ask(client, "Is it safe to eat raw eggs?")
    negated = _ask(client, "Is it not safe to eat raw eggs?")
    assert negated.headers["x-cache"] in ("hint", "miss") and negated.headers["x-cache"] != "hit"
    # Same last message, different earlier turns: another scope, never a hit (GPTCache #8).
    history = [
        {"role": "user", "content": "Let's talk about chickens."},
        {"role": "assistant", "content": "Sure, chickens."},
    ]
    assert _ask(client, "Is it safe to eat raw eggs?", history=history).headers["x-cache"] == "miss"


def test_near_miss_becomes_a_lossless_draft(service):
    client = service.openai(api_key="sk-tenant-hint")
    _ask(client, "What is 12 times 7?", max_tokens=40)
    stats_before = service.model_stats("TargetModel")
    hinted = _ask(client, "What is 12 times 8?", max_tokens=40)
    assert hinted.headers["x-cache"] == "hint", hinted.headers
    stats_after = service.model_stats("TargetModel")
    assert stats_after["hint_tokens_accepted"] > stats_before["hint_tokens_accepted"], stats_after
    # Verification keeps it exact: the same text as with no cache (and no hint) at all.
    plain = _ask(client, "What is 12 times 8?", max_tokens=40, headers=NO_CACHE)
    assert plain.headers["x-cache"] == "bypass"
    assert_greedy_agrees(_text(hinted), _text(plain))


def test_cache_control_sampling_and_invalidate(service):
    client = service.openai(api_key="sk-tenant-control")
    question = "Name three primary colors."
    _ask(client, question, headers={"Cache-Control": "no-store"})
    assert _ask(client, question).headers["x-cache"] == "miss"  # no-store: nothing was written
    assert _ask(client, question, headers={"Cache-Control": "no-cache"}).headers["x-cache"] == "bypass"
    assert _ask(client, question).headers["x-cache"] == "hit"
    # Sampled requests bypass the cache, unless they opt in (then they are keyed by temperature and seed).
    assert _ask(client, question, temperature=0.8).headers["x-cache"] == "bypass"
    opt_in = {"x-cache-sampled": "allow"}
    assert _ask(client, question, temperature=0.8, seed=1, headers=opt_in).headers["x-cache"] == "miss"
    assert _ask(client, question, temperature=0.8, seed=1, headers=opt_in).headers["x-cache"] == "hit"
    # Invalidate drops this tenant's answers, and only this tenant's.
    other = service.openai(api_key="sk-tenant-control-other")
    _ask(other, question)
    mine = tenant_from_headers({"authorization": "Bearer sk-tenant-control"})
    refused = service.http.delete("/v1/cache", headers={"authorization": "Bearer sk-tenant-control"})
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_required"
    resp = service.http.delete("/v1/cache", params={"tenant": mine}, headers={"authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code == 200 and resp.json()["deleted"] >= 2 and resp.json()["tenant"] == mine
    assert _ask(client, question).headers["x-cache"] == "miss"
    assert _ask(other, question).headers["x-cache"] == "hit"


def test_identical_requests_in_flight_share_one_generation(service):
    client = service.openai(api_key="sk-tenant-flight")
    question = "Write one sentence about the sea."
    before = service.model_stats("TargetModel")["requests_started"]
    results: list = [None, None]

    def ask(i: int) -> None:
        results[i] = _ask(client, question, max_tokens=24)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    threads[0].start()
    threads[1].start()
    for t in threads:
        t.join(120)
    assert {r.headers["x-cache"] for r in results} == {"miss"}
    assert [r.headers.get("x-coalesced") for r in results].count("true") == 1
    assert _text(results[0]) == _text(results[1])
    assert service.model_stats("TargetModel")["requests_started"] - before == 1
