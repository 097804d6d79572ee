"""Suite `cache`: the semantic cache's quality, its latency through the stack, its store, and
what near-miss drafts buy.

1. Quality on the shipped evaluation set (bench/evalset.py): precision / recall at the
   configured threshold, the curve over thresholds (with and without guards), and a held-out
   check: the threshold picked on the `tune` half, scored on the `test` half.
2. Latency over HTTP through the whole graph (httpx, non-streaming, loopback): a miss that
   generates, an exact hit, a semantic hit served as is (a paraphrase, first time asked;
   `semantic.mode: trust`).
2b. Verified hits (the shipped `semantic.mode: verify`), streamed at 64 tokens: TTFT and
   end-to-end of a paraphrase whose cached answer the model checks as a draft, against the
   original's miss, and whether any verified answer differs from the model's own.
3. Store lookup p50/p99 at 10k and 100k entries (Qdrant edge, HNSW built; all entries in one
   scope, the worst case for the filter), next to qdrant-client's local mode at 10k.
4. Near-miss drafts: the target (serve_config.yaml's speculation) answers paraphrases with the
   cached answer of the original question as a hint vs without it; same tokens, less time.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from tqdm import tqdm

from bench.stats import summary
from telemetry.clock import server_timing
from configs.serve_config import load_serve_config
from bench.evalset import PARAPHRASES, eval_pairs
from semantic_cache.guards import mismatch

THRESHOLDS = [round(0.70 + 0.01 * i, 2) for i in range(29)]


def _prf(served: list[bool], labels: list[str]) -> tuple[float, float]:
    tp = sum(s and lab == "hit" for s, lab in zip(served, labels))
    fp = sum(s and lab == "miss" for s, lab in zip(served, labels))
    hits = sum(lab == "hit" for lab in labels)
    return (tp / (tp + fp) if tp + fp else 1.0), (tp / hits if hits else 0.0)


def quality(embedder, threshold: float) -> dict:
    pairs = eval_pairs()
    a = embedder.embed_many([p.cached for p in pairs])
    b = embedder.embed_many([p.query for p in pairs])
    sims = (a * b).sum(axis=1)
    guards_ok = [mismatch(p.cached, p.query) is None for p in pairs]
    labels = [p.label for p in pairs]

    def score(th: float, split: str | None = None, guards: bool = True) -> tuple[float, float]:
        idx = [i for i, p in enumerate(pairs) if split is None or p.split == split]
        served = [bool(sims[i] >= th) and (guards_ok[i] or not guards) for i in idx]
        return _prf(served, [labels[i] for i in idx])

    curve = []
    for th in THRESHOLDS:
        p, r = score(th)
        pn, rn = score(th, guards=False)
        curve.append({"threshold": th, "precision": round(p, 4), "recall": round(r, 4),
                      "precision_no_guards": round(pn, 4), "recall_no_guards": round(rn, 4)})
    # Held-out: the lowest threshold with precision >= 0.98 on `tune`, scored on `test`.
    tuned = next((th for th in THRESHOLDS if score(th, "tune")[0] >= 0.98), THRESHOLDS[-1])
    held_p, held_r = score(tuned, "test")
    precision, recall = score(threshold)
    # The templated split, never tuned on: trust mode (threshold + guards) as shipped.
    templated_p, templated_r = score(threshold, "held_out")
    false_served = sum(
        1 for i, p in enumerate(pairs) if p.label == "miss" and sims[i] >= threshold and guards_ok[i]
    )
    return {
        "pairs": len(pairs),
        "paraphrase_pairs": labels.count("hit"),
        "near_miss_pairs": labels.count("miss"),
        "precision": round(precision, 4),
        "recall": round(recall, 4),
        "heldout": {"tuned_threshold": tuned, "test_precision": round(held_p, 4), "test_recall": round(held_r, 4)},
        "templated_held_out_trust": {"precision": round(templated_p, 4), "recall": round(templated_r, 4)},
        "near_misses_served_in_trust_mode": false_served,
        "curve": curve,
    }


def store_latency(dimensions: int, sizes: tuple[int, ...], queries: int = 300) -> dict:
    from configs.schemas import VectorStoreConfig
    from semantic_cache.store import make_store

    rng = np.random.default_rng(0)
    out: dict[str, dict] = {}
    for kind, n in [("edge", s) for s in sizes] + [("qdrant", 10_000)]:
        store = make_store(VectorStoreConfig(kind=kind), dimensions)
        vectors = rng.standard_normal((n, dimensions)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        started = time.perf_counter()
        for i in tqdm(range(n), desc=f"store {kind} {n}: insert", unit="entry", mininterval=2):
            store.upsert(f"00000000-0000-0000-0000-{i:012d}", vectors[i], {"scope": "s", "tenant": "t", "expires": 1e12})
        inserted_s = time.perf_counter() - started
        started = time.perf_counter()
        store.maintain()  # the HNSW build the cache deployment runs in the background
        index_s = time.perf_counter() - started
        probes = rng.standard_normal((queries, dimensions)).astype(np.float32)
        times = []
        for q in probes[: queries if kind == "edge" else 30]:
            t = time.perf_counter()
            store.search(q, "s", 0.0, 3)
            times.append((time.perf_counter() - t) * 1000)
        out[f"{kind}_{n}"] = {"insert_s": round(inserted_s, 1), "index_s": round(index_s, 1), "lookup_ms": summary(times)}
    return out


def http_latency(requests: int, max_tokens: int) -> dict:
    """Hits over HTTP, on the ingress's direct listener (the headline numbers) and, side by side
    in the same run, through Ray Serve's proxy: every exact hit is asked on both doors in turn;
    paraphrases (a semantic hit is only a first time) alternate between them."""
    import httpx

    from bench.local import running_service_urls, without_rate_limits

    serve_file = load_serve_config()
    model = serve_file.args.target.engine.model_id
    pairs = PARAPHRASES[:requests]
    miss, outcomes = [], {"semantic_hit": 0, "hint": 0, "miss": 0}
    exact: dict[str, list[float]] = {"direct": [], "proxy": []}
    semantic: dict[str, list[float]] = {"direct": [], "proxy": []}
    stages: dict[str, dict[str, list[float]]] = {"exact_hit": {}, "semantic_hit": {}}

    def timing(kind: str, resp: httpx.Response) -> None:
        for name, dur in server_timing(resp.headers.get("server-timing", "")).items():
            stages[kind].setdefault(name, []).append(dur)

    def ask(client: httpx.Client, text: str) -> tuple[float, httpx.Response]:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
                "max_tokens": max_tokens}
        t = time.perf_counter()
        resp = client.post("/v1/chat/completions", json=body)
        resp.raise_for_status()
        return (time.perf_counter() - t) * 1000, resp

    def trusting(args) -> None:  # what a semantic hit served as is costs (semantic.mode: trust)
        without_rate_limits(args)
        args.cache.semantic.mode = "trust"

    headers = {"authorization": "Bearer bench"}
    with running_service_urls(serve_file, tweak=trusting) as urls, \
            httpx.Client(base_url=urls.best, timeout=120, headers=headers) as direct, \
            httpx.Client(base_url=urls.proxy, timeout=120, headers=headers) as proxy:
        doors = {"direct": direct, "proxy": proxy} if urls.direct else {"proxy": proxy}
        for client in doors.values():
            ask(client, "Warm up: say hi.")
        for i, (original, paraphrase) in enumerate(tqdm(pairs, desc="cache over HTTP", unit="pair")):
            ms, resp = ask(direct, original)
            if resp.headers["x-cache"] in ("miss", "hint"):
                miss.append(ms)
            time.sleep(0.05)  # the write is fire-and-forget: let it land
            for door, client in doors.items():
                ms, resp = ask(client, original)
                if resp.headers["x-cache"] == "hit":
                    exact[door].append(ms)
                    if door == "direct" or not urls.direct:
                        timing("exact_hit", resp)
            door = list(doors)[i % len(doors)]
            ms, resp = ask(doors[door], paraphrase)
            if resp.headers["x-cache"] == "hit":
                semantic[door].append(ms)
                outcomes["semantic_hit"] += 1
                if door == "direct" or not urls.direct:
                    timing("semantic_hit", resp)
            else:
                outcomes[resp.headers["x-cache"]] = outcomes.get(resp.headers["x-cache"], 0) + 1
    head = "direct" if urls.direct else "proxy"
    return {"miss_ms": summary(miss), "exact_hit_ms": summary(exact[head]), "semantic_hit_ms": summary(semantic[head]),
            "via_proxy": {"exact_hit_ms": summary(exact["proxy"]), "semantic_hit_ms": summary(semantic["proxy"])},
            "headline_door": head,
            "paraphrase_outcomes": outcomes,
            "server_timing_p50_ms": {kind: {name: summary(v)["p50"] for name, v in by.items()} for kind, by in stages.items()}}


def verified_hits(pairs_n: int, max_tokens: int) -> dict:
    """The shipped `semantic.mode: verify` over HTTP, streamed: each original question is a miss
    (its answer cached), then its paraphrase a verified hit (the model checks the cached answer
    as a draft). TTFT and end-to-end of both, side by side, and how much of each draft the model
    kept; every verified answer is compared with the paraphrase's own answer with no cache."""
    import json

    import httpx

    from bench.local import running_service, without_rate_limits

    serve_file = load_serve_config()
    model = serve_file.args.target.engine.model_id

    def ask(client: httpx.Client, text: str, headers: dict | None = None) -> dict:
        body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
                "max_tokens": max_tokens, "stream": True}
        start, first, parts = time.perf_counter(), None, []
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers or {}) as resp:
            resp.raise_for_status()
            cache = resp.headers["x-cache"]
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    first = first or time.perf_counter()
                    parts.append(delta)
        end = time.perf_counter()
        return {"cache": cache, "ttft_ms": ((first or end) - start) * 1000, "e2e_ms": (end - start) * 1000,
                "text": "".join(parts)}

    miss_ttft, miss_e2e, hit_ttft, hit_e2e, outcomes, wrong = [], [], [], [], {}, 0
    whole_e2e, whole_miss_e2e = [], []  # verified hits whose cached answer the model kept whole, and their misses
    with running_service(serve_file, tweak=without_rate_limits) as base, \
            httpx.Client(base_url=base, timeout=120, headers={"authorization": "Bearer bench-verify"}) as client:
        ask(client, "Warm up: say hi.")
        for original, paraphrase in tqdm(PARAPHRASES[:pairs_n], desc="verified hits", unit="pair"):
            first = ask(client, original)
            if first["cache"] == "miss":
                miss_ttft.append(first["ttft_ms"])
                miss_e2e.append(first["e2e_ms"])
            time.sleep(0.05)  # the write is fire-and-forget: let it land
            served = ask(client, paraphrase)
            outcomes[served["cache"]] = outcomes.get(served["cache"], 0) + 1
            if served["cache"] == "verified":
                hit_ttft.append(served["ttft_ms"])
                hit_e2e.append(served["e2e_ms"])
                if served["text"] == first["text"] and first["cache"] == "miss":
                    whole_e2e.append(served["e2e_ms"])
                    whole_miss_e2e.append(first["e2e_ms"])
                alone = ask(client, paraphrase, {"Cache-Control": "no-cache, no-store"})
                wrong += alone["text"] != served["text"]
    m_e2e, h_e2e = summary(miss_e2e)["p50"], summary(hit_e2e)["p50"] if hit_e2e else None
    m_ttft, h_ttft = summary(miss_ttft)["p50"], summary(hit_ttft)["p50"] if hit_ttft else None
    return {
        "max_tokens": max_tokens, "outcomes": outcomes,
        "miss_ttft_ms": summary(miss_ttft), "miss_e2e_ms": summary(miss_e2e),
        "verified_ttft_ms": summary(hit_ttft), "verified_e2e_ms": summary(hit_e2e),
        "e2e_miss_over_verified_p50": round(m_e2e / h_e2e, 2) if h_e2e else None,
        "ttft_verified_over_miss_p50": round(h_ttft / m_ttft, 2) if h_ttft else None,
        "verified_answers_unlike_the_models_own": wrong,
        "fully_accepted": len(whole_e2e),
        "fully_accepted_e2e_ms": summary(whole_e2e),
        "fully_accepted_e2e_miss_over_verified_p50": (
            round(summary(whole_miss_e2e)["p50"] / summary(whole_e2e)["p50"], 2) if whole_e2e else None
        ),
    }


