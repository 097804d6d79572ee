"""Calls to a model replica for one request: start one (or follow an identical one already in
flight), take its chunks within the request's deadline, retry once where the replica died
before anything reached the client. Model failures become 503/504 `APIError`s here."""

from __future__ import annotations

import asyncio
import logging
import time

from configs.schemas import AppArgs
from engines.types import GenerateChunk, GenerateRequest
from ingress.coalescing import Flights
from ingress.errors import APIError, describe
from ingress.inflight import ModelStream, Permit, ReplicaFailed
from ingress.prepare import Prepared, reshaped
from router.load import LoadTracker
from telemetry.metrics import RequestMetrics

log = logging.getLogger(__name__)


class ModelCalls:
    def __init__(self, args: AppArgs, backends, load: LoadTracker, metrics: RequestMetrics | None) -> None:
        self.args = args
        self.backends = backends
        self.load = load
        self.metrics = metrics
        self.flights = Flights()

    def start(self, model_id: str, request: GenerateRequest, p: Prepared, permit: Permit) -> ModelStream:
        """Start generating, or join an identical generation already in flight (a follower adds
        no load to the model)."""
        # no-cache asks for a fresh answer: it neither reads the cache nor joins a flight.
        if (
            p.cache_key is None or p.ctx.no_cache or not self.args.cache.coalesce or request.draft_hint_ids
            or reshaped(p)
        ):
            stream = self.backends.generate(model_id, request)
        else:
            stream, p.coalesced = self.flights.join(
                f"{model_id}:{p.cache_key}", lambda: self.backends.generate(model_id, request)
            )
        if not p.coalesced:
            permit.count_on(self.load, model_id)
        return stream

    async def next(self, stream: ModelStream, p: Prepared) -> GenerateChunk:
        """The next chunk, within the request's remaining time; model failures become 503/504."""
        remaining = p.ctx.remaining_s(self.args.ingress.request_timeout_s)
        try:
            return await asyncio.wait_for(stream.__anext__(), timeout=max(0.001, remaining))
        except asyncio.TimeoutError:
            stream.cancel()
            raise APIError(504, "the request's deadline passed while generating", code="deadline_exceeded") from None
        except StopAsyncIteration:
            raise APIError(503, "the model stream ended without finishing", code="backend_error") from None
        except APIError:
            raise
        except Exception as exc:
            stream.cancel()
            log.warning("model call failed: %s", describe(exc, with_message=self.args.ingress.log_prompts))
            raise ReplicaFailed(exc) from None

    async def collect(self, first: GenerateChunk, stream: ModelStream, p: Prepared) -> tuple[str, GenerateChunk]:
        """The rest of a non-streamed answer: its text and its last chunk."""
        parts, chunk = [first.text], first
        p.logprobs = list(first.logprobs) if first.logprobs is not None else None
        last_at = time.perf_counter()
        while chunk.finish_reason is None:
            chunk = await self.next(stream, p)
            last_at = self.token_gap(p, chunk, last_at)
            parts.append(chunk.text)
            if p.logprobs is not None and chunk.logprobs:
                p.logprobs.extend(chunk.logprobs)
        return "".join(parts), chunk

    def token_gap(self, p: Prepared, chunk: GenerateChunk, last_at: float) -> float:
        """Inter-token latency of a chunk, as the ingress saw it arrive; returns its arrival."""
        now = time.perf_counter()
        if chunk.num_tokens:
            p.decode_chunks += 1
        if self.metrics is not None and chunk.num_tokens:
            self.metrics.tokens(p.model, now - last_at, chunk.num_tokens)
        return now if chunk.num_tokens else last_at

    async def retry(
        self, p: Prepared, model_id: str, request: GenerateRequest, permit: Permit, err: ReplicaFailed
    ) -> tuple[ModelStream, GenerateChunk]:
        """Once, and only when the replica died (a crash, a kill, a lost node) and nothing reached
        the client: an error the model raised itself would only repeat."""
        if p.retried or not err.replica_gone:
            raise err
        p.retried = True
        log.warning("model replica of %s died under request %s; retrying once", model_id, p.ctx.request_id)
        return await self.alone(p, model_id, request, permit)

    async def alone(
        self, p: Prepared, model_id: str, request: GenerateRequest, permit: Permit
    ) -> tuple[ModelStream, GenerateChunk]:
        """Start this request's own generation (it followed another's, which ended for it)."""
        if p.coalesced:
            p.coalesced = False
            permit.count_on(self.load, model_id)
        stream = self.backends.generate(model_id, request)
        try:
            return stream, await self.next(stream, p)
        except BaseException:
            stream.cancel()
            raise
