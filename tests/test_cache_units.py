"""Semantic cache logic without Ray: guards, keys, both Qdrant stores, lookup outcomes,
single-flight, and the shipped threshold against the shipped evaluation set."""

from __future__ import annotations

import asyncio

import pytest

from configs.schemas import CacheConfig, VectorStoreConfig
from engines.types import GenerateChunk
from ingress.coalescing import Flights
from ingress.context import context_from_headers
from ingress.respond import _pieces
from semantic_cache.cache import CacheEntry, ResponseCache
from bench.evalset import eval_pairs
from semantic_cache.exact import CachedResponse, ExactCache
from semantic_cache.guards import mismatch
from semantic_cache.keys import exact_key, scope_key, split_query
from semantic_cache.store import make_store


@pytest.mark.parametrize(
    "cached, query, reason",
    [
        ("Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?", "negation"),
        ("Why does my code compile?", "Why doesn't my code compile?", "negation"),
        ("What is 15% of 200?", "What is 15% of 300?", "numbers"),
        ("What is two plus two?", "What is two plus three?", "numbers"),
        ("What is the capital of France?", "What is the capital of Spain?", "entities"),
        ("How do I enable two-factor authentication?", "How do I disable two-factor authentication?", "contrast"),
        ("How do I sort a list in Python?", "How do I sort a dict in Python?", "contrast"),
        ("How do I convert Celsius to Fahrenheit?", "How do I convert Fahrenheit to Celsius?", "direction"),
        # Paraphrases pass: number words that are not quantities, acronyms, aliases.
        ("How do I read a file line by line in Python?", "In Python, how can I read a file one line at a time?", None),
        ("What is the currency of the United Kingdom?", "What money is used in the UK?", None),
        ("How do I sort a dictionary by value in Python?", "Python: sort a dict by its values", None),
        ("When did World War II end?", "In what year did the Second World War end?", None),
    ],
)
def test_guards(cached, query, reason):
    assert mismatch(cached, query) == reason


def test_scope_covers_everything_but_the_last_user_turn():
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    context, query = split_query(turns)
    assert query == "Hi" and context == turns[:1]
    base = dict(tenant="t", model="chat:m", context=context, sampling={"max_tokens": 5})
    assert scope_key(**base) == scope_key(**{**base, "context": [{"role": "system", "content": " Be brief.\n"}]})
    for change in ({"tenant": "u"}, {"model": "chat:n"}, {"sampling": {"max_tokens": 6}},
                   {"context": [{"role": "system", "content": "Be verbose."}]}):
        assert scope_key(**{**base, **change}) != scope_key(**base)
    # A chat that ends on an assistant turn has no question to compare: exact match only.
    assert split_query(turns + [{"role": "assistant", "content": "Hel"}])[1] is None


def test_writes_and_deletes_never_wait_for_an_index_build(embedder):
    """An HNSW build holds the store for seconds; a write or an invalidation that came then
    returns at once (the replica's event loop answers lookups too) and lands right after."""
    import threading
    import time

    store = make_store(VectorStoreConfig(kind="edge"), embedder.dimensions)
    building = threading.Event()

    class SlowBuild:  # the real shard, with an index build that takes a second
        def __init__(self, shard) -> None:
            self._shard = shard

        def __getattr__(self, name):
            return getattr(self._shard, name)

        def optimize(self):
            building.set()
            time.sleep(1.0)
            return self._shard.optimize()

    store.shard = SlowBuild(store.shard)
    build = threading.Thread(target=store.maintain)
    build.start()
    assert building.wait(10)
    q, payload = "What is DNA?", {"scope": "s", "tenant": "t", "expires": 1e12}
    store.upsert("00000000-0000-0000-0000-000000000002", embedder.embed(q), payload)
    store.delete_tenant("someone-else")
    assert build.is_alive() and store.queued_writes == 2, "the writes queued behind the build, not waited for it"
    build.join(10)
    assert store.queued_writes == 0 and store.search(embedder.embed(q), "s", 0.0, 1)[0].score > 0.99


def test_x_tenant_is_a_namespace_inside_the_key():
    a = context_from_headers({"authorization": "Bearer key-a", "x-tenant": "shared"}).tenant
    b = context_from_headers({"authorization": "Bearer key-b", "x-tenant": "shared"}).tenant
    assert a != b and "key-a" not in a


