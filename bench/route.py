"""Suite `route`: the router's accuracy, its cost, and what routing buys under load.

1. Accuracy on the shipped labeled set (router/dataset.py) with the shipped weights: on the
   held-out `test` split (templates never seen in training), per category, and a harsher
   leave-one-category-out score (task kinds never seen at all). `hard_to_small_rate` is the
   share of held-out "hard" requests the router would send to the small model.
2. Routing cost beyond the shared embedding: `router.route()` on real embeddings, in process,
   and the `route` stage of Server-Timing through the stack.
3. Mixed load through the whole graph (openai SDK, streaming, loopback, cache off so every
   request generates): the held-out requests, easy and hard mixed, sent by a closed loop of
   `concurrency` clients once with `model=<target>` (all-to-target) and once with
   `model=auto` (routed), and once with `model=<small>` (all-to-small), alternating in rounds
   so noise hits all three alike. `latency_gain_vs_all_target` = mean end-to-end latency
   all-to-target / routed; `all_small_gain_vs_all_target` = all-to-target / all-to-small, what
   routing would gain if every request, hard ones too, ran on the small model: on this box the
   most routing can buy.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time

import numpy as np
from tqdm import tqdm

from bench.stats import summary
from telemetry.clock import server_timing
from configs.serve_config import load_serve_config
from router.base import RouteFeatures
from router.classifier import DifficultyClassifier
from router.dataset import examples

NO_CACHE = {"Cache-Control": "no-cache, no-store"}


def quality(embedder, classifier: DifficultyClassifier, threshold: float) -> dict:
    data = examples()
    vectors = embedder.embed_many([e.text for e in data])
    hard = np.array([e.hard for e in data])
    test = np.array([e.split == "test" for e in data])
    to_large = classifier.p_hard_many(vectors) >= threshold
    per_category = {}
    for category in sorted({e.category for e in data}):
        idx = np.array([e.category == category for e in data]) & test
        per_category[category] = round(float(np.mean(to_large[idx] == hard[idx])), 3)
    unseen = []
    for category in sorted({e.category for e in data} - {"written"}):
        held = np.array([e.category == category for e in data])
        model = DifficultyClassifier.fit(vectors[~held], hard[~held], l2=classifier.meta.get("l2", 1.0))
        unseen.append(float(np.mean((model.p_hard_many(vectors[held]) >= threshold) == hard[held])))
    test_hard = test & hard
    return {
        "examples": {"train": int((~test).sum()), "test": int(test.sum())},
        "accuracy": round(float(np.mean(to_large[test] == hard[test])), 4),
        "accuracy_train": round(float(np.mean(to_large[~test] == hard[~test])), 4),
        "accuracy_unseen_category": round(statistics.fmean(unseen), 4),
        "hard_to_small_rate": round(float(np.mean(~to_large[test_hard])), 4),
        "easy_to_large_rate": round(float(np.mean(to_large[test & ~hard])), 4),
        "per_category_test_accuracy": per_category,
        "vectors": vectors,
    }


def route_cost(router, vectors: np.ndarray, rounds: int = 20) -> dict:
    """Microseconds per decision, given the embedding (rules, dot product, load shift)."""
    samples = []
    for i in range(rounds):
        for v in vectors:
            features = RouteFeatures("auto", 40, 64, 1, "x", v, 0.05 * (i % 3))
            t = time.perf_counter()
            router.route(features)
            samples.append((time.perf_counter() - t) * 1000)
    return summary(samples)


async def _closed_loop(base: str, model: str, conversations: list, concurrency: int, max_tokens: int,
                       bar: tqdm) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=300)
    queue = list(enumerate(conversations))
    results: list[dict] = []

    async def worker() -> None:
        while queue:
            i, (messages, label) = queue.pop(0)
            start = time.perf_counter()
            raw = await client.chat.completions.with_raw_response.create(
                model=model, messages=messages, temperature=0, max_tokens=max_tokens, stream=True,
                extra_headers=NO_CACHE,
            )
            first = None
            tokens = 0
            async for chunk in raw.parse():  # the raw response's parse() is sync; it returns the stream
                if chunk.choices and chunk.choices[0].delta.content:
                    first = first or time.perf_counter()
                    tokens += 1
            end = time.perf_counter()
            timing = server_timing(raw.headers.get("server-timing", ""))
            results.append({
                "label": label,
                "route": raw.headers.get("x-route", ""),
                "e2e_ms": (end - start) * 1000,
                "ttft_ms": ((first or end) - start) * 1000,
                "route_ms": timing.get("route.decide", float("nan")),
                "embed_ms": timing.get("lookup.embed", float("nan")),
            })
            bar.update(1)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await client.close()
    return results


def _phase_summary(results: list[dict], small_model: str) -> dict:
    e2e = [r["e2e_ms"] for r in results]
    out = {
        "requests": len(results),
        "e2e_ms": summary(e2e),
        "ttft_ms": summary([r["ttft_ms"] for r in results]),
        "to_small": sum(r["route"].startswith(small_model + ";") for r in results),
        "by_label_mean_e2e_ms": {
            label: round(statistics.fmean([r["e2e_ms"] for r in results if r["label"] == label]), 1)
            for label in ("easy", "hard") if any(r["label"] == label for r in results)
        },
    }
    reasons: dict[str, int] = {}
    for r in results:
        reason = r["route"].split("reason=")[-1].split(";")[0]
        reasons[reason] = reasons.get(reason, 0) + 1
    out["reasons"] = reasons
    return out


def mixed_load(requests: int, concurrency: int, max_tokens: int, rounds: int) -> dict:
    import httpx

    from bench.local import running_service

    serve_file = load_serve_config()
    target = serve_file.args.target.engine.model_id
    small = serve_file.args.draft.engine.model_id
    auto = serve_file.args.router.auto_model_id
    rng = random.Random(0)
    held_out = examples("test")
    rng.shuffle(held_out)
    workload = [([{"role": "user", "content": e.text}], e.label) for e in held_out[:requests]]
    per_round = [workload[i::rounds] for i in range(rounds)]
    phases: dict[str, list[dict]] = {"all_to_target": [], "routed": [], "all_to_small": []}
    with running_service(serve_file) as base:
        warm = [([{"role": "user", "content": "Hello!"}], "easy")] * 2
        with tqdm(total=len(phases) * len(workload) + 4, desc="route: mixed load", unit="req") as bar:
            asyncio.run(_closed_loop(base, target, warm, 1, 8, bar))
            asyncio.run(_closed_loop(base, small, warm, 1, 8, bar))
            for part in per_round:
                for name, model in (("all_to_target", target), ("routed", auto), ("all_to_small", small)):
                    phases[name].extend(asyncio.run(_closed_loop(base, model, part, concurrency, max_tokens, bar)))
        router_health = httpx.get(base + "/health", timeout=10).json().get("router", {})
    target_mean = statistics.fmean(r["e2e_ms"] for r in phases["all_to_target"])
    routed_mean = statistics.fmean(r["e2e_ms"] for r in phases["routed"])
    small_mean = statistics.fmean(r["e2e_ms"] for r in phases["all_to_small"])
    routed = phases["routed"]
    return {
        "config": {"requests": len(workload), "concurrency": concurrency, "max_tokens": max_tokens, "rounds": rounds,
                   "hard_share": round(sum(lab == "hard" for _, lab in workload) / len(workload), 3)},
        "all_to_target": _phase_summary(phases["all_to_target"], small),
        "routed": _phase_summary(routed, small),
        "all_to_small": _phase_summary(phases["all_to_small"], small),
        "latency_gain_vs_all_target": round(target_mean / routed_mean, 3),
        "all_small_gain_vs_all_target": round(target_mean / small_mean, 3),
        "stack_route_ms": summary([r["route_ms"] for r in routed if r["route_ms"] == r["route_ms"]]),
        "stack_embed_ms": summary([r["embed_ms"] for r in routed if r["embed_ms"] == r["embed_ms"]]),
        "router_health": router_health,
    }


def run(requests: int = 48, max_tokens: int = 64, concurrency: int = 4, rounds: int = 2, quick: bool = False) -> dict:
    from router.factory import make_router
    from semantic_cache.embedder import Embedder

    if quick:
        requests, rounds = min(requests, 16), 1
    config = load_serve_config().args.router
    embedder = Embedder()
    classifier = DifficultyClassifier.load(config.classifier.weights)
    q = quality(embedder, classifier, config.classifier.threshold)
    vectors = q.pop("vectors")
    router = make_router(config.model_copy(update={"kind": "classifier"}), "large", "small")
    cost = route_cost(router, vectors)
    load = mixed_load(requests, concurrency, max_tokens, rounds)
    return {
        "accuracy": q["accuracy"],
        "hard_to_small_rate": q["hard_to_small_rate"],
        "latency_gain_vs_all_target": load["latency_gain_vs_all_target"],
        "all_small_gain_vs_all_target": load["all_small_gain_vs_all_target"],
        "route_p99_ms": cost["p99"],
        "quality": q,
        "route_cost_in_process_ms": cost,
        "mixed_load": load,
        "weights": classifier.meta,
    }
