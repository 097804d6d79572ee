"""TargetModel and DraftModel: a model engine behind a streaming `generate`."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator

import torch
from ray import serve
from ray.serve.handle import DeploymentHandle

from configs.limits import MODEL_STAGES, check_model
from configs.schemas import HostTuningConfig, ModelStageConfig, TelemetryConfig
from deployments.channel import ChannelServer, offer, shut
from deployments.limits import own_max_ongoing_requests
from deployments.transport import over
from draft.remote import DraftSessions, RemoteDraft
from host_tuning.niceness import set_niceness
from target.service import ModelService, build_service
from engines.types import GenerateChunk, GenerateRequest, SamplingParams
from telemetry.metrics import EngineMetrics
from telemetry.tracing import ModelCallTrace, make_tracer

log = logging.getLogger(__name__)


class _ModelDeployment:
    async def __init__(
        self, args: dict, draft: DeploymentHandle | None = None, telemetry: dict | None = None,
        transport: str = "grpc", host_tuning: dict | None = None,
    ) -> None:
        config = ModelStageConfig.model_validate(args)
        own = own_max_ongoing_requests()
        if own is not None and own[0] in MODEL_STAGES:  # serve run: its YAML entry against its engine
            check_model(own[0], config, own[1])
        observe = TelemetryConfig.model_validate(telemetry or {})
        host = HostTuningConfig.model_validate(host_tuning or {})
        if host.model_level:
            set_niceness(host.model_level)  # the compute below the request path (Ray starts us at 15)
        remote = RemoteDraft(over(draft, transport)) if draft is not None else None
        self.service = build_service(config, remote, host)
        await self.service.warmup()
        self._model_id = config.engine.model_id
        self._tracer = make_tracer(observe.tracing, type(self).__name__)
        self._metrics = EngineMetrics(observe.metrics, self._model_id) if observe.metrics.enabled else None
        self._prefix_seen = {"query": 0, "hit": 0}
        try:
            self._replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self._replica_id = f"pid-{os.getpid()}"
        self._channel = None  # generate and late_hint on a Unix socket too, for ingresses on this node
        self._channel_streams = 0
        if host.channels:
            methods = {"generate": self._channel_generate, "late_hint": self.late_hint}
            self._channel = await ChannelServer(methods).start()

    async def channel(self) -> dict | None:
        """Where an ingress on this node can stream from this replica without the handle."""
        return offer(self._channel)

    def __del__(self):
        # Serve's graceful shutdown has drained the calls it saw; streams on the channel get
        # up to 15 s more to end whole (Serve's own default bound is 20 s in all).
        channel, self._channel = getattr(self, "_channel", None), None
        return shut(channel, drain_s=15.0)

    def _channel_generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        self._channel_streams += 1
        return self.generate(request)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        traced = ModelCallTrace(self._tracer, request.trace, self._model_id) if self._tracer and request.trace else None
        first = True
        last: GenerateChunk | None = None
        tokens = 0
        try:
            async for chunk in self.service.generate(request):
                if first:
                    chunk.replica, first = self._replica_id, False
                    if traced is not None:
                        traced.first_chunk(chunk.timings_ms)
                tokens += chunk.num_tokens
                last = chunk
                if traced is not None and chunk.finish_reason is not None:
                    traced.last_chunk()  # decode ends here, not when the generator is next resumed
                yield chunk
        finally:
            done = last is not None and last.finish_reason is not None
            try:  # telemetry never fails a generation, nor its cancellation
                self._record(last if done else None)
                if traced is not None:
                    traced.finish(tokens, last.timings_ms if done else {}, last.finish_reason if done else "cancelled")
            except Exception as exc:
                log.debug("telemetry failed: %r", exc)

    def _record(self, last: GenerateChunk | None) -> None:
        """Speculation and prefix-cache counters onto Ray's Prometheus endpoint."""
        if self._metrics is None:
            return
        if last is not None:
            self._metrics.speculation(
                int(last.timings_ms.get("spec_proposed", 0)), int(last.timings_ms.get("spec_accepted", 0))
            )
        cache = getattr(self.service.engine, "prefix_cache", None)
        if cache is None:
            return
        delta = {}
        for name, total in (("query", cache.query_tokens), ("hit", cache.hit_tokens)):
            delta[name], self._prefix_seen[name] = total - self._prefix_seen[name], total
        self._metrics.prefix_cache(delta["query"], delta["hit"])

    async def late_hint(self, request_id: str, hint_ids: list[int]) -> bool:
        """A near-miss draft for a request that started before its cache lookup returned."""
        return self.service.late_hint(request_id, hint_ids)

    async def stats(self) -> dict[str, float]:
        return {**self.service.snapshot(), "generate_by_channel": self._channel_streams}


# Defaults as in serve_config.yaml, so a file without this deployments entry fits configs/limits.py.
@serve.deployment(name="TargetModel", max_ongoing_requests=32, max_queued_requests=64)
class TargetModel(_ModelDeployment):
    pass


# Defaults as in serve_config.yaml, so a file without this deployments entry fits configs/limits.py.
@serve.deployment(name="DraftModel", max_ongoing_requests=32, max_queued_requests=64)
class DraftModel(_ModelDeployment):
    """The small model: serves whole routed requests, and drafts for remote speculation."""

    async def __init__(self, args: dict, telemetry: dict | None = None, host_tuning: dict | None = None) -> None:
        await super().__init__(args, telemetry=telemetry, host_tuning=host_tuning)
        # Remote drafting drives the engine's forward passes: CPU engines only (a vLLM target
        # speculates inside vLLM, see configs/schemas.py).
        self.sessions = DraftSessions(self.service.engine) if isinstance(self.service, ModelService) else None

    async def propose(
        self, session_id: str, context: list[int], k: int, params: SamplingParams, seed: int, salt: int = 0
    ) -> tuple[list[int], torch.Tensor | None, float]:
        if self.sessions is None:
            return [], None, 0.0  # no draft here: the target decodes without one
        loop = asyncio.get_running_loop()
        # The same worker thread as generate(): one forward pass at a time in this replica.
        proposal = await loop.run_in_executor(
            self.service.executor, self.sessions.propose, session_id, context, k, params, seed, salt
        )
        return proposal.tokens, proposal.probs, proposal.marginal_ms

    async def end(self, session_id: str) -> None:
        if self.sessions is not None:
            await asyncio.get_running_loop().run_in_executor(self.service.executor, self.sessions.end, session_id)

    async def stats(self) -> dict[str, float]:
        if self.sessions is None:
            return await super().stats()
        return {
            **(await super().stats()),
            "draft_sessions_recomputed": self.sessions.recomputed,
            "draft_sessions_open": len(self.sessions),  # 0 when idle: every request ends its session
            "draft_proposals": self.sessions.proposals,
        }
