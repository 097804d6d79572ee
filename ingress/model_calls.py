"""Calls to a model replica for one request: start one (or follow an identical one already in
flight), take its chunks within the request's deadline, retry once where the replica died
before anything reached the client. Model failures become 503/504 `APIError`s here."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from configs.schemas import AppArgs
from engines.types import GenerateChunk, GenerateRequest
from ingress.coalescing import Flights
from ingress.errors import APIError, describe
from ingress.placement import Permit
from ingress.prepare import Prepared
from router.load import LoadTracker
from telemetry.metrics import RequestMetrics

log = logging.getLogger(__name__)


class ModelStream(Protocol):
    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...
    async def __anext__(self) -> GenerateChunk: ...
    def cancel(self) -> None: ...  # never raises: it runs in cleanup paths


# Ray's "the actor is gone" errors, by name so the ingress needs no Ray: RayActorError and its
# ActorDiedError, and ActorUnavailableError (unreachable, being replaced). Another way to a
# replica says so with a true `replica_gone` class attribute.
_REPLICA_GONE = {"RayActorError", "ActorDiedError", "ActorUnavailableError"}


def replica_gone(exc: BaseException) -> bool:
    return getattr(type(exc), "replica_gone", False) or any(cls.__name__ in _REPLICA_GONE for cls in type(exc).__mro__)


class ReplicaFailed(APIError):
    """The model replica failed under the request (a 503): safe to retry until output was sent."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(503, f"the model replica failed: {type(exc).__name__}", code="backend_error")
        self.replica_gone = replica_gone(exc)


@dataclass
class Call:
    """One request's call to a model, written by ModelCalls alone: the stream it reads, whether
    it follows an identical request's generation or was sent again, and what its chunks said."""

    model_id: str
    request: GenerateRequest  # what was sent
    permit: Permit  # the admission slot it runs under
    stream: ModelStream | None = None
    coalesced: bool = False  # follows an identical generation already in flight
    retried: bool = False  # a model replica died under it and it was sent again
    decode_chunks: int = 0  # chunks with tokens after the first: the engine steps it took
    logprobs: list | None = None  # a non-streamed answer's token log-probabilities, when asked
    engine_queue_ms: float = 0.0  # the model replica's queue, from its first chunk
    prefill_ms: float | None = None  # ... and its prefill
    reused_tokens: int = 0  # ... and the prompt tokens its prefix cache held
    first_at: float = 0.0  # perf_counter() at its first chunk
    last: GenerateChunk | None = None  # its latest chunk after the first...
    last_at: float = 0.0  # ... and perf_counter() when it came

    def cancel(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None


class ModelCalls:
    def __init__(self, args: AppArgs, backends, load: LoadTracker, metrics: RequestMetrics | None) -> None:
        self.args = args
        self.backends = backends
        self.load = load
        self.metrics = metrics
        self.flights = Flights()

    def start(self, model_id: str, request: GenerateRequest, p: Prepared, permit: Permit) -> Call:
        """Start generating, or join an identical generation already in flight (a follower adds
        no load to the model)."""
        call = Call(model_id, request, permit)
        # no-cache asks for a fresh answer: it neither reads the cache nor joins a flight.
        if p.cache_key is None or p.ctx.no_cache or not self.args.cache.coalesce or request.draft_hint_ids or p.reshaped:
            call.stream = self.backends.generate(model_id, request)
        else:
            call.stream, call.coalesced = self.flights.join(
                f"{model_id}:{p.cache_key}", lambda: self.backends.generate(model_id, request)
            )
        if not call.coalesced:
            permit.count_on(self.load, model_id)
        return call

    async def next(self, call: Call, p: Prepared) -> GenerateChunk:
        """The next chunk, within the request's remaining time; model failures become 503/504."""
        stream = call.stream
        assert stream is not None
        remaining = p.ctx.remaining_s(self.args.ingress.request_timeout_s)
        try:
            # asyncio.timeout, not wait_for: no task of its own for each token.
            async with asyncio.timeout(max(0.001, remaining)):
                return await stream.__anext__()
        except TimeoutError:
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

    def first(self, call: Call, chunk: GenerateChunk) -> None:
        """The first chunk arrived: the replica's queue and prefill, as it observed them. A
        prefill that waited for another engine's passes on the shared cores waited in a queue:
        its prefill is the compute alone, which is what admission learns a prompt token's cost from."""
        call.first_at = time.perf_counter()
        waited = chunk.timings_ms.get("prefill.cores_wait", 0.0)
        call.engine_queue_ms = chunk.timings_ms.get("engine_queue", 0.0) + waited
        prefill = chunk.timings_ms.get("prefill")
        call.prefill_ms = None if prefill is None else max(0.0, prefill - waited)
        call.reused_tokens = int(chunk.timings_ms.get("prefix_reused_tokens", 0))

    async def collect(self, first: GenerateChunk, call: Call, p: Prepared) -> tuple[str, GenerateChunk]:
        """The rest of a non-streamed answer: its text and its last chunk."""
        parts, chunk = [first.text], first
        call.logprobs = list(first.logprobs) if first.logprobs is not None else None
        last_at = time.perf_counter()
        while chunk.finish_reason is None:
            chunk = await self.next(call, p)
            last_at = self.token_gap(call, chunk, last_at)
            parts.append(chunk.text)
            if call.logprobs is not None and chunk.logprobs:
                call.logprobs.extend(chunk.logprobs)
        return "".join(parts), chunk

    def token_gap(self, call: Call, chunk: GenerateChunk, last_at: float) -> float:
        """Inter-token latency of a chunk, as the ingress saw it arrive; returns its arrival."""
        now = time.perf_counter()
        call.last, call.last_at = chunk, now
        if chunk.num_tokens:
            call.decode_chunks += 1
        if self.metrics is not None and chunk.num_tokens:
            self.metrics.tokens(call.model_id, now - last_at, chunk.num_tokens)
        return now if chunk.num_tokens else last_at

    async def retry(self, call: Call, p: Prepared, err: ReplicaFailed) -> GenerateChunk:
        """Once, and only when the replica died (a crash, a kill, a lost node) and nothing reached
        the client: an error the model raised itself would only repeat."""
        if call.retried or not err.replica_gone:
            raise err
        call.retried = True
        log.warning("model replica of %s died under request %s; retrying once", call.model_id, p.ctx.request_id)
        return await self.alone(call, p)

    async def alone(self, call: Call, p: Prepared) -> GenerateChunk:
        """Start this request's own generation (it followed another's, which ended for it)."""
        call.cancel()
        if call.coalesced:
            call.coalesced = False
            call.permit.count_on(self.load, call.model_id)
        call.stream = self.backends.generate(call.model_id, call.request)
        try:
            return await self.next(call, p)
        except BaseException:
            call.cancel()
            raise