def _response(text: str = "Paris.") -> CachedResponse:
    return CachedResponse(text, "stop", 10, 3, "m")


def _entry(key: str, tenant: str, scope: str, query: str, vector, text: str = "Paris.") -> CacheEntry:
    return CacheEntry(key, tenant, scope, query, vector, _response(text))


@pytest.mark.parametrize("kind", ["edge", "qdrant"])
def test_lookup_outcomes_scoping_and_invalidation(kind, embedder):
    config = CacheConfig.model_validate({"max_entries": 3, "semantic": {"mode": "trust", "store": {"kind": kind}}})
    cache = ResponseCache(config, make_store(config.semantic.store, embedder.dimensions))
    q1 = "What is the capital of France?"
    cache.put(_entry("a" * 64, "t1", "s1", q1, embedder.embed(q1)))
    para = "Which city is the capital of France?"
    found = cache.lookup_similar("s1", embedder.embed(para), para)
    assert found.outcome == "hit" and found.response.text == "Paris." and found.query == q1
    # The default mode, verify, never serves it as is: the model checks it as a draft.
    cache.semantic = CacheConfig().semantic
    found = cache.lookup_similar("s1", embedder.embed(para), para)
    assert found.outcome == "hint" and found.reason == "verify" and found.response.text == "Paris."
    cache.semantic = config.semantic
    # Same question, other scope (tenant / context / model / sampling): never served.
    assert cache.lookup_similar("s2", embedder.embed(para), para).outcome == "miss"
    # A near miss that fails a guard becomes a draft hint, not a hit.
    near = "What is the capital of Spain?"
    assert mismatch(q1, near) == "entities"
    found = cache.lookup_similar("s1", embedder.embed(near), near)
    assert found.outcome in ("hint", "miss") and found.outcome != "hit"
    neg = "What is not the capital of France?"
    found = cache.lookup_similar("s1", embedder.embed(neg), neg)
    assert found.outcome == "hint" and found.reason == "negation"
    assert cache.lookup_exact("a" * 64).text == "Paris."
    # LRU eviction removes the vector too.
    for i, q in enumerate(["How do I bake bread?", "What is DNA?", "Why is the sky blue?"]):
        cache.put(_entry(str(i) * 64, "t1", "s1", q, embedder.embed(q)))
    assert cache.lookup_exact("a" * 64) is None
    assert cache.lookup_similar("s1", embedder.embed(para), para).outcome != "hit"
    # Invalidation is per tenant.
    cache.put(_entry("b" * 64, "t2", "s9", q1, embedder.embed(q1)))
    assert cache.invalidate("t1") == 2  # one t1 entry was already evicted by the t2 write
    assert cache.lookup_similar("s1", embedder.embed("What is DNA?"), "What is DNA?").outcome == "miss"
    assert cache.lookup_similar("s9", embedder.embed(para), para).outcome == "hit"


def test_expired_entries_are_never_served(embedder):
    now = [1000.0]
    config = CacheConfig.model_validate({"ttl_s": 10, "semantic": {"mode": "trust"}})
    cache = ResponseCache(config, make_store(config.semantic.store, embedder.dimensions), clock=lambda: now[0])
    q = "What is DNA?"
    cache.put(_entry("c" * 64, "t", "s", q, embedder.embed(q)))
    assert cache.lookup_similar("s", embedder.embed(q), q).outcome == "hit"
    now[0] += 11
    assert cache.lookup_exact("c" * 64) is None
    assert cache.lookup_similar("s", embedder.embed(q), q).outcome == "miss"


def test_edge_store_keeps_answers_across_restarts(tmp_path, embedder):
    store_config = VectorStoreConfig(kind="edge", location=str(tmp_path / "shard"))
    q = "What is DNA?"
    store = make_store(store_config, embedder.dimensions)
    store.upsert("00000000-0000-0000-0000-000000000001", embedder.embed(q), {"scope": "s", "tenant": "t", "expires": 1e12})
    store.maintain()
    store.shard.close()
    again = make_store(store_config, embedder.dimensions)
    assert again.count() == 1 and again.search(embedder.embed(q), "s", 0.0, 1)[0].score > 0.99


