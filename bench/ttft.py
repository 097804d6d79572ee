"""Suite `ttft`: time-to-first-token of the CPU engine with the prefix KV cache off and on.

Two engines from configs/cpu-exact.yaml's target (one with `prefix_cache.enabled: false`) serve the
same requests, alternating, in this process: TTFT here is the engine's prefill plus the first
sample, what a replica adds to queueing. Workloads:
- shared system prompt: a long system prompt (instructions + tool definitions), many questions;
- multi-turn chat: one conversation growing turn by turn, each prompt holding the earlier turns
  and the model's own answers.
`identical` compares the greedy outputs of the two engines on every request.

Batching: the target's ModelService (speculation as shipped) serves 1, 2, 3, 4 and 16 concurrent
greedy streams in three modes, in one run, the prefix cache off so only decoding differs:
- `off`: `max_batch_size` 1, a step (a speculative round) per request, round-robin;
- `always`: every step that finds others waiting joins one batched plain pass;
- `chosen`: as shipped, the step-mode chooser picks turns or one batch per step.
Tokens/s is aggregate; ITL is the gap between a stream's chunks divided by the tokens in the chunk.
"""

from __future__ import annotations

import asyncio
import time

from tqdm import tqdm

from bench.stats import summary
from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config

SYSTEM = (
    "You are the support assistant of Nimbus Drive, a cloud storage product. Answer in at most three "
    "sentences, precisely, and never invent features. If a question is about billing, mention that "
    "invoices are under Settings > Billing. If it is about security, recommend two-factor authentication. "
    "You can call these tools by answering with JSON:\n"
    '{"name": "get_usage", "description": "Storage used and the plan limit", "parameters": {"user_id": "string"}}\n'
    '{"name": "create_share_link", "description": "A link to a file or folder", "parameters": {"path": "string", '
    '"expires_days": "integer", "password": "string or null"}}\n'
    '{"name": "list_devices", "description": "Devices signed in to the account", "parameters": {"user_id": "string"}}\n'
    '{"name": "open_ticket", "description": "Escalate to a human", "parameters": {"summary": "string", '
    '"priority": "low | normal | urgent"}}\n'
    "Plans: Free (5 GB), Plus (200 GB, $3/month), Pro (2 TB, $10/month), Team (5 TB pooled, $8/user/month). "
    "Files in the trash are kept 30 days. Version history is kept 90 days on Pro and Team, 30 days otherwise. "
    "Shared links can expire and can require a password on Plus and above."
)
QUESTIONS = [
    "How much space does the Plus plan have?",
    "How do I share a folder with a password?",
    "Can I recover a file I deleted last week?",
    "Where do I find my invoices?",
    "How do I see which devices are signed in?",
    "What does the Team plan cost for five people?",
    "How long is version history kept on Free?",
    "My upload is stuck, what should I do?",
    "How do I make my account more secure?",
    "Can a shared link expire automatically?",
    "What happens to files in the trash after a month?",
    "Please escalate: I was charged twice this month.",
]
TURNS = [
    "Hi! I want to organise my photos.",
    "Can you suggest a folder structure by year and event?",
    "How would I name the files inside each folder?",
    "And how do I share one event with my family?",
    "Can they add their own photos to it?",
    "What if someone deletes a photo by mistake?",
]


