"""The ingress without Ray: request context, readiness, the lookup overlap, near-miss hints,
cache keys under the server's budget, a refused model call."""

from __future__ import annotations

import asyncio

import pytest

from ingress.context import context_from_headers
from ingress.errors import APIError
from semantic_cache.exact import CachedResponse
from telemetry.clock import StageClock


@pytest.fixture(scope="module")
def serve_file(exact_serve_file):
    """The `transformers` target (float32, drafted by llama.cpp): configs/cpu-exact.yaml."""
    return exact_serve_file


def test_context_from_headers():
    ctx = context_from_headers({"authorization": "Bearer sk-secret", "x-request-deadline-ms": "1500"})
    assert ctx.tenant.startswith("key-") and "sk-secret" not in ctx.tenant
    assert 1.0 < ctx.remaining_s(100) <= 1.5
    assert context_from_headers({"x-tenant": "acme", "authorization": "Bearer k"}).tenant.endswith("/acme")
    assert context_from_headers({"x-tenant": "acme"}).tenant == "anonymous/acme"
    assert context_from_headers({}).tenant == "anonymous"
    ctx = context_from_headers({"cache-control": "no-cache", "x-slo-tier": "batch"})
    assert ctx.no_cache and not ctx.no_store and ctx.tier == "batch"
    for bad in ({"x-request-deadline-ms": "-1"}, {"x-request-deadline-ms": "abc"}, {"x-tenant": "a b"}):
        with pytest.raises(APIError):
            context_from_headers(bad)


def test_health_says_warming_until_every_stage_answers(serve_file):
    from starlette.testclient import TestClient

    from ingress.api import build_api
    from ingress.pipeline import Pipeline

    pipeline = Pipeline(serve_file.args, backends=None, prompts={})
    client = TestClient(build_api(pipeline))
    pipeline.readiness.set(False)
    warming = client.get("/health")
    assert warming.status_code == 503 and warming.json()["status"] == "warming"
    pipeline.readiness.set(True)
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/nope").json()["error"]["code"] == "not_found"


def test_idle_overlap_starts_the_model_beside_the_lookup_only_while_nothing_runs(serve_file):
    from ingress.pipeline import Pipeline

    args = serve_file.args.model_copy(deep=True)
    target = args.target.engine.model_id
    for mode, idle_answer in ((False, False), (True, True), ("idle", True)):
        args.ingress.overlap_cache_lookup = mode
        pipeline = Pipeline(args, backends=None, prompts={})
        assert pipeline.placement.overlap_lookup() is idle_answer, mode
        pipeline.gate.synced_others = {"other": {target: 1}}  # another ingress's request, as last synced
        assert pipeline.placement.overlap_lookup() is (mode is True), mode
        pipeline.gate.synced_others = {}
        pipeline.placement.load.started(target)  # this ingress's own, before the gate's sync saw it
        assert pipeline.placement.overlap_lookup() is (mode is True), mode


def test_near_miss_hints_go_only_to_models_that_draft_from_them(serve_file):
    from ingress.pipeline import Pipeline
    from semantic_cache.cache import Lookup
    from semantic_cache.exact import CachedResponse

    args = serve_file.args.model_copy(deep=True)
    target, small = args.target.engine.model_id, args.draft.engine.model_id
    pipeline = Pipeline(args, backends=None, prompts={})
    assert pipeline.cache.hint_models == {target}  # the small model does not speculate

    class Tokenizer:
        def encode(self, text, add_special_tokens):
            return [len(word) for word in text.split()]

    class Builder:
        tokenizer = Tokenizer()

    hint = Lookup("hint", CachedResponse("fifteen percent is 45", "stop", 5, 4, target), 0.8)
    body = {"model": target, "messages": [{"role": "user", "content": "What is 15% of 300?"}], "temperature": 0}
    p = pipeline.preparer.prepare("chat", body, context_from_headers({}))
    state = pipeline.cache.state(p, StageClock())
    assert state.result == "miss"  # it looks up
    assert pipeline.cache.hint_ids(state, small, Builder(), hint) is None and state.result == "miss"
    assert pipeline.cache.hint_ids(state, target, Builder(), hint) == [7, 7, 2, 2] and state.result == "hint"
    verify = Lookup("hint", hint.response, 0.93, "verify")  # semantic.mode verify: a match checked as a draft
    assert pipeline.cache.hint_ids(state, target, Builder(), verify) and state.result == "verified"
    assert state.match["x-cache-match"] == "verify;score=0.930" and state.verifying is verify


def test_vllm_models_verify_hints_of_greedy_requests_sent_before_they_start():
    """vLLM verifies a match in one prefill before generating: a greedy request's hint goes with
    its call; a sampled request's, or one that comes after the call started, is not sent (and
    the request is not labelled as verified)."""
    from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config
    from ingress.pipeline import Pipeline
    from semantic_cache.cache import Lookup
    from semantic_cache.exact import CachedResponse

    args = load_serve_config(CPU_EXACT_CONFIG.with_name("cpu-vllm.yaml")).args
    target = args.target.engine.model_id
    pipeline = Pipeline(args, backends=None, prompts={})
    assert target in pipeline.cache.hint_models

    class Builder:
        class tokenizer:
            @staticmethod
            def encode(text, add_special_tokens):
                return [len(word) for word in text.split()]

    match = Lookup("hint", CachedResponse("forty five", "stop", 5, 2, target), 0.93, "verify")
    body = {"model": target, "messages": [{"role": "user", "content": "What is 15% of 300?"}], "temperature": 0}
    p = pipeline.preparer.prepare("chat", body, context_from_headers({}))
    for greedy, late in ((False, False), (True, True)):
        state = pipeline.cache.state(p, StageClock())
        assert pipeline.cache.hint_ids(state, target, Builder(), match, greedy, late) is None and state.result == "miss"
    state = pipeline.cache.state(p, StageClock())
    assert pipeline.cache.hint_ids(state, target, Builder(), match, True, False) == [5, 4]
    assert state.result == "verified" and state.verifying is match
    args.target.engine.vllm.verify_hints = False
    assert target not in Pipeline(args, backends=None, prompts={}).cache.hint_models