def _model():
    from target.service import ModelService
    from ingress.prompts import PromptBuilder

    service = ModelService(load_serve_config().args.target)
    return service, PromptBuilder(service.engine.tokenizer)


def _answers(service, builder, texts: list[str], max_tokens: int) -> dict[str, str]:
    """The target's own greedy answer to each text (speculation on: lossless, and faster)."""
    from engines.types import GenerateRequest, SamplingParams
    from ingress.protocol import ChatMessage

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def one(i: int, text: str) -> str:
        request = GenerateRequest(f"label{i}", builder.chat([ChatMessage(role="user", content=text)]), params)
        return "".join([chunk.text async for chunk in service.generate(request)])

    async def run_all() -> dict[str, str]:
        unique = sorted(set(texts))
        return {t: await one(i, t) for i, t in enumerate(tqdm(unique, desc="bounded: model answers", unit="query"))}

    return asyncio.run(run_all())


def bounded_mode(embedder, service, builder, threshold: float, max_error_rate: float, max_tokens: int = 32,
                 arrivals: int = 4000) -> dict:
    """`semantic.mode: bounded` on the evaluation set, labelled by the model itself: each pair that
    passes the threshold and the guards is a candidate, right when the model's greedy answer to
    the new question equals its answer to the cached one. A stream of `arrivals` candidates drawn
    from the tune/test pairs trains the skip policy (verified ones teach it); a stream drawn from
    the held-out pairs, never tuned on, measures the realised rate of wrong answers it served."""
    import random

    from semantic_cache.skip_policy import SkipPolicy

    pairs = eval_pairs()
    a = embedder.embed_many([p.cached for p in pairs])
    b = embedder.embed_many([p.query for p in pairs])
    sims = (a * b).sum(axis=1)
    candidates = [(p, float(sims[i])) for i, p in enumerate(pairs) if sims[i] >= threshold and mismatch(p.cached, p.query) is None]
    answers = _answers(service, builder, [t for p, _ in candidates for t in (p.cached, p.query)], max_tokens)
    labelled = [(p, s, answers[p.cached] == answers[p.query]) for p, s in candidates]
    train = [x for x in labelled if x[0].split != "held_out"]
    held = [x for x in labelled if x[0].split == "held_out"]
    policy = SkipPolicy(max_error_rate, rng=random.Random(1))
    rng = random.Random(0)

    def stream(pool: list, n: int) -> dict:
        served = wrong = 0
        for _ in range(n if pool else 0):
            p, score, correct = rng.choice(pool)
            key = p.cached
            if policy.serve_unverified(score, key):
                served += 1
                wrong += not correct
            else:
                policy.observe(score, key, correct)
        return {"arrivals": n if pool else 0, "served_unverified": served, "wrong_served": wrong,
                "realised_error_rate": round(wrong / served, 4) if served else 0.0,
                "served_unverified_share": round(served / n, 4) if pool else 0.0}

    trained = stream(train, arrivals)
    tested = stream(held, arrivals // 2)
    return {
        "max_error_rate": max_error_rate,
        "label_max_tokens": max_tokens,
        "candidates": len(labelled),
        "candidates_model_agrees": sum(c for _, _, c in labelled),
        "held_out_candidates": len(held),
        "held_out_model_agrees": sum(c for _, _, c in held),
        "learned_threshold": policy.threshold,
        "labels_needed_at_bound": SkipPolicy.labels_needed(max_error_rate),
        "train_stream": trained,
        "held_out_stream": tested,
    }


def verified_agreeing(service, builder, n: int, max_tokens: int) -> dict:
    """What a verified hit costs when the cached answer is the one the model gives (in-process,
    the model replica's own timing): each question generated alone, then again with its own
    answer offered as the draft, as a verified hit offers the cached one. Over HTTP such pairs
    are rare with the shipped 135M model (its answer to a paraphrase departs early); this is
    the mechanism's cost where they agree."""
    from engines.types import GenerateRequest, SamplingParams
    from ingress.protocol import ChatMessage

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def timed(rid: str, ids: list[int], hint: list[int] | None) -> tuple[str, float, float, int]:
        start, first, parts, tokens = time.perf_counter(), None, [], 0
        async for chunk in service.generate(GenerateRequest(rid, ids, params, draft_hint_ids=hint)):
            first = first or time.perf_counter()
            parts.append(chunk.text)
            tokens += chunk.num_tokens
        end = time.perf_counter()
        return "".join(parts), (first - start) * 1000, (end - start) * 1000, tokens

    async def run_all() -> dict:
        rows, same = [], True
        for i, (original, _) in enumerate(tqdm(PARAPHRASES[:n], desc="verified, agreeing answer", unit="question")):
            ids = builder.chat([ChatMessage(role="user", content=original)])
            text, ttft, e2e, tokens = await timed(f"alone{i}", ids, None)
            hint = builder.tokenizer.encode(text, add_special_tokens=False)
            again, v_ttft, v_e2e, _ = await timed(f"verified{i}", ids, hint)
            same &= again == text
            rows.append((tokens, ttft, e2e, v_ttft, v_e2e))
        full = [r for r in rows if r[0] == max_tokens]  # answers that ran to max_tokens
        pick = full or rows
        return {
            "questions": len(rows), "at_max_tokens": len(full), "identical_output": same,
            "miss_e2e_ms": summary([r[2] for r in pick]), "verified_e2e_ms": summary([r[4] for r in pick]),
            "e2e_miss_over_verified_p50": round(summary([r[2] for r in pick])["p50"] / summary([r[4] for r in pick])["p50"], 2),
            "ttft_verified_over_miss_p50": round(summary([r[3] for r in pick])["p50"] / summary([r[1] for r in pick])["p50"], 2),
        }

    return asyncio.run(run_all())


def near_miss_speedup(service, builder, pairs_n: int, max_tokens: int) -> dict:
    from engines.types import GenerateRequest, SamplingParams
    from ingress.protocol import ChatMessage

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)

    async def generate(rid: str, text: str, hint: list[int] | None) -> tuple[str, float, int]:
        ids = builder.chat([ChatMessage(role="user", content=text)])
        request = GenerateRequest(rid, ids, params, draft_hint_ids=hint)
        parts, first, tokens = [], None, 0
        async for chunk in service.generate(request):
            if first is None:
                first = time.perf_counter()
            parts.append(chunk.text)
            tokens += chunk.num_tokens
        # Decode time only (after the first chunk): the hint cannot speed up the prefill.
        return "".join(parts), (time.perf_counter() - first) * 1000, tokens

    async def run_all() -> dict:
        plain_ms = hinted_ms = 0.0
        identical = True
        rows = []
        for i, (original, paraphrase) in enumerate(tqdm(PARAPHRASES[:pairs_n], desc="near-miss drafts", unit="pair")):
            cached, _, _ = await generate(f"c{i}", original, None)
            hint = builder.tokenizer.encode(cached, add_special_tokens=False)
            plain, t_plain, n = await generate(f"p{i}", paraphrase, None)
            hinted, t_hint, _ = await generate(f"h{i}", paraphrase, hint)
            identical &= plain == hinted
            plain_ms += t_plain
            hinted_ms += t_hint
            rows.append({"tokens": n, "plain_decode_ms": round(t_plain, 1), "hinted_decode_ms": round(t_hint, 1)})
        return {"speedup": round(plain_ms / hinted_ms, 3), "identical_output": identical, "pairs": rows}

    return asyncio.run(run_all())