def _ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _generate(engine, ids: list[int], max_tokens: int) -> tuple[float, str]:
    from engines.types import GenerateRequest, SamplingParams
    from target.decoding import Generation

    gen = Generation(engine, GenerateRequest("bench", ids, SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    start = time.perf_counter()
    chunks = [gen.prefill()]
    ttft = (time.perf_counter() - start) * 1000
    while not gen.finished:
        chunks.append(gen.step())
    return ttft, "".join(c.text for c in chunks)


def run(requests: int | None = None, max_tokens: int = 16, quick: bool = False) -> dict:
    from target.service import ModelService

    stage = load_serve_config(CPU_EXACT_CONFIG).args.target.model_copy(deep=True)
    stage.engine.prefix_cache.enabled = False
    service = ModelService(stage)
    batching = _batching(service, quick)
    # Every torch forward pass of this process on ONE thread (the service's worker): a second
    # thread running torch ops slows both (two OpenMP teams on 2 cores).
    result = service.executor.submit(_prefix, requests, max_tokens, quick).result()
    precision = service.executor.submit(_precision, quick).result()
    return {**result, "batching": batching, "precision": precision}


def _precision(quick: bool) -> list[dict]:
    """Each weight mode against float32: decode speed, TTFT, and greedy agreement: the share of
    requests whose output is identical, and the share of float32's tokens this mode predicts
    when fed float32's output (one early difference would otherwise hide the rest)."""
    from engines.transformers_engine import TransformersEngine

    base = load_serve_config(CPU_EXACT_CONFIG).args.target.engine.model_copy(deep=True)
    base.prefix_cache.enabled = False
    questions = QUESTIONS[: 4 if quick else 8]
    max_tokens = 32
    outputs: dict[str, list[list[int]]] = {}
    points = []
    for dtype in ("float32", "bfloat16", "int8"):
        config = base.model_copy(update={"dtype": dtype})
        engine = TransformersEngine(config)
        tokens_out, ttfts, decode_ms, decode_tokens = [], [], 0.0, 0
        for q in tqdm(questions, desc=f"precision {dtype}", unit="req"):
            ids = _ids(engine.tokenizer, [{"role": "user", "content": q}])
            seq = engine.new_sequence()
            start = time.perf_counter()
            token = int(engine.prefill(seq, ids).argmax())
            ttfts.append((time.perf_counter() - start) * 1000)
            out = [token]
            start = time.perf_counter()
            while len(out) < max_tokens and token not in engine.eos_token_ids:
                token = int(engine.decode_step(seq, token).argmax())
                out.append(token)
            decode_ms += (time.perf_counter() - start) * 1000
            decode_tokens += len(out) - 1
            tokens_out.append(out)
        outputs[dtype] = tokens_out
        reference = outputs["float32"]
        same = sum(a == b for a, b in zip(reference, tokens_out))
        # Teacher-forced: fed float32's own output, how often is this mode's next token the same?
        agree = total = 0
        for q, ref in zip(questions, reference):
            ids = _ids(engine.tokenizer, [{"role": "user", "content": q}])
            seq = engine.new_sequence()
            first = int(engine.prefill(seq, ids).argmax())
            predicted = [first, *engine.score(seq, ref[:-1]).argmax(-1).tolist()] if len(ref) > 1 else [first]
            agree += sum(int(p == r) for p, r in zip(predicted, ref))
            total += len(ref)
        points.append({
            "dtype": dtype,
            "ttft_p50_ms": summary(ttfts)["p50"],
            "decode_tokens_per_s": round(decode_tokens / (decode_ms / 1000), 1) if decode_ms else None,
            "greedy_identical_rate": round(same / len(questions), 3),
            "teacher_forced_top1_agreement": round(agree / total, 3),
        })
        print(points[-1], flush=True)
        del engine
    return points


def _prefix(requests: int | None, max_tokens: int, quick: bool) -> dict:
    from engines.transformers_engine import TransformersEngine

    config = load_serve_config(CPU_EXACT_CONFIG).args.target.engine
    off_config = config.model_copy(deep=True)
    off_config.prefix_cache.enabled = False
    engines = {"on": TransformersEngine(config), "off": TransformersEngine(off_config)}
    tokenizer = engines["on"].tokenizer
    questions = QUESTIONS[: requests or (6 if quick else len(QUESTIONS))]

    workloads: dict[str, list[list[int]]] = {
        "shared_system_prompt": [_ids(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]) for q in questions]
    }
    results: dict[str, dict] = {}
    identical = True
    total = len(questions) + len(TURNS[: 4 if quick else len(TURNS)])
    bar = tqdm(total=2 * total, desc="prefix cache off/on", unit="req")
    for name, prompts in workloads.items():
        ttft: dict[str, list[float]] = {"on": [], "off": []}
        for i, ids in enumerate(prompts):
            texts = {}
            for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):  # alternate who goes first
                ms, texts[mode] = _generate(engines[mode], ids, max_tokens)
                ttft[mode].append(ms)
                bar.update()
            identical &= texts["on"] == texts["off"]
        results[name] = {"prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1), **_pair(ttft)}

    # Multi-turn: each turn's prompt holds every earlier turn and the model's own answer to it.
    ttft = {"on": [], "off": []}
    history: list[dict[str, str]] = [{"role": "system", "content": "You are a friendly, concise assistant."}]
    lengths = []
    for i, turn in enumerate(TURNS[: 4 if quick else len(TURNS)]):
        history.append({"role": "user", "content": turn})
        ids = _ids(tokenizer, history)
        lengths.append(len(ids))
        texts = {}
        for mode in ("on", "off") if i % 2 == 0 else ("off", "on"):
            ms, texts[mode] = _generate(engines[mode], ids, 48)
            ttft[mode].append(ms)
            bar.update()
        identical &= texts["on"] == texts["off"]
        history.append({"role": "assistant", "content": texts["off"]})
    bar.close()
    results["multi_turn"] = {"prompt_tokens_mean": round(sum(lengths) / len(lengths), 1), **_pair(ttft)}

    cache = engines["on"].prefix_cache
    shared = results["shared_system_prompt"]
    return {
        "identical": identical,
        "prefix": {
            "workload": "shared_system_prompt",
            "ttft_p50_ms_off": shared["ttft_p50_ms_off"],
            "ttft_p50_ms_on": shared["ttft_p50_ms_on"],
            "speedup_p50": shared["speedup_p50"],
            "hit_rate": round(cache.hit_rate, 3),
            "workloads": results,
            "cache": cache.stats(),
        },
        "config": {"max_tokens": max_tokens, "block_size": cache.block_size, "dtype": config.dtype},
    }


def _pair(ttft: dict[str, list[float]]) -> dict:
    """p50/p99 per mode; every request counts, the first (a cold miss for both) too."""
    s_on, s_off = summary(ttft["on"]), summary(ttft["off"])
    return {
        "ttft_p50_ms_off": s_off["p50"],
        "ttft_p99_ms_off": s_off["p99"],
        "ttft_p50_ms_on": s_on["p50"],
        "ttft_p99_ms_on": s_on["p99"],
        "speedup_p50": round(s_off["p50"] / s_on["p50"], 2) if s_on["p50"] else None,
    }


def _batching(service, quick: bool) -> list[dict]:
    from engines.types import GenerateRequest, SamplingParams

    batch_size = service.max_batch
    tokenizer = service.engine.tokenizer
    prompts = [_ids(tokenizer, [{"role": "user", "content": f"{q} Answer in detail."}]) for q in QUESTIONS]
    max_tokens = 32 if quick else 64

    async def one(i: int, itl: list[float]) -> int:
        request = GenerateRequest(f"b{i}", prompts[i % len(prompts)], SamplingParams(max_tokens=max_tokens, temperature=0.0))
        last, tokens = None, 0
        async for chunk in service.generate(request):
            now = time.perf_counter()
            if last is not None and chunk.num_tokens:
                itl.extend([(now - last) * 1000 / chunk.num_tokens] * chunk.num_tokens)
            last, tokens = now, tokens + chunk.num_tokens
        return tokens

    async def point(concurrency: int) -> dict:
        itl: list[float] = []
        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, itl) for i in range(concurrency))))
        wall = time.perf_counter() - start
        return {"tokens_per_s": round(tokens / wall, 1), "itl_p50_ms": summary(itl)["p50"], "tokens": tokens}

    chooser = service.step_mode
    points = []
    for concurrency in (1, 2, 3, 4, 16):
        for mode in ("off", "always", "chosen") if concurrency > 1 else ("off", "chosen"):
            service.max_batch = 1 if mode == "off" else batch_size
            service.step_mode = chooser if mode == "chosen" else None
            result = asyncio.run(point(concurrency))
            points.append({"concurrency": concurrency, "mode": mode, "batching": mode != "off", **result})
            print(points[-1], flush=True)
    service.max_batch, service.step_mode = batch_size, chooser
    return points