def test_cache_key_follows_the_server_default_budget(serve_file):
    """The key is made before tokenizing, from the requested max_tokens; a request that leaves it
    to the server must not reuse answers made under another default budget."""
    from ingress.pipeline import Pipeline

    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    short = serve_file.args.model_copy(deep=True)
    short.ingress.sampling.default_max_tokens = 16

    def key(args, **extra):
        return Pipeline(args, backends=None, prompts={}).preparer.prepare("chat", {**body, **extra}, context_from_headers({})).cache_key

    assert key(serve_file.args) != key(short)
    assert key(serve_file.args, max_tokens=8) == key(short, max_tokens=8)


def test_a_model_call_refused_at_a_full_serve_queue_is_a_503_with_retry_after_not_a_500():
    """Ray Serve refuses a call past the model's max_queued_requests with BackPressureError, and
    Ray's cancel() raises it again. Under FIFO at 4x capacity that escaped a cleanup path as a
    500 or cut the stream (bench load: 19 internal errors, 3 requests without an answer). The
    handle adapter (deployments/ingress.py) turns the refusal into a 503 and never raises on
    cancel; the pipeline passes the 503 on."""
    from types import SimpleNamespace

    from ray.serve.exceptions import BackPressureError

    from deployments.ingress import ServeModelStream
    from ingress.model_calls import Call, ModelCalls

    class Refused:
        cancelled = 0

        async def __anext__(self):
            raise BackPressureError(num_queued_requests=64, max_queued_requests=64)

        def cancel(self):
            Refused.cancelled += 1
            raise BackPressureError(num_queued_requests=64, max_queued_requests=64)

    args = SimpleNamespace(ingress=SimpleNamespace(request_timeout_s=5.0, log_prompts=False))
    calls = ModelCalls(args, backends=None, load=None, metrics=None)  # type: ignore[arg-type]
    p = SimpleNamespace(ctx=SimpleNamespace(remaining_s=lambda cap: cap), model="smollm2-135m-instruct")
    with pytest.raises(APIError) as err:
        asyncio.run(calls.next(Call(p.model, None, None, ServeModelStream(Refused(), p.model)), p))  # type: ignore[arg-type]
    assert err.value.status == 503 and err.value.code == "model_queue_full"
    assert err.value.headers["Retry-After"] == "1" and err.value.extra["model"] == p.model
    assert Refused.cancelled == 1
    ServeModelStream(Refused(), p.model).cancel()  # a cleanup path: never raises


def test_a_prefill_that_waited_for_another_engines_pass_counts_the_wait_as_queueing():
    """Admission learns a prompt token's cost from the prefill's compute alone: the time it
    waited for another engine's pass on the shared cores is queueing."""
    from engines.types import GenerateChunk
    from ingress.model_calls import Call, ModelCalls

    call = Call("m", None, None)
    ModelCalls.first(None, call, GenerateChunk("a", 1, timings_ms={"engine_queue": 5.0, "prefill": 100.0,
                                                                    "prefill.cores_wait": 40.0}))
    assert call.prefill_ms == 60.0 and call.engine_queue_ms == 45.0
    alone = Call("m", None, None)
    ModelCalls.first(None, alone, GenerateChunk("a", 1, timings_ms={"engine_queue": 5.0, "prefill": 100.0}))
    assert alone.prefill_ms == 100.0 and alone.engine_queue_ms == 5.0


def test_a_refusal_for_the_tenants_own_limit_is_held_and_a_load_shed_is_not():
    """ingress/pacing.py: a 503 for the tenant's share of the queue (as a 429 over its rate) goes
    out after the hold, its Retry-After shortened by it; a shed for the service's load at once."""
    import time

    from admission.errors import AdmissionError
    from ingress.pacing import paced

    async def timed(err: AdmissionError, hold_s: float) -> tuple[AdmissionError, float]:
        start = time.monotonic()
        out = await paced(err, hold_s)
        return out, time.monotonic() - start

    own = AdmissionError("shed", "share full", "queue_full", retry_after_s=3, details={"tier": "standard"},
                         tenant_limit=True)
    held, took = asyncio.run(timed(own, 0.2))
    assert 0.18 <= took < 1.0 and held.retry_after_s == 3 and held.code == "queue_full" and held.tenant_limit
    rate = AdmissionError("over_rate", "over", "rate_limit_requests", retry_after_s=1, details={"retry_after_s": 1},
                          tenant_limit=True)
    held, took = asyncio.run(timed(rate, 5.0))
    assert 0.9 <= took < 2.0, "held no longer than its Retry-After"
    assert held.retry_after_s == 0 and held.details["retry_after_s"] == 0
    load = AdmissionError("shed", "at capacity", "queue_full", retry_after_s=2)
    same, took = asyncio.run(timed(load, 5.0))
    assert same is load and took < 0.5, "not held"
