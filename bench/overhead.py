"""Suite `overhead`: what the serving stack adds to TTFT and ITL, and what tracing costs.

1. The engine called directly, in this process (no Ray, no HTTP): TTFT and ITL. It takes
   turns with the requests of 2, a request each, while the service runs: measured minutes
   apart, the box's drift alone moved its TTFT p50 by 30-50 ms here. (It is also measured once
   before the service starts: `ttft_p50_ms_engine_service_down`.)
2. The same prompts through serve_config.yaml's whole graph, streamed over loopback with a
   lean HTTP client (httpx; the openai SDK's own parsing would be charged to the stack): TTFT
   and ITL at the client, and each request's Server-Timing stages (p50 per stage: where the
   overhead goes). Every prompt carries its own number, so the cache lookup runs and misses (the
   semantic guards never match different numbers); `cache_outcomes` shows it. Then the same
   prompts with `Cache-Control: no-cache`: the stack without the lookup's work. Clients use the
   ingress's own listener (ingress.direct_port); a third set goes through Ray Serve's proxy.
3. Tracing at 100% sampling (OTLP/HTTP to a receiver on loopback) against unsampled, on one
   service, in alternating blocks so the box's drift hits both alike: closed-loop throughput of
   generated requests (`tracing_throughput_ratio` = sampled / unsampled) and of cache hits (the
   framework alone, where tracing weighs most). Unsampled still makes one non-recording root
   span per request; `exporter: none` makes none, so the real "off" is a hair cheaper.

Speculation is off in 1-2 on both sides (the engine is the same; this measures the framework,
and speculative bursts would blur per-token latency) and on in 3, as served.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from bench.stack import DirectEngine, prompts, stack_samples
from bench.stats import percentile, summary
from configs.schemas import TracingConfig
from configs.serve_config import load_serve_config

NO_CACHE = {"cache-control": "no-cache, no-store"}


# Between two measured requests: the last one's after-work (the cache write, OpenMP threads
# spinning down) lands on no one's clock.
SETTLE_S = 0.3

BUCKETS = [(0, 64, "<=64"), (65, 256, "65-256"), (257, 10**9, ">256")]


def by_prompt_length(ttft: list[float], prompt_tokens: list[int]) -> dict[str, dict]:
    """TTFT percentiles per prompt-length bucket (tokens)."""
    out = {}
    for lo, hi, label in BUCKETS:
        values = [t for t, n in zip(ttft, prompt_tokens) if lo <= n <= hi]
        if values:
            out[label] = summary(values)
    return out


async def _closed_loop(base_url: str, bodies: list[dict], clients: int, sampled: bool) -> tuple[int, float]:
    """(completed, seconds): `clients` requests at once until `bodies` run out. Each request
    carries a fresh traceparent, sampled or not."""
    todo = list(bodies)

    async def worker(http: httpx.AsyncClient) -> None:
        while todo:
            body = todo.pop()
            flags = "01" if sampled else "00"
            headers = {
                "traceparent": f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-{flags}",
                "x-slo-tier": "batch",  # no TTFT target: a throughput run must not be shed for its own queue
            }
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
                resp.raise_for_status()
                async for _ in resp.aiter_bytes():
                    pass

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        start = time.perf_counter()
        await asyncio.gather(*(worker(http) for _ in range(clients)))
        return len(bodies), time.perf_counter() - start


def _tracing_ratio(base_url: str, make_bodies, rounds: int, clients: int, label: str) -> dict:
    """Sampled vs unsampled throughput in alternating blocks (off, on, on, off, ...)."""
    done = {False: [0, 0.0], True: [0, 0.0]}
    order = [s for r in range(rounds) for s in ((False, True) if r % 2 == 0 else (True, False))]
    rates: list[float] = []
    for block, sampled in enumerate(tqdm(order, desc=f"tracing cost, {label}", unit="block")):
        n, seconds = asyncio.run(_closed_loop(base_url, make_bodies(block), clients, sampled))
        done[sampled][0] += n
        done[sampled][1] += seconds
        rates.append(n / seconds)
    off, on = done[False][0] / done[False][1], done[True][0] / done[True][1]
    # Each round's two blocks side by side (sampled / unsampled): a burst from a neighbour
    # on the box moves one round, not the median.
    paired = []
    for r in range(rounds):
        first, second = rates[2 * r], rates[2 * r + 1]
        sampled_rate, unsampled_rate = (second, first) if order[2 * r + 1] else (first, second)
        paired.append(sampled_rate / unsampled_rate)
    return {"unsampled_rps": round(off, 3), "sampled_rps": round(on, 3), "ratio": round(on / off, 3),
            "round_median_ratio": round(percentile(paired, 0.5), 3)}


def _plot(engine: list[float], stack: list[float], bare: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in (("engine called directly", engine), ("full stack, cache lookup (miss)", stack),
                          ("full stack, Cache-Control: no-cache", bare)):
        xs = sorted(values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    ax.set_xlabel("time to first token at the client (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF: engine vs full stack (one run)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _paired_p50(stack: list[float], engine: list[float]) -> float | None:
    """Median of stack − engine over the prompts both sides decoded (None if a request failed
    and the lists no longer line up)."""
    if len(stack) != len(engine) or not stack:
        return None
    return round(percentile([a - b for a, b in zip(stack, engine)], 0.5), 2)


def _interleaved(
    sets: dict[str, tuple[str, list, dict | None]], engine: DirectEngine, engine_convs: list, model: str, max_tokens: int
) -> dict[str, dict]:
    """`stack_samples` for each (base URL, prompts, headers) set and a request to the engine in
    this process, one of each in turn, so the box's drift hits every side alike. The order
    rotates each round: whatever one request leaves behind falls on every side equally often."""
    merged = {name: {"ttft": [], "itl": [], "stages": {}, "outcomes": {}, "prompt_tokens": []} for name in sets}
    merged["engine"] = {"ttft": [], "itl": []}
    players = ["engine", *sets]
    rounds = max(len(engine_convs), *(len(convs) for _, convs, _ in sets.values()))
    for i in tqdm(range(rounds), desc="engine and stack in turn (" + ", ".join(players) + ")", unit="round"):
        for name in players[i % len(players):] + players[: i % len(players)]:
            time.sleep(SETTLE_S)
            if name == "engine":
                if i < len(engine_convs):
                    first, gaps = engine.sample(engine_convs[i], max_tokens)
                    merged["engine"]["ttft"].append(first)
                    merged["engine"]["itl"].extend(gaps)
                continue
            base, convs, headers = sets[name]
            if i >= len(convs):
                continue
            one, into = stack_samples(base, model, convs[i : i + 1], max_tokens, headers, progress=False), merged[name]
            for key in ("ttft", "itl", "prompt_tokens"):
                into[key].extend(one[key])
            for stage, values in one["stages"].items():
                into["stages"].setdefault(stage, []).extend(values)
            for outcome, count in one["outcomes"].items():
                into["outcomes"][outcome] = into["outcomes"].get(outcome, 0) + count
    return merged


def _lookup_windows(app_name: str) -> dict[str, int]:
    from ray import serve

    stats = serve.get_deployment_handle("TargetModel", app_name=app_name).stats.remote().result(timeout_s=30)
    return {"beside_lookup": stats.get("prefills_beside_lookup", 0), "signalled": stats.get("lookup_windows_signalled", 0)}


def run(
    requests: int = 40, max_tokens: int = 24, quick: bool = False, out: str | None = None,
    rounds: int = 6, block: int = 8, clients: int = 4,
) -> dict:
    from bench.otlp_sink import OTLPSink
    from bench.local import running_service, running_service_urls, without_rate_limits

    if quick:
        requests, rounds = min(requests, 6), 2
    serve_file = load_serve_config()
    model = serve_file.args.target.engine.model_id
    plain = serve_file.args.target.model_copy(deep=True)
    plain.speculative.method = "none"
    measured = prompts(requests, first=1000)
    warm = prompts(2, first=10)
    engine = DirectEngine(plain)
    for conv in warm:
        engine.sample(conv, max_tokens)
    # The engine alone on the box, before the service starts: how far the box drifts from
    # this to the side-by-side run below (the headline) is itself worth seeing.
    alone_ttft = [engine.sample(c, max_tokens)[0] for c in tqdm(prompts(requests, first=7000), desc="engine, service down")]

    sink = OTLPSink(keep=False)
    try:
        def tweak(args) -> None:
            args.target.speculative.method = "none"
            without_rate_limits(args)

        with running_service_urls(serve_file, tweak=tweak) as urls:
            base = urls.best
            stack_samples(base, model, warm, 4)
            stack_samples(urls.proxy, model, warm, 4)
            # The engine in this process and three sets through the service, a request from each
            # in turn: the ingress's own listener with the cache lookup (the headline) and
            # without it, and Ray Serve's proxy with the lookup. The engine and the headline
            # set decode the same prompts.
            sets = _interleaved({
                "stack": (base, measured, None),
                "bare": (base, prompts(requests, first=5000), NO_CACHE),
                "proxied": (urls.proxy, prompts(requests, first=3000), None),
            }, engine, measured, model, max_tokens)
            stack, bare, proxied = sets["stack"], sets["bare"], sets["proxied"]
            engine_ttft, engine_itl = sets["engine"]["ttft"], sets["engine"]["itl"]
            windows = _lookup_windows(serve_file.app_name)
        engine.close()

        def traced(args) -> None:
            args.telemetry.tracing = TracingConfig(exporter="otlp", endpoint=sink.endpoint, sample_ratio=1.0)
            without_rate_limits(args)

        with running_service(serve_file, tweak=traced) as base:
            def generated(i: int) -> list[dict]:
                return [{"model": model, "messages": c, "temperature": 0, "max_tokens": max_tokens, "stream": True}
                        for c in prompts(block, first=20_000 + i * block)]

            hits = [{"model": model, "messages": c, "temperature": 0, "max_tokens": 8, "stream": True}
                    for c in prompts(8, first=90_000)]
            asyncio.run(_closed_loop(base, hits + generated(-1)[:clients], clients, True))  # warm; fills the cache
            generation = _tracing_ratio(base, generated, rounds, clients, "generated")
            # A block of hits lasts under a second, where the box's noise moves throughput by
            # ±10%: three times the blocks, for a few seconds more.
            cached = _tracing_ratio(base, lambda i: hits * 25, rounds * 3, clients, "cache hits")
            time.sleep(3)  # the last batch of spans leaves
        exports = sink.requests
    finally:
        sink.close()

    p50 = lambda values: round(percentile(values, 0.5), 2)  # noqa: E731
    result = {
        "ttft_p50_ms_stack": p50(stack["ttft"]),
        "ttft_p50_ms_engine": p50(engine_ttft),
        "ttft_overhead_p50_ms": round(p50(stack["ttft"]) - p50(engine_ttft), 2),
        # The same prompt through both, a round apart: the median of the differences, which
        # the prompts' own spread (25 ms between the length buckets) does not blur.
        "ttft_overhead_paired_p50_ms": _paired_p50(stack["ttft"], engine_ttft),
        "itl_p50_ms_stack": p50(stack["itl"]),
        "itl_p50_ms_engine": p50(engine_itl),
        "tracing_throughput_ratio": generation["ratio"],
        # Server-Timing p50 per stage: stages add up to `total` (the server's time to the first
        # token); `x.y` entries are details inside stage x, not added.
        "stages": {name: p50(v) for name, v in stack["stages"].items()},
        # Prefills started beside the lookup, and the windows (one core left to it) that the
        # lookup board ended rather than the ingress's estimate (host_tuning/lookup_window.py).
        "lookup_windows": windows,
        "cache_outcomes": stack["outcomes"],
        # Cache-Control: no-cache: the stack without the cache lookup (its hops and the embedding).
        "ttft_overhead_p50_ms_without_cache": round(p50(bare["ttft"]) - p50(engine_ttft), 2),
        "stages_without_cache": {name: p50(v) for name, v in bare["stages"].items()},
        "itl_p50_ms_stack_without_cache": p50(bare["itl"]),
        # Through Ray Serve's proxy (http_options.port) rather than the ingress's direct listener.
        "ttft_overhead_p50_ms_via_proxy": round(p50(proxied["ttft"]) - p50(engine_ttft), 2),
        "stages_via_proxy": {name: p50(v) for name, v in proxied["stages"].items()},
        # The engine measured alone before the service started, not side by side: drift included.
        "ttft_p50_ms_engine_service_down": p50(alone_ttft),
        "ttft_ms": {"engine": summary(engine_ttft), "stack": summary(stack["ttft"]),
                    "stack_without_cache": summary(bare["ttft"]), "stack_via_proxy": summary(proxied["ttft"])},
        "itl_ms": {"engine": summary(engine_itl), "stack": summary(stack["itl"])},
        "ttft_ms_by_prompt_tokens": {"stack": by_prompt_length(stack["ttft"], stack["prompt_tokens"]),
                                     "stack_without_cache": by_prompt_length(bare["ttft"], bare["prompt_tokens"])},
        "tracing": {"generated": generation, "cache_hits": cached, "otlp_exports": exports},
        "config": {
            "model": model, "requests": requests, "max_tokens": max_tokens, "clients": clients,
            "tracing_blocks": rounds * 2, "generated_per_block": block, "hit_blocks": rounds * 6, "hits_per_block": 200,
            "overlap_cache_lookup": serve_file.args.ingress.overlap_cache_lookup,
        },
    }
    if out:
        png = Path(out).with_suffix(".png")
        _plot(engine_ttft, stack["ttft"], bare["ttft"], png)
        result["plot"] = str(png)
    return result
