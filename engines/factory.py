"""Build the engine an EngineConfig names."""

from __future__ import annotations

from configs.schemas import EngineConfig
from engines.base import Engine


def build_engine(config: EngineConfig) -> Engine:
    if config.kind == "transformers":
        from engines.transformers_engine import TransformersEngine

        return TransformersEngine(config)
    if config.kind == "llama_cpp":
        from engines.llamacpp_engine import LlamaCppEngine

        return LlamaCppEngine(config)
    raise ValueError(f"unknown engine kind {config.kind!r}")