@pytest.mark.parametrize("cached, query", [
    ("How do I sort a list in ascending order?", "How do I sort a list in descending order?"),
    ("How do I pause a recording in OBS?", "How do I resume a recording in OBS?"),
    ("How do I convert kilometers to miles?", "How do I convert miles to kilometers?"),
    ("Sort names in alphabetical order.", "Sort names in reverse alphabetical order."),
    ("How do I turn on notifications on Android?", "How do I turn off notifications on Android?"),
    ("Is it good to drink coffee in the morning?", "Is it good to drink coffee at night?"),
])
def test_guards_refuse_a_one_word_swap_no_word_list_names(cached, query):
    assert mismatch(cached, query) is not None


@pytest.mark.parametrize("cached, query", [
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?"),
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("What causes rain?", "Why does it rain?"),
    ("What is the square root of 144?", "What's the square root of 144?"),
])
def test_guards_pass_paraphrases_that_reword_around_the_content(cached, query):
    assert mismatch(cached, query) is None


def test_shipped_threshold_meets_the_bar_on_the_shipped_eval_set(embedder, serve_file):
    """Precision >= 0.97 at recall >= 0.7, with the threshold serve_config.yaml ships."""
    threshold = serve_file.args.cache.semantic.threshold
    pairs = eval_pairs()
    a = embedder.embed_many([p.cached for p in pairs])
    b = embedder.embed_many([p.query for p in pairs])
    served = [float(x @ y) >= threshold and mismatch(p.cached, p.query) is None for p, x, y in zip(pairs, a, b)]
    tp = sum(s and p.label == "hit" for s, p in zip(served, pairs))
    fp = sum(s and p.label == "miss" for s, p in zip(served, pairs))
    hits = sum(p.label == "hit" for p in pairs)
    assert tp / (tp + fp) >= 0.97 and tp / hits >= 0.7, (tp, fp, hits)


class _FakeStream:
    """Scheduling-only stand-in for a model stream (the e2e tests use the real model)."""

    def __init__(self, n: int) -> None:
        self.n, self.sent, self.cancelled = n, 0, False

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerateChunk:
        await asyncio.sleep(0.01)
        self.sent += 1
        done = self.sent == self.n
        return GenerateChunk(text=f"t{self.sent} ", num_tokens=1, finish_reason="stop" if done else None)

    def cancel(self) -> None:
        self.cancelled = True


def test_single_flight_shares_one_generation_and_stops_when_all_leave():
    async def scenario():
        flights = Flights()
        source = _FakeStream(5)
        lead, followed = flights.join("k", lambda: source)
        await lead.__anext__()
        follow, joined = flights.join("k", lambda: pytest.fail("a second generation started"))
        assert (followed, joined) == (False, True)
        texts = []
        for stream in (lead, follow):
            texts.append("".join([c.text async for c in stream]))
        assert texts[1] == "t1 t2 t3 t4 t5 " and texts[0] == "t2 t3 t4 t5 "
        # Everyone leaves before the end: the model call is cancelled.
        quitter_source = _FakeStream(100)
        a, _ = flights.join("q", lambda: quitter_source)
        b, _ = flights.join("q", lambda: quitter_source)
        await a.__anext__()
        a.cancel()
        await b.__anext__()
        assert not quitter_source.cancelled  # b still listens
        b.cancel()
        await asyncio.sleep(0.05)
        assert quitter_source.cancelled

    asyncio.run(scenario())


def test_replayed_hits_are_chunked_and_join_back_exactly():
    text = "The capital of France is Paris.\n\nIt is  on the Seine. "
    pieces = _pieces(text, 4)
    assert len(pieces) > 2 and "".join(pieces) == text
    assert _pieces("", 4) == [""]