def run(requests: int = 40, max_tokens: int = 48, quick: bool = False) -> dict:
    from semantic_cache.embedder import Embedder

    serve_file = load_serve_config()
    semantic = serve_file.args.cache.semantic
    embedder = Embedder()
    q = quality(embedder, semantic.threshold)
    sizes = (10_000,) if quick else (10_000, 100_000)
    store = store_latency(embedder.dimensions, sizes)
    http = http_latency(min(requests, 6) if quick else requests, max_tokens)
    verified = verified_hits(min(requests, 6) if quick else requests, 64)
    service, builder = _model()
    near = near_miss_speedup(service, builder, 4 if quick else 12, 64 if quick else 96)
    agreeing = verified_agreeing(service, builder, 4 if quick else 16, 64)
    bounded = bounded_mode(embedder, service, builder, semantic.threshold, semantic.max_error_rate,
                           arrivals=1000 if quick else 4000)
    big = store.get("edge_100000", {}).get("lookup_ms", {})
    return {
        "threshold": semantic.threshold,
        "precision": q["precision"],
        "recall": q["recall"],
        "exact_hit_p50_ms": http["exact_hit_ms"]["p50"],
        "semantic_hit_p50_ms": http["semantic_hit_ms"]["p50"],
        "miss_p50_ms": http["miss_ms"]["p50"],
        "exact_hit_p50_ms_via_proxy": http["via_proxy"]["exact_hit_ms"]["p50"],
        "semantic_hit_p50_ms_via_proxy": http["via_proxy"]["semantic_hit_ms"]["p50"],
        "lookup_p99_ms_10k": store["edge_10000"]["lookup_ms"]["p99"],
        "lookup_p99_ms_100k": big.get("p99", float("nan")),
        "near_miss_draft_speedup": near["speedup"],
        "verified_hit_e2e_speedup_over_miss_p50": verified["e2e_miss_over_verified_p50"],
        "verified_hit_ttft_over_miss_p50": verified["ttft_verified_over_miss_p50"],
        "verified_answers_unlike_the_models_own": verified["verified_answers_unlike_the_models_own"],
        "verified_fully_accepted_e2e_speedup_over_miss_p50": verified["fully_accepted_e2e_miss_over_verified_p50"],
        "verified_agreeing_e2e_speedup_over_miss_p50": agreeing["e2e_miss_over_verified_p50"],
        "verified_agreeing_ttft_over_miss_p50": agreeing["ttft_verified_over_miss_p50"],
        "bounded_realised_error_rate_held_out": bounded["held_out_stream"]["realised_error_rate"],
        "quality": q,
        "bounded": bounded,
        "verified_agreeing": agreeing,
        "verified": verified,
        "http": http,
        "store": store,
        "near_miss": near,
        "config": {"requests": requests, "max_tokens": max_tokens, "quick": quick, "hint_threshold": semantic.hint_threshold},
    }
