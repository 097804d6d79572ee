"""API keys and the request path's end, on the real HTTP app (ingress/api.py) and the real
`openai` SDK, over a stand-in model (no Ray): 401s in OpenAI's shape, shared buckets for
unlisted keys, a stream's slot freed at its last token, a stalled reader cut."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from admission.limits import TenantLimiter
from configs.schemas import AdmissionConfig, AuthConfig, TenantLimits
from engines.types import GenerateChunk
from admission.tenant import key_hash, owner_of_hash
from ingress.auth import KeyRing
from ingress.errors import APIError
from semantic_cache.cache import Lookup

TARGET = "smollm2-135m-instruct"


class _Stream:
    """A model that streams a few chunks, each after `gap_s`."""

    def __init__(self, pieces: list[str], gap_s: float = 0.0) -> None:
        self._pieces = list(pieces)
        self._gap_s = gap_s
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerateChunk:
        await asyncio.sleep(self._gap_s)
        piece = self._pieces.pop(0)
        done = not self._pieces
        return GenerateChunk(piece, 1, "stop" if done else None, 5, 3 if done else 0)

    def cancel(self) -> None:
        self.cancelled = True


class _Backends:
    def __init__(self) -> None:
        self.streams: list[_Stream] = []

    async def cache_lookup(self, key, scope, query):
        return Lookup("miss", reason="no_match")

    def cache_store(self, entry) -> None:
        pass

    async def cache_invalidate(self, tenant: str) -> int:
        return 0

    def generate(self, model_id, request):
        self.streams.append(_Stream(["Hello", " there", "."]))
        return self.streams[-1]


def _pipeline(serve_file, tokenizer, **auth):
    from ingress.pipeline import Pipeline
    from ingress.prompts import PromptBuilder

    args = serve_file.args.model_copy(deep=True)
    args.router.kind = "rules"
    args.cache.enabled = False
    args.auth = AuthConfig(**auth)
    builder = PromptBuilder(tokenizer)
    prompts = {args.target.engine.model_id: builder, args.draft.engine.model_id: builder, "auto": builder}
    return Pipeline(args, _Backends(), prompts)  # type: ignore[arg-type]


def _client(pipeline, key: str):
    from openai import AsyncOpenAI

    from ingress.api import build_api

    transport = httpx.ASGITransport(app=build_api(pipeline))
    return AsyncOpenAI(
        base_url="http://app/v1", api_key=key, max_retries=0,
        http_client=httpx.AsyncClient(transport=transport, base_url="http://app"),
    )


def test_a_required_key_is_checked_and_refused_in_openais_shape(serve_file, tokenizer):
    import openai

    pipeline = _pipeline(serve_file, tokenizer, required=True, api_keys=[f"sha256:{key_hash('sk-good')}"])

    async def scenario():
        good = _client(pipeline, "sk-good")
        out = await good.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert out.choices[0].message.content == "Hello there."
        assert [m.id for m in (await good.models.list()).data]
        bad = _client(pipeline, "sk-minted")
        with pytest.raises(openai.AuthenticationError) as err:
            await bad.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "hi"}])
        assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        from ingress.api import build_api

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(pipeline)), base_url="http://app") as raw:
            for path in ("/v1/models", "/v1/chat/completions"):  # no key at all
                resp = await (raw.get(path) if path == "/v1/models" else raw.post(path, json={"model": TARGET}))
                assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
                assert resp.json()["error"]["type"] == "authentication_error"
            assert (await raw.get("/health")).status_code == 200  # a load balancer's probe needs no key

    asyncio.run(scenario())


def test_auth_without_keys_fails_at_start_and_keys_come_from_env_and_file(tmp_path):
    with pytest.raises(ValueError, match="no key is configured"):
        KeyRing(AuthConfig(required=True), environ={})
    keys = tmp_path / "keys"
    keys.write_text(f"# team keys\nsha256:{key_hash('sk-file')}\nsk-file-admin admin\n")
    ring = KeyRing(AuthConfig(required=True, keys_file=str(keys)), environ={"LATENCY_SERVE_API_KEYS": "sk-env, sk-env2"})
    for key, admin in (("sk-file", False), ("sk-file-admin", True), ("sk-env", False), ("sk-env2", False)):
        caller = ring.identify({"authorization": f"Bearer {key}"})
        assert caller.owner == owner_of_hash(key_hash(key)) and caller.owner in ring.owners() and caller.admin is admin
    with pytest.raises(APIError) as err:
        ring.identify({"authorization": "Bearer sk-other"})
    assert err.value.status == 401


def test_unlisted_keys_share_one_bucket_and_buckets_are_kept_lru():
    """Minting keys buys no rate: every key without limits of its own draws from one bucket. A
    full table forgets the idlest tenant only, not everyone's state."""
    config = AdmissionConfig(tenants={"default": TenantLimits(requests_per_s=0.001, request_burst=2),
                                      "key-listed": TenantLimits(requests_per_s=0.001, request_burst=1)})
    now = [0.0]
    limiter = TenantLimiter(config, clock=lambda: now[0], max_tenants=2, own_buckets={"key-listed"})
    limiter.check("key-minted-1", 1)
    limiter.check("key-minted-2", 1)
    with pytest.raises(Exception):
        limiter.check("key-minted-3", 1)  # the shared bucket is empty
    limiter.check("key-listed", 1)  # a listed tenant has its own
    with pytest.raises(Exception):
        limiter.precheck("key-listed")  # over: refused before any tokenizer pass, nothing charged
    lru = TenantLimiter(AdmissionConfig(tenants={"default": TenantLimits(requests_per_s=0.001, request_burst=1)}),
                        clock=lambda: now[0], max_tenants=2)
    lru.check("a", 1)
    lru.check("b", 1)
    with pytest.raises(Exception):
        lru.check("a", 1)  # a is remembered as spent
    lru.check("c", 1)  # the table is full: the idlest (b) goes, a stays
    with pytest.raises(Exception):
        lru.check("a", 1)


