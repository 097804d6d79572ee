"""A client that configured nothing, against the shipped defaults: no headers, three and then
eight requests at once, on an idle service: all answered, none refused for a first-token target it never asked
for. And a request that comes while the service warms up waits for it, or is told just that."""

from __future__ import annotations

import asyncio
import httpx
import pytest

from tests.test_auth import TARGET, _pipeline


@pytest.fixture(scope="module")
def shipped(service):
    """serve_config.yaml's args untouched (the shared test service tightens admission), as a
    second app on the same Serve, reached through the proxy at its own route prefix."""
    from bench.local import another_app

    args = service.config.args.model_copy(deep=True)
    args.ingress.direct_port = None
    with another_app(service.config, args, "shipped", service.proxy_url) as base:
        yield base


def test_three_then_eight_concurrent_requests_without_headers_are_all_answered(shipped):
    from openai import AsyncOpenAI

    async def burst(n: int) -> list:
        client = AsyncOpenAI(base_url=shipped + "/v1", api_key="sk-no-config", max_retries=0, timeout=300)
        questions = [f"In one short sentence, what is {i} + {i}?" for i in range(n)]
        try:
            return await asyncio.gather(*(
                client.chat.completions.create(model="auto", messages=[{"role": "user", "content": q}], max_tokens=24)
                for q in questions
            ), return_exceptions=True)
        finally:
            await client.close()

    for n in (3, 8):
        answers = asyncio.run(burst(n))
        failed = [f"{a!r} {getattr(a, 'body', '')}"[:600] for a in answers if isinstance(a, BaseException)]
        assert not failed, f"{len(failed)} of {n} concurrent requests failed: {failed}"
        assert all(a.choices[0].message.content for a in answers)


def test_a_request_during_warm_up_waits_for_it_or_is_told_so(serve_file, tokenizer):
    from ingress.api import build_api

    pipeline = _pipeline(serve_file, tokenizer)
    pipeline.args.ingress.warmup_wait_s = 0.3
    body = {"model": TARGET, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(pipeline)), base_url="http://app") as http:
            pipeline.readiness.set(False)
            told = await http.post("/v1/chat/completions", json=body)
            assert told.status_code == 503 and told.json()["error"]["code"] == "warming_up", told.text
            assert told.headers["retry-after"]
            assert (await http.get("/health")).json()["status"] == "warming"
            listed = await http.get("/v1/models")  # a readiness poll is not told "ready" early
            assert listed.status_code == 503 and listed.json()["error"]["code"] == "warming_up", listed.text

            async def warm_soon():
                await asyncio.sleep(0.1)
                pipeline.readiness.set(True)

            warming = asyncio.ensure_future(warm_soon())
            waited = await http.post("/v1/chat/completions", json=body)
            await warming
            assert waited.status_code == 200, waited.text
            pipeline.readiness.set(False)
            warming = asyncio.ensure_future(warm_soon())
            listed = await http.get("/v1/models")
            await warming
            assert listed.status_code == 200 and listed.json()["data"], listed.text

    asyncio.run(scenario())
