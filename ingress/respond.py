"""The response: a whole answer as JSON, a stream as server-sent events, or a cached answer
replayed; its headers (what routing, admission and the cache did); and what a complete answer
leaves behind: admission learns the model's speed, the slot goes to the next request, the
cache stores it, telemetry records it. A stream's slot is freed when the model finishes, not
after a slow reader has taken the rest."""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse, Response, StreamingResponse

from admission.policy import AdmissionPolicy
from configs.schemas import AppArgs
from engines.types import GenerateChunk
from ingress.accounting import Record, RequestAccounting
from ingress.cache_client import CacheClient, CacheState
from ingress.errors import APIError
from ingress.model_calls import Call, ModelCalls, ReplicaFailed
from ingress.placement import Admitted
from ingress.prepare import Prepared
from ingress.responses import SSEWriter, full_response
from router.base import RouteDecision
from semantic_cache.cache import Lookup


class Responder:
    def __init__(
        self, args: AppArgs, calls: ModelCalls, cache: CacheClient, admission: AdmissionPolicy,
        accounting: RequestAccounting, served_by: str = "",
    ) -> None:
        self.args = args
        self.calls = calls
        self.cache = cache
        self.admission = admission
        self.accounting = accounting
        self.served_by = served_by  # this ingress replica and its node (x-ingress-replica)

    async def generated(
        self, p: Prepared, rec: Record, admitted: Admitted, cache: CacheState, call: Call, first: GenerateChunk
    ) -> Response:
        """The whole answer as JSON, or a stream whose SSE body owns the model call from here."""
        headers = self.headers(p, rec)
        if first.replica:
            headers["x-model-replica"] = first.replica
        if call.coalesced:
            headers["x-coalesced"] = "true"
        if not p.stream:
            try:
                text, last = await self.calls.collect(first, call, p)
            except ReplicaFailed as err:  # nothing was sent yet: the whole answer can be redone
                first = await self.calls.retry(call, p, err)
                text, last = await self.calls.collect(first, call, p)
            if call.retried:
                headers["x-retried"] = "1"
            if rec.cache in ("verified", "hint"):
                headers["x-cache-accepted"] = _accepted(last)
            call.stream = None  # finished: nothing left to cancel
            rec.clock.stage("decode")
            self._done(p, admitted, cache, call, text, last)
            self.accounting.ended(rec, last, 200)
            rec.clock.stage("respond")
            headers["server-timing"] = rec.clock.server_timing()
            body = full_response(
                p.kind, p.response_id, call.model_id, text, last.finish_reason or "stop",
                last.prompt_tokens, last.completion_tokens, call.logprobs, tools=p.tools is not None,
            )
            return JSONResponse(body, headers=headers)
        if call.retried:
            headers["x-retried"] = "1"
        rec.clock.stage("respond")
        headers["server-timing"] = rec.clock.server_timing()  # a stream's headers leave with its first token
        if rec.trace is not None:
            rec.trace.stream_from = call.first_at
        rec.streaming = True
        body_iter = self._sse(p, rec, admitted, cache, call, first)  # from here on it owns the call and the slot
        head = await body_iter.__anext__()  # started: its `finally` now runs even if nobody reads on
        return StreamingResponse(_prepend(head, body_iter), media_type="text/event-stream", headers=headers)

    def cached(self, p: Prepared, rec: Record, found: Lookup) -> Response:
        """A cache hit, answered now: whole, or replayed as a stream in word-sized pieces."""
        hit = found.response
        assert hit is not None
        rec.decision, rec.cache = RouteDecision(hit.model_id, "cache"), "hit"
        headers = self.headers(p, rec)
        headers["x-cache-match"] = f"{found.reason};score={found.score or 0:.3f}"
        rec.clock.stage("respond")
        headers["server-timing"] = rec.clock.server_timing()
        if not p.stream:
            body = full_response(
                p.kind, p.response_id, hit.model_id, hit.text, hit.finish_reason, hit.prompt_tokens, hit.completion_tokens,
                tools=p.tools is not None,
            )
            return JSONResponse(body, headers=headers)

        async def replay() -> AsyncIterator[bytes]:
            writer = SSEWriter(p.kind, p.response_id, hit.model_id, tools=p.tools is not None)
            for piece in _pieces(hit.text, self.args.cache.replay_chunk_words):
                yield writer.delta(piece)
            yield writer.delta("", hit.finish_reason)
            if p.include_usage:
                yield writer.usage(hit.prompt_tokens, hit.completion_tokens)
            yield writer.done()

        return StreamingResponse(replay(), media_type="text/event-stream", headers=headers)

    def headers(self, p: Prepared, rec: Record) -> dict[str, str]:
        echo = {"x-request-id": p.ctx.client_request_id} if p.ctx.client_request_id else {}
        return {
            **echo,
            "x-cache": rec.cache,
            "x-route": rec.decision.header() if rec.decision is not None else "",
            "x-slo-tier": p.ctx.tier,
            **({"x-ingress-replica": self.served_by} if self.served_by else {}),
            **dict(p.notes),
            **rec.notes,
        }

    async def _sse(
        self, p: Prepared, rec: Record, admitted: Admitted, cache: CacheState, call: Call, first: GenerateChunk
    ) -> AsyncIterator[bytes]:
        writer = SSEWriter(p.kind, p.response_id, call.model_id, tools=p.tools is not None)
        parts: list[str] = []
        chunk = first
        finished = False
        failed = False
        last_at = call.first_at
        try:
            yield writer.delta(chunk.text, logprobs=chunk.logprobs)
            parts.append(chunk.text)
            while chunk.finish_reason is None:
                try:
                    chunk = await self.calls.next(call, p)
                except APIError as err:
                    failed = True
                    yield writer.error(err.message, err.code or "backend_error")
                    yield writer.done()
                    return
                last_at = self.calls.token_gap(call, chunk, last_at)
                if chunk.finish_reason is not None:
                    break
                if chunk.text or chunk.logprobs:
                    parts.append(chunk.text)
                    yield writer.delta(chunk.text, logprobs=chunk.logprobs)
            # The model is done: its slot goes to the next request now, not after a slow reader
            # has taken the rest, and the complete answer is cached whether or not it is read.
            finished = True
            tail = chunk.text if chunk is not first else ""  # the first chunk's text went out above
            parts.append(tail)
            self._done(p, admitted, cache, call, "".join(parts), chunk)
            tail_logprobs = chunk.logprobs if chunk is not first else None
            if tail or tail_logprobs:
                yield writer.delta(tail, logprobs=tail_logprobs)
            yield writer.delta("", chunk.finish_reason)
            if p.include_usage:
                yield writer.usage(chunk.prompt_tokens, chunk.completion_tokens)
            yield writer.done()
        finally:
            admitted.permit.release()
            if not finished:
                call.cancel()  # the client left: stop the model within one step
                if not failed:
                    self.learn_cut_short(admitted, call)
            # 200 went out with the headers; a stream cut short is a 503 (backend) or 499 (client gone).
            self.accounting.ended(rec, chunk if finished else None, 200 if finished else 503 if failed else 499)

    def _done(
        self, p: Prepared, admitted: Admitted, cache: CacheState, call: Call, text: str, last: GenerateChunk
    ) -> None:
        """A complete answer: admission learns from it, its slot is freed, the cache stores it."""
        self._learn(admitted, call, last)
        admitted.permit.release()
        self.cache.store(p, cache, call.model_id, text, last, shared=call.coalesced)

    def learn_cut_short(self, admitted: Admitted | None, call: Call | None) -> None:
        """An answer its client left mid-way still measured the model's steps so far: under a
        flood of long answers whose clients give up, no other request finishes to teach admission
        the speed at that load."""
        if admitted is not None and call is not None and call.last is not None:
            self._learn(admitted, call, call.last, cut_short=True)

    def _learn(self, admitted: Admitted, call: Call, last: GenerateChunk, cut_short: bool = False) -> None:
        """A complete answer teaches admission how long this model takes (coalesced followers
        and fifo requests don't: they measure someone else's generation, or no slot)."""
        if admitted.ticket is None or call.coalesced or call.retried:
            return
        end = call.last_at if cut_short else time.perf_counter()  # cut short: up to its last chunk
        self.admission.observe(
            admitted.ticket,
            ttft_ms=(call.first_at - admitted.at) * 1000,
            queue_ms=call.engine_queue_ms,
            prefill_ms=call.prefill_ms,
            completion_tokens=last.completion_tokens,
            total_ms=(end - admitted.at) * 1000,
            chunks=call.decode_chunks,
            reused_tokens=call.reused_tokens,
            cut_short=cut_short,
        )


def _accepted(last: GenerateChunk) -> str:
    """How much of a cached answer offered as a draft the model kept: `accepted/proposed`
    tokens, and the answer's length."""
    accepted = int(last.timings_ms.get("spec_hint_accepted", 0))
    proposed = int(last.timings_ms.get("spec_hint_proposed", 0))
    return f"accepted={accepted};proposed={proposed};completion_tokens={last.completion_tokens}"


def _pieces(text: str, words: int) -> list[str]:
    """A cached answer cut into stream-sized pieces (whitespace kept, so they join back exactly)."""
    tokens = re.findall(r"\s*\S+", text)
    pieces = ["".join(tokens[i : i + words]) for i in range(0, len(tokens), words)]
    tail = text[len("".join(pieces)):]
    if tail:
        pieces.append(tail)
    return pieces or [text]


async def _prepend(head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield head
    async for item in rest:
        yield item
