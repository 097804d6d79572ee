"""Build the engine an EngineConfig names, and the service a model stage runs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from configs.schemas import EngineConfig, ModelStageConfig
from engines.base import Engine

if TYPE_CHECKING:
    from draft.proposers import Proposer
    from engines.service import ModelService
    from engines.vllm_service import VLLMService


def build_service(config: ModelStageConfig, remote_draft: "Proposer | None" = None) -> "ModelService | VLLMService":
    """vLLM runs its own scheduler and speculation; every other engine runs under ModelService
    (our batching, prefix cache and speculative decoding)."""
    if config.engine.kind == "vllm":
        from engines.vllm_service import VLLMService

        return VLLMService(config)
    from engines.service import ModelService

    return ModelService(config, remote_draft=remote_draft)


def build_engine(config: EngineConfig) -> Engine:
    if config.kind == "transformers":
        from engines.transformers_engine import TransformersEngine

        return TransformersEngine(config)
    if config.kind == "llama_cpp":
        from engines.llamacpp_engine import LlamaCppEngine

        return LlamaCppEngine(config)
    if config.kind == "vllm":
        raise ValueError("a vllm engine is a whole service (engines/vllm_service.py), not a forward-pass engine")
    raise ValueError(f"unknown engine kind {config.kind!r}")
