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
    alone = _chat(client, short, max_tokens=40).parse()
    natural = alone.usage.completion_tokens  # the model's own end, which differs by engine and precision
    assert natural <= 30 and alone.choices[0].finish_reason == "stop"
    held = _chat(client, short, max_tokens=40, extra_body={"min_tokens": natural + 8}).parse()
    assert held.usage.completion_tokens >= natural + 8
    endless = _chat(client, short, max_tokens=40, extra_body={"ignore_eos": True}).parse()
    assert endless.usage.completion_tokens == 40 and endless.choices[0].finish_reason == "length"


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
    {"functions": [{"name": "f"}]}, {"function_call": "auto"}, {"guided_grammar": "root ::= \"a\""},
    {"response_format": {"type": "xml"}},
])
def test_fields_not_implemented_are_400s_never_ignored(service, extra):
    body = {"model": TARGET, "messages": QUESTION, "max_tokens": 5, **extra}
    resp = httpx.post(service.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "unsupported", resp.text
    assert resp.json()["error"]["param"] in extra, resp.text


def test_logprobs_chat_and_completions_streamed_and_not(service):
    """Each token's log-probability and the 5 likeliest, in OpenAI's chat and completions shapes;
    greedy: the chosen token is the likeliest. Never from the cache (an answer there has none)."""
    client = service.openai(api_key="sk-logprobs")
    raw = _chat(client, headers={}, logprobs=True, top_logprobs=5)
    assert raw.headers["x-cache"] == "bypass"
    done = raw.parse()
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens > 0
    assert "".join(t.token for t in content) == done.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 5 and t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4 and t.bytes == list(t.token.encode())
    assert _chat(client).parse().choices[0].logprobs is None, "not asked: null"
    stream = client.chat.completions.create(model=TARGET, messages=QUESTION, temperature=0, max_tokens=24,
                                            logprobs=True, top_logprobs=2, stream=True)
    streamed = [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    text = client.completions.create(model=TARGET, prompt="The capital of France is", max_tokens=8, temperature=0,
                                     logprobs=3)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    assert "".join(lp.tokens) == text.choices[0].text and all(len(top) == 3 for top in lp.top_logprobs)
    pieces = client.completions.create(model=TARGET, prompt="The capital of France is", max_tokens=8, temperature=0,
                                       logprobs=3, stream=True)
    offsets = [o for c in pieces if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_n_choices_streamed_and_not(service):
    client = service.openai(api_key="sk-choices")
    greedy = _chat(client, headers={}, n=3).parse()
    assert [c.index for c in greedy.choices] == [0, 1, 2]
    assert len({c.message.content for c in greedy.choices}) == 1, "greedy: the same answer three times"
    one = _chat(client).parse()
    assert greedy.choices[0].message.content == one.choices[0].message.content
    assert greedy.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert greedy.usage.prompt_tokens == one.usage.prompt_tokens, "the prompt counted once"
    sampled = _chat(client, n=3, temperature=1.0, seed=7, max_tokens=16).parse()
    assert [c.index for c in sampled.choices] == [0, 1, 2] and len({c.message.content for c in sampled.choices}) > 1
    again = _chat(client, n=3, temperature=1.0, seed=7, max_tokens=16).parse()
    assert [c.message.content for c in again.choices] == [c.message.content for c in sampled.choices], "seeded"
    stream = client.chat.completions.create(model=TARGET, messages=QUESTION, temperature=0, max_tokens=12, n=2,
                                            stream=True, stream_options={"include_usage": True})
    texts, usage = {0: "", 1: ""}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
        usage = chunk.usage or usage
    assert texts[0] == texts[1] and texts[0]
    assert usage.prompt_tokens == one.usage.prompt_tokens and usage.completion_tokens % 2 == 0 < usage.completion_tokens


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
