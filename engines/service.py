"""Async front of an engine: one worker thread, many concurrent streaming requests.

torch releases the GIL in its kernels, but two forward passes at once on a 2-core box only
thrash. So every forward pass of this replica runs on ONE worker thread; requests take
turns step by step (round-robin through the executor's FIFO), and the event loop stays
free for new requests, health checks and cancellations.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from configs.schemas import EngineConfig
from engines.base import Engine
from engines.generation import Generation
from engines.transformers_engine import build_engine
from engines.types import GenerateChunk, GenerateRequest, SamplingParams

log = logging.getLogger(__name__)


class EngineStats:
    """Counters a test or the admission controller can read off a replica."""

    def __init__(self) -> None:
        self.requests_started = 0
        self.requests_finished = 0
        self.requests_cancelled = 0
        self.tokens_generated = 0
        self.forward_passes = 0
        self.active = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


class ModelService:
    def __init__(self, config: EngineConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine or build_engine(config)
        self.stats = EngineStats()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{config.model_id}")
        if config.warmup:
            self._warmup()

    def _warmup(self) -> None:
        """Pay first-call costs (allocator, kernel selection) before real traffic arrives."""
        start = time.monotonic()
        ids = self.engine.tokenizer.encode("Warm up the engine with a short prompt.")
        gen = Generation(self.engine, GenerateRequest("warmup", ids, SamplingParams(max_tokens=4, temperature=0.0)))
        gen.prefill()
        while not gen.finished:
            gen.step()
        log.info("%s warm in %.2f s", self.config.model_id, time.monotonic() - start)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream chunks for one request. Cancelling the consumer stops it within one step."""
        loop = asyncio.get_running_loop()
        enqueued = time.perf_counter()
        self.stats.requests_started += 1
        self.stats.active += 1
        gen = Generation(self.engine, request)
        finished = False
        try:
            if request.deadline_unix is not None and time.time() > request.deadline_unix:
                finished = True
                yield GenerateChunk("", 0, "abort", len(request.prompt_token_ids), 0, {"deadline_expired": 1.0})
                return
            chunk = await loop.run_in_executor(self._executor, self._timed_prefill, gen, enqueued)
            while True:
                self.stats.forward_passes += 1
                self.stats.tokens_generated += chunk.num_tokens
                if chunk.finish_reason is not None:
                    finished = True
                    yield chunk
                    return
                yield chunk
                chunk = await loop.run_in_executor(self._executor, gen.step)
        finally:
            self.stats.active -= 1
            if finished:
                self.stats.requests_finished += 1
            else:
                self.stats.requests_cancelled += 1

    @staticmethod
    def _timed_prefill(gen: Generation, enqueued: float) -> GenerateChunk:
        queue_ms = (time.perf_counter() - enqueued) * 1000
        chunk = gen.prefill()
        chunk.timings_ms["engine_queue"] = queue_ms
        return chunk