def test_single_embedding_fast_path_matches_batched_encode(embedder):
    """The lean one-text forward (lean_bert.py) is in use, on onnxruntime where it measured
    faster at load (onnx_bert.py) or else traced into one TorchScript call (both keep the GIL
    out of a busy ingress's way), and gives sentence-transformers' vector at every length: to
    float32's rounding in float32, within cosine 0.9995 in bfloat16 (auto's torch pick where
    the CPU has native bf16 dot products)."""
    import numpy as np
    import torch

    from semantic_cache.embedder import BF16_MAX_TIME_RATIO, BF16_MIN_COSINE, ONNX_MAX_TIME_RATIO, ONNX_MIN_COSINE
    from semantic_cache.lean_bert import LeanBertEncoder
    from semantic_cache.onnx_bert import OnnxBertEncoder

    assert embedder.lean is not None, "MiniLM should take the lean forward pass"
    bf16, onnx = embedder.bf16_check, embedder.onnx_check
    if "skipped" in bf16:  # an x86 CPU without AVX-512: bf16 is emulated there, not worth timing
        assert torch.backends.cpu.get_cpu_capability() in ("NO AVX", "DEFAULT", "AVX2"), bf16
        takes_bf16 = False
    else:
        takes_bf16 = bf16["cosine"] >= BF16_MIN_COSINE and bf16["time_ratio"] <= BF16_MAX_TIME_RATIO
    assert onnx, "auto should have measured onnxruntime against torch's pick"
    takes_onnx = onnx["cosine"] >= ONNX_MIN_COSINE and onnx["time_ratio"] <= ONNX_MAX_TIME_RATIO
    assert embedder.runtime == ("onnxruntime" if takes_onnx else "torch"), onnx
    if takes_onnx:
        assert isinstance(embedder.lean, OnnxBertEncoder) and embedder.precision == "float32"
    else:
        assert embedder.lean._traced is not None, "the lean pass should run as one TorchScript call"
        assert embedder.precision == ("bfloat16" if takes_bf16 else "float32"), bf16
        assert embedder.lean.dtype == (torch.bfloat16 if takes_bf16 else torch.float32)
    exact = not takes_bf16 or takes_onnx
    bert, tokenizer, max_length = embedder.model[0].auto_model, embedder.model.tokenizer, embedder.model.max_seq_length
    full = LeanBertEncoder(bert, tokenizer, max_length)
    assert full._traced is not None
    on_onnx = OnnxBertEncoder(bert, tokenizer, max_length)
    texts = ["How do I reverse a list in Python?", "What is the capital of France?", "ok", "word " * 400]
    batched = embedder.embed_many(texts)
    for text, expected in zip(texts, batched):
        one = embedder.embed(text)
        assert one.dtype == np.float32 and abs(float(np.linalg.norm(one)) - 1) < 1e-5
        assert float(np.dot(one, expected)) >= BF16_MIN_COSINE, text[:40]
        if exact:
            assert np.allclose(one, expected, atol=1e-5), text[:40]
        assert np.allclose(full.embed(text), expected, atol=1e-5), text[:40]
        assert np.allclose(on_onnx.embed(text), expected, atol=1e-5), text[:40]
        assert np.allclose(embedder.embed_modules(text), expected, atol=1e-5)


def test_the_invalidation_log_hands_each_replica_what_it_missed():
    from semantic_cache.invalidations import EVERYTHING, InvalidationLog

    log = InvalidationLog(keep=3)
    fresh = log.since(-1)
    assert fresh.tenants == [] and fresh.seq == 0  # a new replica starts from now
    log.add("t1")
    log.add("t2")
    assert log.since(0).tenants == ["t1", "t2"] and log.since(1).tenants == ["t2"] and log.since(2).tenants == []
    for t in ("t3", "t4", "t5"):
        log.add(t)
    assert log.since(1).tenants == [EVERYTHING]  # t2 is gone from the log: drop everything
    assert log.since(2).tenants == ["t3", "t4", "t5"] and log.since(2).seq == 5


