"""The OpenAI API surface real clients use, on the real service with the `openai` SDK: sampling
controls (penalties, logit_bias, vLLM's top_k / min_p / repetition_penalty / min_tokens /
ignore_eos), their 400s, the cache keeping them apart, and /v1/embeddings on MiniLM."""

from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from tests.test_serving import TARGET

NO_CACHE = {"Cache-Control": "no-cache, no-store"}
QUESTION = [{"role": "user", "content": "List the colors of the rainbow, one per line."}]


def _chat(client, messages=QUESTION, headers=None, **kwargs):
    params = dict(model=TARGET, messages=messages, temperature=0, max_tokens=24)
    params.update(kwargs)
    return client.chat.completions.with_raw_response.create(extra_headers=NO_CACHE if headers is None else headers, **params)


def test_penalties_and_logit_bias_change_the_answer_as_asked(service, tokenizer):
    client = service.openai(api_key="sk-sampling")
    plain = _chat(client).parse().choices[0].message.content
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    biased = _chat(client, logit_bias={str(first): -100}).parse().choices[0].message.content
    assert not biased.startswith(tokenizer.decode([first])), (plain, biased)
    penalized = _chat(client, frequency_penalty=2.0, presence_penalty=2.0).parse().choices[0].message.content
    assert penalized and penalized != plain
    vllm = _chat(client, extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3}).parse()
    assert vllm.choices[0].message.content


def test_min_tokens_and_ignore_eos_hold_the_end_back(service):
    client = service.openai(api_key="sk-sampling")
    short = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    alone = _chat(client, short, max_tokens=30).parse()
    assert alone.usage.completion_tokens < 20 and alone.choices[0].finish_reason == "stop"
    held = _chat(client, short, max_tokens=30, extra_body={"min_tokens": 20}).parse()
    assert held.usage.completion_tokens >= 20
    endless = _chat(client, short, max_tokens=30, extra_body={"ignore_eos": True}).parse()
    assert endless.usage.completion_tokens == 30 and endless.choices[0].finish_reason == "length"


@pytest.mark.parametrize("extra, param", [
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 5}}, "logit_bias"),
    ({"min_tokens": 50, "max_tokens": 10}, "min_tokens"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 5e-324}, "repetition_penalty"),
])
def test_absurd_sampling_values_are_400s_that_name_the_field(service, extra, param):
    body = {"model": TARGET, "messages": QUESTION, "max_tokens": 5, **extra}
    resp = httpx.post(service.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"].startswith(param), resp.text


@pytest.mark.parametrize("extra", [
    {"n": 2}, {"logprobs": True, "top_logprobs": 3}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
    {"tool_choice": "required"}, {"functions": [{"name": "f"}]}, {"function_call": "auto"},
    {"response_format": {"type": "json_object"}}, {"guided_json": {"type": "object"}}, {"guided_choice": ["a", "b"]},
])
def test_fields_not_implemented_are_400s_never_ignored(service, extra):
    body = {"model": TARGET, "messages": QUESTION, "max_tokens": 5, **extra}
    resp = httpx.post(service.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported", resp.text
    assert resp.json()["error"]["param"] in extra, resp.text


def test_the_cache_keeps_penalized_answers_apart(service):
    client = service.openai(api_key="sk-sampling-cache")
    messages = [{"role": "user", "content": "Name three fruits."}]
    assert _chat(client, messages, headers={}).headers["x-cache"] == "miss"
    assert _chat(client, messages, headers={}).headers["x-cache"] == "hit"
    assert _chat(client, messages, headers={}, frequency_penalty=1.0).headers["x-cache"] == "miss"


def test_embeddings_are_minilms_vectors_in_openais_shape(service, embedder):
    client = service.openai(api_key="sk-embed")
    texts = ["How do I sort a list in Python?", "The capital of France is Paris.", "ünïcödé ✓"]
    made = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)  # the SDK asks for base64
    assert [d.index for d in made.data] == [0, 1, 2] and made.model == "all-MiniLM-L6-v2"
    got = np.array([d.embedding for d in made.data], dtype=np.float32)
    want = embedder.embed_many(texts)
    assert got.shape == (3, 384) and np.allclose(got, want, atol=1e-5)
    assert made.usage.prompt_tokens == made.usage.total_tokens > 3
    floats = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts[0], encoding_format="float")
    assert np.allclose(floats.data[0].embedding, want[0], atol=1e-5)


@pytest.mark.parametrize("body, status, code", [
    ({"model": "text-embedding-3-small", "input": "hi"}, 404, "model_not_found"),
    ({"model": "all-MiniLM-L6-v2", "input": [1, 2, 3]}, 400, "unsupported"),
    ({"model": "all-MiniLM-L6-v2", "input": []}, 400, None),
    ({"model": "all-MiniLM-L6-v2", "input": "word " * 400}, 400, "context_length_exceeded"),
    ({"model": "all-MiniLM-L6-v2", "input": "hi", "dimensions": 1536}, 400, "unsupported"),
])
def test_embeddings_refuse_what_minilm_cannot_answer(service, body, status, code):
    resp = httpx.post(service.base_url + "/v1/embeddings", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] in ("model", "input", "dimensions") and (code is None or error["code"] == code), error
    with pytest.raises(openai.NotFoundError):
        service.openai().embeddings.create(model="nope", input="hi")
