"""TargetModel and DraftModel: a model engine behind a streaming `generate`."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import torch
from ray import serve
from ray.serve import metrics
from ray.serve.handle import DeploymentHandle

from configs.schemas import ModelStageConfig
from draft.remote import DraftSessions, RemoteDraft
from engines.service import ModelService
from engines.types import GenerateChunk, GenerateRequest, SamplingParams


class _ModelDeployment:
    def __init__(self, args: dict, draft: DeploymentHandle | None = None) -> None:
        config = ModelStageConfig.model_validate(args)
        if config.engine.nice:
            os.nice(config.engine.nice)  # this replica's own process: the ingress and proxy keep their priority
        remote = RemoteDraft(draft) if draft is not None else None
        self.service = ModelService(config, remote_draft=remote)
        self._model_tag = {"model": config.engine.model_id}
        # Prefix-cache tokens on Ray's Prometheus endpoint: hit rate = hit / query.
        self._prefix_counters = {
            name: metrics.Counter(f"llm_prefix_cache_{name}_tokens", description=text, tag_keys=("model",))
            for name, text in (("query", "Prompt tokens looked up in the prefix KV cache"),
                               ("hit", "Prompt tokens whose KV came from the prefix cache"))
        }
        self._prefix_seen = {"query": 0, "hit": 0}
        try:
            self._replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self._replica_id = f"pid-{os.getpid()}"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        first = True
        try:
            async for chunk in self.service.generate(request):
                if first:
                    chunk.replica, first = self._replica_id, False
                yield chunk
        finally:
            self._export_prefix_counts()

    def _export_prefix_counts(self) -> None:
        cache = getattr(self.service.engine, "prefix_cache", None)
        if cache is None:
            return
        for name, total in (("query", cache.query_tokens), ("hit", cache.hit_tokens)):
            delta, self._prefix_seen[name] = total - self._prefix_seen[name], total
            if delta > 0:
                self._prefix_counters[name].inc(delta, tags=self._model_tag)

    async def stats(self) -> dict[str, float]:
        return self.service.snapshot()


@serve.deployment(name="TargetModel")
class TargetModel(_ModelDeployment):
    pass


@serve.deployment(name="DraftModel")
class DraftModel(_ModelDeployment):
    """The small model: serves whole routed requests, and drafts for remote speculation."""

    def __init__(self, args: dict) -> None:
        super().__init__(args)
        self.sessions = DraftSessions(self.service.engine)

    async def propose(
        self, session_id: str, context: list[int], k: int, params: SamplingParams, seed: int
    ) -> tuple[list[int], torch.Tensor | None, float]:
        loop = asyncio.get_running_loop()
        # The same worker thread as generate(): one forward pass at a time in this replica.
        proposal = await loop.run_in_executor(
            self.service.executor, self.sessions.propose, session_id, context, k, params, seed
        )
        return proposal.tokens, proposal.probs, proposal.marginal_ms

    async def end(self, session_id: str) -> None:
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.service.executor, self.sessions.end, session_id)

    async def stats(self) -> dict[str, float]:
        return {
            **self.service.snapshot(),
            "draft_sessions_recomputed": self.sessions.recomputed,
            "draft_sessions_open": len(self.sessions),  # 0 when idle: every request ends its session
            "draft_proposals": self.sessions.proposals,
        }
