"""Suite `vllm_verify`: a semantic-cache match verified by the vLLM engine in one prefill.

Engine level (`engines/vllm_service.py`, configs/cpu-vllm.yaml's target, or gpu.yaml's on a
GPU), in float32 and in bfloat16: each chat prompt is answered once (greedy, `max_tokens`
tokens), then `repeats` times as a miss and `repeats` times with that answer as the hint
(`draft_hint_ids`, as the ingress sends a cached answer), alternating. Reports the end-to-end
time of each, the tokens the model kept of the hint, and how many verified answers differ from
the model's own. Then the same through the whole graph (float32, the cache in `verify` mode):
a question is asked, then a rewording of it uncached and through the cache, whose match the
model verifies; end to end at the client. Runs where vLLM is installed (`bash scripts/peers.sh vllm ours_vllm`, then
`.venv-peers/ours-vllm/bin/python -m bench vllm_verify --out FILE`).
"""

from __future__ import annotations

import asyncio
import statistics
import time

from configs.serve_config import load_serve_config
from engines.types import GenerateRequest, SamplingParams

PROMPTS = [
    "Explain how rain forms, in detail.",
    "Describe the water cycle step by step.",
    "Why do leaves change color in autumn? Explain fully.",
]


def _profile():
    from vllm.platforms import current_platform

    from configs.serve_config import CPU_EXACT_CONFIG

    name = "cpu-vllm.yaml" if current_platform.is_cpu() else "gpu.yaml"
    return load_serve_config(CPU_EXACT_CONFIG.with_name(name)).args.target


async def _one_dtype(dtype: str, max_tokens: int, repeats: int) -> dict:
    from engines.vllm_service import VLLMService

    stage = _profile().model_copy(deep=True)
    stage.engine.vllm.dtype = dtype
    service = VLLMService(stage)
    try:
        await service.warmup()
        tok = service.engine.tokenizer
        miss_ms, verified_ms, kept, unlike = [], [], [], 0

        async def run(rid: str, ids: list[int], hint: list[int] | None) -> tuple[float, str, dict]:
            t = time.perf_counter()
            chunks = [c async for c in service.generate(
                GenerateRequest(rid, list(ids), SamplingParams(max_tokens=max_tokens, temperature=0), draft_hint_ids=hint))]
            return (time.perf_counter() - t) * 1000, "".join(c.text for c in chunks), chunks[-1].timings_ms

        for i, question in enumerate(PROMPTS):
            text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                           add_generation_prompt=True)
            ids = tok.encode(text, add_special_tokens=False)
            _, answer, _ = await run(f"p{i}", ids, None)
            hint = tok.encode(answer, add_special_tokens=False)
            for r in range(repeats):
                ms, _, _ = await run(f"p{i}m{r}", ids, None)
                miss_ms.append(ms)
                ms, got, timings = await run(f"p{i}v{r}", ids, hint)
                verified_ms.append(ms)
                unlike += got != answer
            kept.append(int(timings.get("spec_hint_accepted", 0)))
        miss, verified = statistics.median(miss_ms), statistics.median(verified_ms)
        return {
            "dtype": service.dtype, "miss_p50_ms": round(miss, 1), "verified_p50_ms": round(verified, 1),
            "speedup_p50": round(miss / verified, 2), "kept_of_hint": kept, "hint_tokens": max_tokens,
            "verified_unlike_miss": unlike, "verified_runs": len(verified_ms),
            "miss_ms": [round(x) for x in miss_ms], "verified_ms": [round(x) for x in verified_ms],
        }
    finally:
        service.close()


PAIRS = [
    ("Name three uses of copper.", "Name three uses of copper"),
    ("What is the boiling point of water at sea level?", "What is the boiling point of water at sea level"),
    ("Give me two tips for better sleep.", "give me two tips for better sleep."),
    ("Explain what a CPU does.", "Explain what a CPU does"),
]


def _graph_rows(max_tokens: int) -> list[dict]:
    import httpx

    from bench.local import running_service
    from configs.serve_config import CPU_EXACT_CONFIG
    from vllm.platforms import current_platform

    serve_file = load_serve_config(CPU_EXACT_CONFIG.with_name("cpu-vllm.yaml" if current_platform.is_cpu() else "gpu.yaml"))

    def exact(args) -> None:
        args.target.engine.vllm.dtype = "float32"
        args.admission.mode = "fifo"  # nothing shed: the rows compare times, not admission

    rows = []
    with running_service(serve_file, tweak=exact) as base:
        model = serve_file.args.target.engine.model_id

        def ask(question: str, headers: dict | None = None) -> tuple[float, httpx.Response]:
            body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
                    "temperature": 0}
            t = time.perf_counter()
            r = httpx.post(base + "/v1/chat/completions", json=body, headers=headers or {}, timeout=300)
            return (time.perf_counter() - t) * 1000, r

        for first, reworded in PAIRS:
            ask(first)
            alone_ms, alone = ask(reworded, {"cache-control": "no-cache, no-store"})
            cached_ms, cached = ask(reworded)
            rows.append({
                "question": first, "reworded": reworded, "uncached_ms": round(alone_ms), "via_cache_ms": round(cached_ms),
                "speedup": round(alone_ms / cached_ms, 2), "x_cache": cached.headers.get("x-cache"),
                "x_cache_accepted": cached.headers.get("x-cache-accepted"),
                "same_answer": cached.json()["choices"][0]["message"]["content"]
                == alone.json()["choices"][0]["message"]["content"],
            })
    return rows


def run(max_tokens: int = 64, requests: int = 3, quick: bool = False) -> dict:
    try:
        import vllm
    except ImportError as exc:
        raise SystemExit(f"vLLM is not installed ({exc}): bash scripts/peers.sh vllm ours_vllm") from None
    repeats = 1 if quick else requests
    rows = [asyncio.run(_one_dtype(dtype, max_tokens, repeats)) for dtype in ("float32", "bfloat16")]
    return {"vllm_version": vllm.__version__, "config": {"max_tokens": max_tokens, "repeats": repeats,
                                                          "prompts": len(PROMPTS)}, "rows": rows,
            "behind_graph": _graph_rows(max_tokens)}
