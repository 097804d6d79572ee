"""Suite `overhead`: what the serving stack adds to TTFT and ITL, and what tracing costs.

1. The engine called directly, in this process (no Ray, no HTTP): TTFT and ITL.
2. The same prompts through serve_config.yaml's whole graph (tracing off, its default), streamed
   with the openai SDK over loopback: TTFT and ITL at the client, and each request's
   Server-Timing stages (p50 per stage: where the overhead goes).
3. Throughput, closed loop (`clients` at once, fresh prompts), with tracing off, then with the
   service restarted with tracing on at 100% sampling, exporting over OTLP/HTTP to a receiver
   on loopback: `tracing_throughput_ratio` = on / off.

Speculation is off on both sides of 1-2 (the engine is the same; this measures the framework,
and speculative bursts would blur per-token latency); on in 3, as served. Every prompt is new,
so the cache lookup runs and misses, as for most real traffic.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from tqdm import tqdm

from bench.stack import engine_direct_samples, prompts, stack_samples
from bench.stats import percentile, summary
from configs.schemas import TracingConfig
from configs.serve_config import load_serve_config

NO_CACHE = {"cache-control": "no-cache, no-store"}


async def _throughput(base_url: str, model: str, conversations, max_tokens: int, clients: int) -> float:
    """Completed requests per second, `clients` streaming at once until the prompts run out."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="bench", max_retries=0)
    todo = list(conversations)
    bar = tqdm(total=len(todo), desc=f"throughput, {clients} clients", unit="req")

    async def worker() -> None:
        while todo:
            conv = todo.pop()
            stream = await client.chat.completions.create(
                model=model, messages=conv, temperature=0, max_tokens=max_tokens, stream=True
            )
            async for _ in stream:
                pass
            bar.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - start
    bar.close()
    await client.close()
    return len(conversations) / elapsed


def _plot(engine: list[float], stack: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in (("engine called directly", engine), ("through the stack (client-side)", stack)):
        xs = sorted(values)
        ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=label)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF: engine vs full stack")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(
    requests: int = 24, max_tokens: int = 24, quick: bool = False, out: str | None = None,
    throughput_requests: int = 32, clients: int = 4,
) -> dict:
    from bench.otlp_sink import OTLPSink
    from bench.service import running_service

    if quick:
        requests, throughput_requests = min(requests, 6), min(throughput_requests, 8)
    serve_file = load_serve_config()
    model = serve_file.args.target.engine.model_id
    plain = serve_file.args.target.model_copy(deep=True)
    plain.speculative.method = "none"

    def no_speculation(args) -> None:
        args.target.speculative.method = "none"

    conversations = prompts(requests, tag="m")
    engine_ttft, engine_itl = engine_direct_samples(plain, prompts(2, tag="w") + conversations, max_tokens)
    engine_ttft, engine_itl = engine_ttft[2:], engine_itl  # the first two warm the engine

    with running_service(serve_file, tweak=no_speculation) as base:
        stack_samples(base, model, prompts(2, tag="w"), 4)  # warm the path
        stack_ttft, stack_itl, stages = stack_samples(base, model, conversations, max_tokens)
        # The same prompts again with `Cache-Control: no-cache, no-store`: the framework alone
        # (parse, admission, routing, the hops), without the cache lookup's own work.
        bare_ttft, _, bare_stages = stack_samples(base, model, conversations, max_tokens, headers=NO_CACHE)
    with running_service(serve_file) as base:
        asyncio.run(_throughput(base, model, prompts(clients, tag="w"), 4, clients))
        off = asyncio.run(_throughput(base, model, prompts(throughput_requests, tag="off"), max_tokens, clients))
    sink = OTLPSink(keep=False)
    try:
        def traced(args) -> None:
            args.telemetry.tracing = TracingConfig(exporter="otlp", endpoint=sink.endpoint, sample_ratio=1.0)

        with running_service(serve_file, tweak=traced) as base:
            asyncio.run(_throughput(base, model, prompts(clients, tag="w2"), 4, clients))
            on = asyncio.run(_throughput(base, model, prompts(throughput_requests, tag="on"), max_tokens, clients))
            time.sleep(3)  # the last batch of spans leaves
        exports = sink.requests
    finally:
        sink.close()

    p50 = lambda values: round(percentile(values, 0.5), 2)  # noqa: E731
    result = {
        "ttft_p50_ms_stack": p50(stack_ttft),
        "ttft_p50_ms_engine": p50(engine_ttft),
        "ttft_overhead_p50_ms": round(p50(stack_ttft) - p50(engine_ttft), 2),
        "itl_p50_ms_stack": p50(stack_itl),
        "itl_p50_ms_engine": p50(engine_itl),
        "tracing_throughput_ratio": round(on / off, 3),
        # Server-Timing p50 per stage: stages add up to `total` (the server's time to the first
        # token); `x.y` entries are details inside stage x, not added.
        "stages": {name: round(percentile(v, 0.5), 2) for name, v in stages.items()},
        # Cache-Control: no-cache: what the stack costs without the cache lookup (L1/L2 hops, embedding).
        "ttft_overhead_p50_ms_without_cache": round(p50(bare_ttft) - p50(engine_ttft), 2),
        "stages_without_cache": {name: round(percentile(v, 0.5), 2) for name, v in bare_stages.items()},
        "config": {
            "model": model, "requests": requests, "max_tokens": max_tokens, "clients": clients,
            "throughput_requests": throughput_requests, "cache": serve_file.args.cache.enabled,
            "overlap_cache_lookup": serve_file.args.ingress.overlap_cache_lookup,
        },
        "ttft_ms": {"engine": summary(engine_ttft), "stack": summary(stack_ttft), "stack_without_cache": summary(bare_ttft)},
        "itl_ms": {"engine": summary(engine_itl), "stack": summary(stack_itl)},
        "throughput_rps": {"tracing_off": round(off, 3), "tracing_on": round(on, 3), "otlp_exports": exports},
    }
    if out:
        png = Path(out).with_suffix(".png")
        _plot(engine_ttft, stack_ttft, png)
        result["plot"] = str(png)
    return result
