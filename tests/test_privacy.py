"""Secrets and user data stay out of logs, health output and other tenants' answers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path

from starlette.requests import Request

from ingress.errors import describe

CANARY_KEY = "sk-canary-5f1d2e9a7b"
CANARY_PROMPT = "my secret diagnosis is zebrafish-7731"
TARGET = "smollm2-135m-instruct"


def test_error_descriptions_leave_the_message_out_unless_asked():
    try:
        raise ValueError(f"input was {CANARY_PROMPT}")
    except ValueError as exc:
        short, full = describe(exc), describe(exc, with_message=True)
    assert short.startswith("ValueError at test_privacy.py:") and CANARY_PROMPT not in short
    assert CANARY_PROMPT in full


def _request(body: dict) -> Request:
    raw = json.dumps(body).encode()
    sent = False

    async def receive():
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    headers = [(b"authorization", f"Bearer {CANARY_KEY}".encode()), (b"content-type", b"application/json")]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": headers}, receive)


class _FailingStream:
    """A model whose failure message quotes the prompt, as a validation error would."""

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise RuntimeError(f"engine choked on {CANARY_PROMPT}")

    def cancel(self) -> None:
        pass


class _FailingBackends:
    async def cache_lookup(self, key, scope, query):
        raise ValueError(f"qdrant rejected {CANARY_PROMPT}")

    def cache_store(self, entry) -> None:
        raise AssertionError("a failed answer is never stored")

    def generate(self, model_id, request):
        return _FailingStream()


def _run_failing_request(serve_file, tokenizer, log_prompts: bool, caplog) -> int:
    from ingress.pipeline import Pipeline
    from ingress.prompts import PromptBuilder

    args = serve_file.args.model_copy(deep=True)
    args.ingress.log_prompts = log_prompts
    args.router.kind = "rules"  # no embedding needed
    args.cache.semantic.enabled = False
    builder = PromptBuilder(tokenizer)
    prompts = {args.target.engine.model_id: builder, args.draft.engine.model_id: builder, "auto": builder}
    pipeline = Pipeline(args, _FailingBackends(), prompts)  # type: ignore[arg-type]
    body = {"model": TARGET, "messages": [{"role": "user", "content": CANARY_PROMPT}], "max_tokens": 4, "temperature": 0}
    caplog.clear()
    with caplog.at_level(logging.DEBUG):
        response = asyncio.run(pipeline.handle(_request(body), "chat"))
    return response.status_code


def test_pipeline_logs_no_prompt_or_key_unless_prompt_logging_is_on(serve_file, tokenizer, caplog):
    status = _run_failing_request(serve_file, tokenizer, False, caplog)
    assert status == 503  # the model failed: a clean error, not a crash
    assert "cache lookup failed" in caplog.text and "model call failed" in caplog.text  # failures are logged
    assert CANARY_PROMPT not in caplog.text and "zebrafish" not in caplog.text
    assert CANARY_KEY not in caplog.text

    _run_failing_request(serve_file, tokenizer, True, caplog)
    assert CANARY_PROMPT in caplog.text, "log_prompts: true logs the request"
    assert CANARY_KEY not in caplog.text, "API keys are never logged, even then"


def test_service_logs_and_health_never_hold_keys_prompts_or_answers(service):
    import ray

    tenants = [service.openai(api_key=CANARY_KEY), service.openai(api_key=CANARY_KEY + "-other")]
    answers = []
    for client in tenants:  # two tenants, the same question
        out = client.chat.completions.with_raw_response.create(
            model=TARGET, messages=[{"role": "user", "content": CANARY_PROMPT}], max_tokens=8, temperature=0
        )
        assert out.headers["x-cache"] == "miss", "the second tenant must not get the first one's cached answer"
        answers.append(out.parse().choices[0].message.content)
    # Bad input and a failing path too: their error messages must not echo secrets into logs.
    bad = service.http.post(
        "/v1/chat/completions",
        headers={"authorization": f"Bearer {CANARY_KEY}"},
        json={"model": TARGET, "messages": [{"role": "user", "content": CANARY_PROMPT}], "n": 17},
    )
    assert bad.status_code == 400

    health = service.http.get("/health").text
    for secret in (CANARY_KEY, CANARY_PROMPT, *(a for a in answers if len(a) > 12)):  # a short answer could be any word
        assert secret not in health

    time.sleep(2.0)  # let the replicas' log writers flush
    logs = Path(ray._private.worker._global_node.get_session_dir_path()) / "logs"
    leaks = []
    for path in logs.rglob("*"):
        if path.is_file() and path.suffix in (".log", ".out", ".err"):
            text = path.read_text(errors="replace")
            leaks += [f"{path.name}: {what}" for what in (CANARY_KEY, "zebrafish-7731") if what in text]
    assert not leaks, leaks