def test_bounded_mode_verifies_until_verifications_bound_the_error_then_serves_and_vetoes(embedder):
    """semantic.mode bounded: nothing is served unverified before enough clean verifications; then
    a match at the learned similarity is a hit ("bounded"); an entry the model once rejected is
    verified again at that similarity; a failure lowers nothing it should not."""
    from semantic_cache.skip_policy import SkipPolicy

    config = CacheConfig.model_validate({"semantic": {"mode": "bounded", "max_error_rate": 0.05, "explore_rate": 0.0}})
    cache = ResponseCache(config, make_store(config.semantic.store, embedder.dimensions))
    q1 = "What is the capital of France?"
    cache.put(_entry("b" * 64, "t1", "s1", q1, embedder.embed(q1)))
    para = "Which city is the capital of France?"
    found = cache.lookup_similar("s1", embedder.embed(para), para)
    assert found.outcome == "hint" and found.reason == "verify" and found.entry_key == "b" * 64
    needed = SkipPolicy.labels_needed(0.05)
    for _ in range(needed):  # another tenant's clean verifications teach t1's policy nothing
        cache.verified("other", found.score, True, tenant="t2")
    assert cache.lookup_similar("s1", embedder.embed(para), para).outcome == "hint", "another tenant's labels counted"
    for _ in range(needed - 1):
        cache.verified("other", found.score, True, tenant="t1")
    assert cache.lookup_similar("s1", embedder.embed(para), para).outcome == "hint", "served before the bound held"
    cache.verified("other", found.score, True, tenant="t1")
    served = cache.lookup_similar("s1", embedder.embed(para), para)
    assert served.outcome == "hit" and served.reason == "bounded"
    cache.verified("b" * 64, found.score, False)  # the model did not give this entry's answer
    assert cache.lookup_similar("s1", embedder.embed(para), para).outcome == "hint"
    assert cache.stats()["bounded_failures"] == 1


def test_the_skip_policy_keeps_the_realised_error_rate_under_its_bound():
    """A stream where matches above 0.95 are right 99.9% of the time and below it 60%: the policy
    learns a threshold near 0.95, serves most of what is above it, and the share of wrong answers
    among what it served unverified stays under the bound."""
    import random

    from semantic_cache.skip_policy import SkipPolicy, failure_upper_bound

    assert failure_upper_bound(0, SkipPolicy.labels_needed(0.01)) <= 0.01 < failure_upper_bound(0, 298)
    rng, policy = random.Random(0), SkipPolicy(0.01, explore_rate=0.05, rng=random.Random(1))
    served = wrong = 0
    for _ in range(20_000):
        score = rng.uniform(0.86, 1.0)
        correct = rng.random() < (0.999 if score > 0.95 else 0.6)
        key = f"e{rng.randrange(2000)}"
        if policy.serve_unverified(score, key):
            served += 1
            wrong += not correct
        else:
            policy.observe(score, key, correct)
    assert policy.threshold is not None and 0.94 <= policy.threshold <= 0.97, policy.threshold
    assert served > 4000 and wrong / served <= 0.01, (served, wrong)


@pytest.mark.parametrize("kind", ["edge", "qdrant"])
def test_invalidating_a_tenant_drops_its_x_tenant_namespaces_too(kind, embedder):
    """DELETE /v1/cache?tenant=K drops K's answers and those of every `x-tenant` namespace
    inside K ("K/sub"); another key's namespaces stay."""
    config = CacheConfig.model_validate({"semantic": {"mode": "trust", "store": {"kind": kind}}})
    cache = ResponseCache(config, make_store(config.semantic.store, embedder.dimensions))
    q = "What is the capital of France?"
    for i, tenant in enumerate(("k1", "k1/app", "k2/app")):
        cache.put(_entry(str(i) * 64, tenant, f"s{i}", q, embedder.embed(q)))
    assert cache.invalidate("k1") == 2
    assert cache.lookup_exact("0" * 64) is None and cache.lookup_exact("1" * 64) is None
    assert cache.lookup_similar("s1", embedder.embed(q), q).outcome == "miss"
    assert cache.lookup_exact("2" * 64) is not None
    assert cache.lookup_similar("s2", embedder.embed(q), q).outcome == "hit"


