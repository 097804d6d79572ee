"""Suite `sweep`: a client that configured nothing, at 1 to 16 concurrent streams.

The shipped config, untouched; closed-loop clients with no headers at all (no tier, no
deadline, no key), each sending short streamed chats (`model: auto`, 32 tokens) one after
another for a fixed time per level: 1, 2, 3, 4, 6, 8, 12 and 16 clients, on one service.
A well-behaved server answers them all; one that sheds must say why, truthfully.

Per level: requests sent, answered, refused by status and code, TTFT p50/p95/p99 of the
answered, end-to-end p50, tokens/s, and for each refusal its reason and admission's
prediction (`predicted.ttft_ms`), beside the measured TTFT of the answered requests at the
same level: a shed whose predicted TTFT the answered ones beat is a false promise.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench.stats import summary

LEVELS = (1, 2, 3, 4, 6, 8, 12, 16)
QUESTIONS = [
    "What is the capital of France?", "Give me a synonym for happy.", "How many legs does a spider have?",
    "Name a primary color.", "What is 12 times 12?", "Translate 'thank you' into Spanish.",
    "What is the boiling point of water in Celsius?", "Name one planet of the solar system.",
]


async def _one(http: httpx.AsyncClient, n: int, max_tokens: int) -> dict:
    """One streamed chat, no headers: (status, code, ttft_ms, e2e_ms, tokens, prediction)."""
    # Numbered, so every request is new to the cache: the sweep measures serving, not hits.
    body = {"model": "auto", "messages": [{"role": "user", "content": f"{QUESTIONS[n % len(QUESTIONS)]} (#{n})"}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    out = {"status": 0, "code": None, "ttft_ms": None, "e2e_ms": None, "tokens": 0, "predicted_ttft_ms": None}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            out["status"] = resp.status_code
            if resp.status_code != 200:
                error = json.loads(await resp.aread()).get("error", {})
                out["code"] = error.get("code")
                out["predicted_ttft_ms"] = (error.get("predicted") or {}).get("ttft_ms")
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:  # the stream was cut with an error event
                    out["status"], out["code"] = 503, event["error"].get("code")
                    break
                choices = event.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content") and out["ttft_ms"] is None:
                    out["ttft_ms"] = (time.perf_counter() - start) * 1000
                if event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        out["code"] = type(exc).__name__
    out["e2e_ms"] = (time.perf_counter() - start) * 1000
    return out


async def _level(base: str, clients: int, seconds: float, max_tokens: int, counter: list[int]) -> list[dict]:
    results: list[dict] = []
    stop_at = time.monotonic() + seconds

    async def client(http: httpx.AsyncClient) -> None:
        while time.monotonic() < stop_at:
            counter[0] += 1
            result = await _one(http, counter[0], max_tokens)
            results.append(result)
            if result["status"] != 200:  # a refused client waits as an SDK would (Retry-After: 1)
                await asyncio.sleep(1.0)

    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return results


def _report(clients: int, results: list[dict], seconds: float) -> dict:
    answered = [r for r in results if r["status"] == 200 and r["ttft_ms"] is not None]
    refused: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            key = f"{r['status']} {r['code']}"
            refused[key] = refused.get(key, 0) + 1
    predictions = [r["predicted_ttft_ms"] for r in results if r["predicted_ttft_ms"] is not None]
    return {
        "clients": clients,
        "sent": len(results),
        "answered": len(answered),
        "refused": refused,
        "ttft_ms": summary([r["ttft_ms"] for r in answered]),
        "e2e_ms": summary([r["e2e_ms"] for r in answered]),
        "tokens_per_s": round(sum(r["tokens"] for r in answered) / seconds, 1),
        "refused_predicted_ttft_ms": summary(predictions) if predictions else None,
    }


def run(quick: bool = False, max_tokens: int = 32, **_: object) -> dict:
    from configs.serve_config import load_serve_config
    from bench.local import running_service

    seconds = 10.0 if quick else 20.0
    serve_file = load_serve_config()
    levels = []
    counter = [0]
    with running_service(serve_file) as base:
        for clients in LEVELS:
            results = asyncio.run(_level(base, clients, seconds, max_tokens, counter))
            levels.append(_report(clients, results, seconds))
            print(json.dumps(levels[-1]), flush=True)
            time.sleep(2.0)  # the last level's requests drain before the next begins
    refused_at_1_to_4 = sum(sum(l["refused"].values()) for l in levels if l["clients"] <= 4)
    return {
        "config": {"levels": list(LEVELS), "seconds_per_level": seconds, "max_tokens": max_tokens,
                   "headers": "none", "model": "auto", "profile": "serve_config.yaml"},
        "refused_at_1_to_4_clients": refused_at_1_to_4,
        "levels": levels,
    }
