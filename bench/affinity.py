"""Suite `affinity`: prefix-aware replica routing vs Ray Serve's default (power of two choices).

Two TargetModel replicas with one torch thread each (two cores), the cache off (every turn
reaches a model), plain decoding (this measures prefill reuse). `conversations` multi-turn RAG
chats, each opening with a document (three documents, so some conversations share one) and a
question of its own, one request at a time (both replicas idle: with a queue on one of them,
the default router's least-loaded pick keeps conversations in place by accident), streamed
over loopback.
For each router: TTFT of the follow-up turns (where the history could be reused), the prompt
tokens the replica reused (Server-Timing `prefix_reused_tokens`), how many conversations moved
between replicas, and each replica's share of requests. Hot-prefix spreading under load is
covered by tests/test_prefix_affinity_units.py.
"""

from __future__ import annotations

import asyncio
import time

import httpx
from tqdm import tqdm

from bench.stack import QUESTIONS
from bench.stats import summary
from telemetry.clock import server_timing_count
from bench.workloads import DOCS
from configs.serve_config import load_serve_config

MAX_TOKENS = 32
FOLLOW_UPS = ["Can you say more about that?", "Give me one concrete example.", "Summarize it in one sentence."]


async def _conversations(base: str, model: str, n: int, workers: int, turns: int, bar) -> list[dict]:
    records: list[dict] = []
    todo = list(range(n))

    async def one(http: httpx.AsyncClient, i: int) -> None:
        question = QUESTIONS[i % len(QUESTIONS)]
        messages = [{"role": "system", "content": "Answer from the context when you can."},
                    {"role": "user", "content": f"Context:\n{DOCS[i % len(DOCS)]}\n\nTicket {i}: {question}"}]
        for turn in range(turns):
            body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS, "stream": True}
            start = time.perf_counter()
            first, parts = None, []
            async with http.stream("POST", "/v1/chat/completions", json=body,
                                   headers={"cache-control": "no-cache, no-store", "x-slo-tier": "batch"}) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if line.startswith("data: {") and '"content":"' in line:
                        first = first or time.perf_counter()
                        parts.append(line.split('"content":"', 1)[1].split('"', 1)[0])
                timing = resp.headers.get("server-timing", "")
                reused = server_timing_count(timing, "prefix_reused_tokens")
                records.append({"conversation": i, "turn": turn, "replica": resp.headers.get("x-model-replica", "?"),
                                "ttft_ms": ((first or time.perf_counter()) - start) * 1000, "reused": reused})
            bar.update(1)
            messages += [{"role": "assistant", "content": "".join(parts)},
                         {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

    async def worker(http: httpx.AsyncClient) -> None:
        while todo:
            await one(http, todo.pop(0))

    async with httpx.AsyncClient(base_url=base, timeout=180) as http:
        await asyncio.gather(*(worker(http) for _ in range(workers)))
    return records


def run(quick: bool = False, requests: int | None = None, **_: object) -> dict:
    from bench.local import running_service

    conversations, workers, turns = (4, 1, 3) if quick else (8, 1, 4)
    serve_file = load_serve_config()
    model = serve_file.args.target.engine.model_id
    options = {name: dict(opts) for name, opts in serve_file.deployment_options.items()}
    options["TargetModel"]["num_replicas"] = 2
    results = {}
    for router in ("power_of_two", "prefix_affinity"):
        target = dict(options["TargetModel"])
        if router == "power_of_two":
            target.pop("request_router_config", None)  # Ray Serve's default
        serve_file.deployment_options = {**options, "TargetModel": target}

        def tweak(args) -> None:
            args.cache.enabled = False
            args.router.kind = "rules"
            args.target.speculative.method = "none"
            args.target.engine.num_threads = 1  # two replicas, two cores
            args.ingress.debug_timings = True  # prefix_reused_tokens in every Server-Timing

        with running_service(serve_file, tweak=tweak) as base:
            warm = tqdm(total=2, desc=f"{router}: warm-up", unit="req")
            asyncio.run(_conversations(base, model, 2, 2, 1, warm))  # both replicas warm (not measured)
            warm.close()
            bar = tqdm(total=conversations * turns, desc=router, unit="req")
            records = asyncio.run(_conversations(base, model, conversations, workers, turns, bar))
            bar.close()
        follow = [r for r in records if r["turn"] > 0]
        per_replica: dict[str, int] = {}
        for r in records:
            per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
        moved = sum(len({r["replica"] for r in records if r["conversation"] == c}) > 1 for c in range(conversations))
        results[router] = {
            "followup_ttft_ms": summary([r["ttft_ms"] for r in follow]),
            "first_turn_ttft_ms": summary([r["ttft_ms"] for r in records if r["turn"] == 0]),
            "reused_tokens_mean_followups": round(sum(r["reused"] for r in follow) / max(1, len(follow)), 1),
            "requests_per_replica": sorted(per_replica.values(), reverse=True),
            "conversations_that_moved": moved,
        }
    a, b = results["power_of_two"], results["prefix_affinity"]
    return {
        "followup_ttft_p50_ms": {"power_of_two": a["followup_ttft_ms"]["p50"], "prefix_affinity": b["followup_ttft_ms"]["p50"]},
        "followup_ttft_speedup_p50": round(a["followup_ttft_ms"]["p50"] / b["followup_ttft_ms"]["p50"], 3),
        "routers": results,
        "config": {"conversations": conversations, "concurrent": workers, "turns": turns, "replicas": 2,
                   "max_tokens": MAX_TOKENS, "threads_per_replica": 1, "speculation": "none"},
    }
