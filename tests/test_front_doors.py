"""The API answers on both front doors: the ingress replica's own listener (ingress.direct_port,
no proxy hop) and Ray Serve's proxy (http_options.port). The rest of the suite runs on the
direct one; this file holds the proxy to the same behaviour."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

TARGET = "smollm2-135m-instruct"
NO_CACHE = {"Cache-Control": "no-cache, no-store"}


@pytest.fixture(scope="module", params=["direct", "proxy"])
def door(request, service) -> str:
    if request.param == "direct":
        assert service.base_url != service.proxy_url, "serve_config.yaml turns the direct listener on"
        return service.base_url
    return service.proxy_url


def test_both_doors_serve_models_health_and_chat(door):
    client = OpenAI(base_url=door + "/v1", api_key="sk-test", max_retries=0)
    assert {m.id for m in client.models.list()} >= {TARGET, "auto"}
    assert httpx.get(door + "/health", timeout=30).json()["status"] == "ok"
    raw = client.chat.completions.with_raw_response.create(
        model=TARGET, messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0, max_tokens=12, extra_headers=NO_CACHE,
    )
    resp = raw.parse()
    assert resp.choices[0].message.content and resp.usage.completion_tokens > 0
    assert "total;dur=" in raw.headers["server-timing"]


def test_both_doors_stream_and_reject_bad_input_with_openai_errors(door):
    client = OpenAI(base_url=door + "/v1", api_key="sk-test", max_retries=0)
    stream = client.chat.completions.create(
        model=TARGET, messages=[{"role": "user", "content": "Name a color."}], temperature=0,
        max_tokens=8, stream=True, stream_options={"include_usage": True}, extra_headers=NO_CACHE,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    bad = httpx.post(door + "/v1/chat/completions", content=b"{not json", timeout=30,
                     headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["message"]
