"""The shipped defaults as a client that configured nothing meets them: no headers, three and
then eight requests at once, on an idle service: all answered, none refused for a first-token
target it never asked for. A request that comes while the service warms up waits for it, or is
told just that. And the shipped two ingress replicas on one direct port: losing one under load
refuses no connection."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import httpx
import pytest

from bench.local import kill_replica, replicas, wait_replaced
from tests.test_auth import TARGET, _pipeline
from tests.test_faults import NO_CACHE


@dataclass(frozen=True)
class Shipped:
    direct: str  # its own direct listener, as `serve run` opens one
    proxy: str  # Ray Serve's proxy, at the app's route prefix


@pytest.fixture(scope="module")
def shipped(service):
    """serve_config.yaml's args and logging untouched (the shared test service tightens
    admission, runs one ingress and logs at WARNING), as a second app on the same Serve, with a
    direct port of its own."""
    from bench.local import another_app, free_port

    args = service.config.args.model_copy(deep=True)
    args.ingress.direct_port = free_port()
    with another_app(service.config, args, "shipped", service.proxy_url, logging_config=service.config.logging_config) as base:
        yield Shipped(base, f"{service.proxy_url}/shipped")


def test_three_then_eight_concurrent_requests_without_headers_are_all_answered(shipped):
    from openai import AsyncOpenAI

    async def burst(n: int) -> list:
        client = AsyncOpenAI(base_url=shipped.proxy + "/v1", api_key="sk-no-config", max_retries=0, timeout=300)
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


def test_a_ready_ingress_says_where_it_answers_where_serve_run_prints(shipped):
    """`serve run` prints Serve's replica log lines; the README tells a user to wait for this one."""
    import glob

    import ray

    logs = ray._private.worker._global_node.get_logs_dir_path()
    said = "".join(open(f).read() for f in glob.glob(f"{logs}/serve/replica_shipped_Ingress_*.log"))
    assert f"ready: the OpenAI API answers on {shipped.direct}" in said


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


def test_an_ingress_replica_lost_under_load_never_refuses_a_connection(shipped):
    """The shipped config runs two ingress replicas on one direct port: when one dies, the
    other takes every new connection. Only requests in flight on the lost replica may fail
    (two clients: two at most); no client is ever refused a connection."""
    base = shipped.direct
    ingress = replicas("shipped", "Ingress")
    assert len(ingress) == 2, ingress
    stop = threading.Event()
    outcomes: list[str] = []

    def client(k: int) -> None:
        with httpx.Client(base_url=base, timeout=120) as http:
            i = 0
            while not stop.is_set():
                body = {"model": TARGET, "max_tokens": 2, "temperature": 0,
                        "messages": [{"role": "user", "content": f"Say {k}-{i}."}]}
                try:
                    resp = http.post("/v1/chat/completions", json=body, headers=NO_CACHE)
                    outcomes.append(str(resp.status_code))
                except httpx.HTTPError as exc:
                    outcomes.append(type(exc).__name__)
                    time.sleep(0.1)
                i += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(2.0)
        kill_replica(ingress[0])
        time.sleep(8.0)  # the survivor carries the door meanwhile
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=180)
    refused = outcomes.count("ConnectError")
    broken = [o for o in outcomes if not o.isdigit() and o != "ConnectError"]
    assert refused == 0, f"{refused} connections refused: {outcomes}"
    assert len(broken) <= 2, outcomes
    assert outcomes.count("200") > 4, outcomes
    assert wait_replaced("shipped", "Ingress", ingress[0])