def test_a_stream_frees_its_admission_slot_at_the_last_token_not_the_last_read(serve_file, tokenizer):
    """A reader that stops after the model is done (or reads slowly) holds no slot: the gate's
    count drops when the model's last chunk arrives, before the client takes [DONE]."""
    from starlette.requests import Request

    pipeline = _pipeline(serve_file, tokenizer)
    body = b'{"model": "%s", "stream": true, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}' % TARGET.encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def scenario():
        request = Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive)
        response = await pipeline.handle(request, "chat")
        assert response.status_code == 200
        events = response.body_iterator
        seen = [await events.__anext__()]  # the first token, as a client's first read
        assert pipeline.gate.concurrency() == 1
        while b"finish_reason\":\"stop" not in seen[-1] and b'"finish_reason": "stop"' not in seen[-1]:
            seen.append(await events.__anext__())
        assert pipeline.gate.concurrency() == 0, "the slot is free once the model finished"
        rest = [chunk async for chunk in events]
        assert rest and rest[-1].strip().endswith(b"[DONE]")
        text = b"".join(seen)
        assert b"Hello" in text and b" there" in text and b"." in text

    asyncio.run(scenario())


def test_a_reader_that_stops_reading_is_cut_after_the_send_timeout():
    from ingress.direct import CancelOnDisconnect

    finished: list[str] = []

    async def app(scope, receive, send):
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(100):
                await send({"type": "http.response.body", "body": b"x" * 100, "more_body": True})
        finally:
            finished.append("cleaned up")

    async def scenario():
        middleware = CancelOnDisconnect(app, send_timeout_s=0.2)
        stuck = asyncio.Event()
        sent = 0

        async def send(message):
            nonlocal sent
            sent += 1
            if sent > 3:
                await stuck.wait()  # the client's socket buffer is full: the send never completes

        async def receive():
            await asyncio.sleep(3600)

        await asyncio.wait_for(middleware({"type": "http"}, receive, send), 5)
        assert middleware.stalled == 1

    asyncio.run(scenario())
    assert finished == ["cleaned up"]