def test_guards_do_work_linear_in_the_question():
    """A near-duplicate with thousands of names and acronyms is judged without quadratic work:
    doubling its length about doubles the Python lines the guards run, it does not quadruple
    them. (Counted in lines run, not seconds: a unit test never asserts elapsed time.)"""
    import sys

    from semantic_cache import guards

    def text(n: int, acronyms: bool) -> str:
        words = [f"Name{i}" for i in range(n)]
        if acronyms:
            words += ["".join(chr(66 + (i // 24 ** j) % 24) for j in range(3)) for i in range(n)]  # BBB, CBB, ...
        return " ".join(words)

    def lines(n: int) -> int:
        count = 0

        def trace(frame, event, arg):
            nonlocal count
            if event == "line":
                count += 1
            return trace

        a, b = text(n, True), text(n, False) + " Extra"
        sys.settrace(trace)
        try:
            guards.mismatch(a, b)
        finally:
            sys.settrace(None)
        return count

    small, large = lines(300), lines(600)
    assert large < 2.6 * small, (small, large)


def _value(text="hi"):
    return CachedResponse(text, "stop", 3, 1, "m")


def test_exact_cache_ttl_lru_and_tenant_invalidation():
    now = [0.0]
    cache = ExactCache(CacheConfig(max_entries=2, ttl_s=10), clock=lambda: now[0])
    cache.put("k1", "t1", _value("a"))
    cache.put("k2", "t2", _value("b"))
    assert cache.get("k1").text == "a"
    cache.put("k3", "t1", _value("c"))  # evicts k2, the least recently used
    assert cache.get("k2") is None and cache.get("k3").text == "c"
    now[0] = 11.0
    assert cache.get("k1") is None  # expired
    cache.put("k4", "t1", _value())
    cache.put("k5", "t2", _value())
    assert len(cache.invalidate("t1")) == 1 and cache.get("k5") is not None


def test_cache_key_scopes_tenant_context_and_sampling():
    base = dict(tenant="t", model="chat:m", messages=[{"role": "user", "content": "Hi  there"}], sampling={"max_tokens": 5})
    key = exact_key(**base)
    assert key == exact_key(**{**base, "messages": [{"role": "user", "content": " Hi  there\n"}]})  # ends only
    # Whitespace inside is the text: code that differs only in its indentation is other code.
    assert key != exact_key(**{**base, "messages": [{"role": "user", "content": "Hi there"}]})
    code = lambda indent: [{"role": "user", "content": f"def f():\n{indent}return 1"}]  # noqa: E731
    assert exact_key(**{**base, "messages": code("    ")}) != exact_key(**{**base, "messages": code("  ")})
    assert key != exact_key(**{**base, "tenant": "u"})
    assert key != exact_key(**{**base, "sampling": {"max_tokens": 6}})
    with_history = [{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Ok"}] + base["messages"]
    assert key != exact_key(**{**base, "messages": with_history})
    assert key != exact_key(**{**base, "messages": [{"role": "system", "content": "x"}] + base["messages"]})


def test_cache_key_covers_tool_calls_ids_and_names():
    """Two agent conversations that differ only in a tool call's arguments, its id, the result's
    call id or a sender's name are other conversations: never one cached answer for both."""
    def convo(arguments='{"city": "Paris"}', call_id="call_1", answers="call_1", name=None):
        user = {"role": "user", "content": "Weather?", **({"name": name} if name else {})}
        return [user,
                {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "name": "w", "arguments": arguments}]},
                {"role": "tool", "content": "sunny", "tool_call_id": answers},
                {"role": "user", "content": "And so?"}]
    key = lambda messages: exact_key(tenant="t", model="chat:m", messages=messages, sampling={})  # noqa: E731
    base = key(convo())
    assert base == key(convo())
    assert base != key(convo(arguments='{"city": "Rome"}'))
    assert base != key(convo(call_id="call_2"))
    assert base != key(convo(answers="call_9"))
    assert base != key(convo(name="alice"))


@pytest.mark.skipif(not hasattr(__import__("os"), "SCHED_IDLE"), reason="Linux scheduling classes")
def test_bulk_embeddings_run_below_the_models_and_give_the_same_vectors(embedder):
    """/v1/embeddings' thread (the sibling) is SCHED_IDLE, so a bulk job takes only the cycles
    the models leave; the thread that embeds a request's text for the cache is not."""
    import os

    import numpy as np

    bulk = embedder.sibling()
    assert bulk._executor.submit(os.sched_getscheduler, 0).result() == os.SCHED_IDLE
    assert embedder._executor.submit(os.sched_getscheduler, 0).result() != os.SCHED_IDLE
    texts = ["How do I sort a list in Python?", "ok"]
    assert np.allclose(bulk.embed_many(texts), embedder.embed_many(texts), atol=1e-6)
