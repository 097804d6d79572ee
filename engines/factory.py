"""Build the engine an EngineConfig names."""

from __future__ import annotations

from configs.schemas import EngineConfig
from engines.base import Engine


def build_engine(config: EngineConfig, share_cores: bool = False) -> Engine:
    """`share_cores`: host tuning's core sharing for a CPU engine (host_tuning/cores.py)."""
    if config.kind == "transformers":
        from engines.transformers_engine import TransformersEngine

        return TransformersEngine(config, share_cores)
    if config.kind == "llama_cpp":
        from engines.llamacpp_engine import LlamaCppEngine

        return LlamaCppEngine(config, share_cores)
    if config.kind == "vllm":
        raise ValueError("a vllm engine is a whole service (engines/vllm_service.py), not a forward-pass engine")
    raise ValueError(f"unknown engine kind {config.kind!r}")
