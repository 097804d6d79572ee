"""Suite `stack`: the engine called directly vs the whole graph, in one run, plus hop costs.
Speculation is off on both sides here: this suite measures the framework, not decoding.

Both sides decode the same prompts greedily with the same engine config. The engine side runs
in this process (no Ray, no HTTP); the stack side goes through serve_config.yaml's graph,
streamed over loopback with a lean httpx client, so TTFT and ITL are measured at the client.
Every prompt carries its own number, so the cache lookup runs and misses.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from bench.stats import summary
from telemetry.clock import server_timing
from configs.serve_config import load_serve_config

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.",
    "What are the health benefits of green tea?",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet briefly.",
    "Why is the sky blue?",
]
CONTEXT = (
    "You are a support assistant for a cloud storage product. Answer briefly and precisely. "
    "Customers may ask about billing, storage limits, sharing links, and account security. "
) * 3


def prompts(n: int, first: int = 0) -> list[list[dict[str, str]]]:
    """n different prompts, each with its own number (`first`..): the semantic cache's number
    guard never matches two of them, so through the stack every one is a miss."""
    out = []
    for i in range(n):
        q = f"{QUESTIONS[i % len(QUESTIONS)]} Answer for case {first + i}."
        if i % 2:  # half with a longer system prompt: a realistic TTFT spread
            out.append([{"role": "system", "content": CONTEXT}, {"role": "user", "content": q}])
        else:
            out.append([{"role": "user", "content": q}])
    return out


@dataclass
class TimedAnswer:
    ttft_ms: float
    engine_queue_ms: float
    chunk_gaps_ms: list[float]  # between chunks after the first (a speculative chunk holds several tokens)
    tokens: int

    @property
    def ms_per_token(self) -> float:
        """Decode time per token after the first."""
        return sum(self.chunk_gaps_ms) / max(1, self.tokens - 1)


async def timed_answer(service, builder, request_id: str, text: str, max_tokens: int) -> TimedAnswer:
    """One greedy chat request straight to a `ModelService` in this process, timed."""
    from engines.types import GenerateRequest, SamplingParams
    from ingress.protocol import ChatMessage

    ids = builder.chat([ChatMessage(role="user", content=text)])
    request = GenerateRequest(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    start, times, tokens, queue_ms = time.perf_counter(), [], 0, None
    async for chunk in service.generate(request):
        if queue_ms is None:
            queue_ms = chunk.timings_ms.get("engine_queue", 0.0)
        if chunk.num_tokens:
            times.append(time.perf_counter())
            tokens += chunk.num_tokens
    gaps = [(b - a) * 1000 for a, b in zip(times, times[1:])]
    return TimedAnswer((times[0] - start) * 1000, queue_ms or 0.0, gaps, tokens)


class DirectEngine:
    """The engine called in this process (no Ray, no HTTP), one request at a time."""

    def __init__(self, stage_config) -> None:
        from target.service import ModelService
        from ingress.prompts import PromptBuilder

        self.service = ModelService(stage_config)
        self.builder = PromptBuilder(self.service.engine.tokenizer)
        self.loop = asyncio.new_event_loop()
        self.served = 0

    def sample(self, conv, max_tokens: int) -> tuple[float, list[float]]:
        """(TTFT ms, ITL ms) of one greedy request."""
        from engines.types import GenerateRequest, SamplingParams
        from ingress.protocol import ChatMessage

        ids = self.builder.chat([ChatMessage(**m) for m in conv])
        self.served += 1
        request = GenerateRequest(f"direct-{self.served}", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))

        async def run() -> list[float]:
            times = []
            async for chunk in self.service.generate(request):
                if chunk.num_tokens:
                    times.append(time.perf_counter())
            return times

        start = time.perf_counter()
        times = self.loop.run_until_complete(run())
        return (times[0] - start) * 1000, [(b - a) * 1000 for a, b in zip(times, times[1:])]

    def close(self) -> None:
        self.service.executor.shutdown(wait=True)
        self.loop.close()


def engine_direct_samples(stage_config, conversations, max_tokens: int) -> tuple[list[float], list[float]]:
    """(TTFT ms, ITL ms) of the engine called in this process: no Ray, no HTTP."""
    engine = DirectEngine(stage_config)
    ttft, itl = [], []
    for conv in tqdm(conversations, desc="engine direct", unit="req"):
        first, gaps = engine.sample(conv, max_tokens)
        ttft.append(first)
        itl.extend(gaps)
    engine.close()
    return ttft, itl


def stack_samples(
    base_url: str, model: str, convs, max_tokens: int, headers: dict | None = None, progress: bool = True
) -> dict:
    """Through the whole graph, one request at a time, streamed over loopback with a lean HTTP
    client (the openai SDK's own parsing would be charged to the stack): TTFT and ITL at the
    client, Server-Timing entries, x-cache outcomes and prompt tokens."""
    ttft: list[float] = []
    itl: list[float] = []
    stages: dict[str, list[float]] = {}
    outcomes: dict[str, int] = {}
    prompt_tokens: list[int] = []
    with httpx.Client(base_url=base_url, timeout=120) as http:
        for conv in tqdm(convs, desc="through the stack" + (" (no-cache)" if headers else ""), unit="req",
                         disable=not progress):
            body = {"model": model, "messages": conv, "temperature": 0, "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            start = time.perf_counter()
            times = []
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        delta = event["choices"]
                        if delta and delta[0]["delta"].get("content"):
                            times.append(time.perf_counter())
                        if event.get("usage"):
                            prompt_tokens.append(event["usage"]["prompt_tokens"])
            for name, dur in server_timing(resp.headers.get("server-timing", "")).items():
                stages.setdefault(name, []).append(dur)
            outcomes[resp.headers.get("x-cache", "?")] = outcomes.get(resp.headers.get("x-cache", "?"), 0) + 1
            ttft.append((times[0] - start) * 1000)
            itl.extend((b - a) * 1000 for a, b in zip(times, times[1:]))
    return {"ttft": ttft, "itl": itl, "stages": stages, "outcomes": outcomes, "prompt_tokens": prompt_tokens}


def _engine_direct(stage_config, conversations, max_tokens: int) -> dict:
    ttft, itl = engine_direct_samples(stage_config, conversations, max_tokens)
    return {"ttft_ms": summary(ttft), "itl_ms": summary(itl)}


def _through_stack(base_url: str, model: str, conversations, max_tokens: int) -> dict:
    samples = stack_samples(base_url, model, conversations, max_tokens)
    return {
        "ttft_ms": summary(samples["ttft"]),
        "itl_ms": summary(samples["itl"]),
        "server_timing_ms": {k: summary(v) for k, v in samples["stages"].items()},
        "cache_outcomes": samples["outcomes"],
    }


def run(requests: int = 16, max_tokens: int = 32, hop_requests: int = 300, quick: bool = False) -> dict:
    from bench.hops import measure_hops
    from bench.local import running_service

    if quick:  # a smoke run: fewer requests and hop samples
        requests, hop_requests = min(requests, 4), min(hop_requests, 60)

    serve_file = load_serve_config()
    # This suite isolates framework cost: plain decoding on both sides (speculation streams
    # tokens in bursts, which would blur per-token latency; the `spec` suite measures it).
    serve_file.args.target.speculative.method = "none"
    target = serve_file.args.target.engine
    conversations = prompts(requests)
    # Warm-up conversation first on both sides, then the measured ones.
    direct = _engine_direct(serve_file.args.target, conversations, max_tokens)
    with running_service(serve_file) as base:
        _through_stack(base, target.model_id, prompts(2, first=10_000), 4)  # warm the path
        stack = _through_stack(base, target.model_id, conversations, max_tokens)
        hops = measure_hops(hop_requests)
    overhead = {
        "ttft_ms_p50": round(stack["ttft_ms"]["p50"] - direct["ttft_ms"]["p50"], 2),
        "ttft_ratio_p50": round(stack["ttft_ms"]["p50"] / direct["ttft_ms"]["p50"], 3),
        "itl_ms_p50": round(stack["itl_ms"]["p50"] - direct["itl_ms"]["p50"], 2),
        "itl_ratio_p50": round(stack["itl_ms"]["p50"] / direct["itl_ms"]["p50"], 3),
    }
    return {
        "config": {"requests": requests, "max_tokens": max_tokens, "model": target.model_id, "dtype": target.dtype},
        "engine_direct": direct,
        "stack": stack,
        "overhead": overhead,
        "hops": hops,
    }
