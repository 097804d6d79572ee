"""One request, top to bottom. Read this file to follow a request through the service.

    HTTP body ─► validate (400/413), cache key
              ─► a repeat this replica answered lately: answer now (no tokenizer, no hop)
              ─► cache lookup ║ tokenize once (400 if it can't fit) ║ routing
                   lookup = one hop to the SemanticCache: exact match;
                            on a miss, the MiniLM embedding (made there, once per request) and
                            the Qdrant search
                   routing = rules, then the difficulty classifier on the embedding the lookup
                             brought back, its threshold shifted by live load (in-process)
              ─► tenant rate limits (429 + Retry-After), in-process
              ─► hit: answer now (x-cache: hit), taking no admission slot; a semantic match
                 (semantic.mode verify) is checked by the model as a draft (x-cache: verified)
              ─► admission, in-process, no hop: start, queue (EDF within tier), downgrade
                 to the small model, or shed (503 + Retry-After + the prediction)
              ─► near miss: its answer rides along as a speculative draft (x-cache: hint);
                 miss: generate
              ─► identical requests already in flight share that generation (single-flight)
              ─► stream from the model; a model replica that dies before anything reached
                 the client is retried once (Serve sends it to a live or replacement replica)
              ─► cache write, after a complete answer, off the request path

Every wait has a timeout derived from the request's deadline. The cache and the router
degrade (miss / default route) instead of failing the request.

Each step closes a stage on the request's StageClock (parse, tokenize, admit, lookup, route,
queue, hop / engine_queue / prefill, decode, respond): the same intervals become the
`Server-Timing` header, the stage-duration metric and, when tracing is on, the request's spans.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from admission.errors import AdmissionError
from admission.gate import AdmissionGate, Ticket
from admission.model_choice import MOVES, ModelChoice
from admission.policy import AdmissionPolicy
from admission.request import RequestContext
from configs.schemas import AppArgs
from engines.types import ENGINE_QUEUE_COUNTS, GenerateChunk, GenerateRequest
from host_tuning.lookup_window import LookupWindow
from ingress import choices, embeddings
from ingress.auth import KeyRing
from ingress.coalescing import Flights
from ingress.context import context_from_headers
from ingress.errors import APIError, bad_request, describe, from_admission
from ingress.prepare import INLINE_TOKENIZE_CHARS, Prepared, Preparer, grammar_cost
from ingress.prompts import PromptBuilder
from ingress.responses import Kind, SSEWriter, full_response
from router.base import RouteDecision, RouteFeatures
from router.factory import make_router
from router.load import LoadTracker
from router.rules import fixed_route
from semantic_cache.cache import CacheEntry, Lookup
from semantic_cache.exact import CachedResponse, ExactCache
from telemetry.clock import StageClock
from telemetry.metrics import SHED_REASONS, RequestMetrics
from telemetry.tracing import RequestTrace

log = logging.getLogger(__name__)


class ModelStream(Protocol):
    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...
    async def __anext__(self) -> GenerateChunk: ...
    def cancel(self) -> None: ...  # never raises: it runs in cleanup paths


class Embedder(Protocol):
    dimensions: int

    async def embed_async(self, text: str) -> Any: ...
    async def embed_many_async(self, texts: list[str]) -> Any: ...
    async def count_tokens_async(self, texts: list[str]) -> list[int]: ...
    def sibling(self) -> "Embedder": ...


class Backends(Protocol):
    """The other stages, as the ingress sees them (Ray handles in production)."""

    async def cache_lookup(self, key: str, scope: str | None, query: str | None) -> Lookup: ...
    def cache_store(self, entry: CacheEntry) -> None: ...
    def cache_verified(self, shard: str, entry_key: str, score: float, correct: bool) -> None: ...
    async def cache_invalidate(self, tenant: str) -> int: ...
    async def route(self, features: RouteFeatures) -> RouteDecision: ...
    def generate(self, model_id: str, request: GenerateRequest) -> ModelStream: ...
    def late_hint(self, model_id: str, request_id: str, hint_ids: list[int]) -> None: ...


# Characters per token, at most, of any text the tokenizer meets: a prompt's length divided by
# this is a floor of its tokens, charged before it is tokenized.
CHARS_PER_TOKEN_FLOOR = 8

# How often a request waiting for the router on an idle box checks that it still is.
RECHECK_S = 0.01


def _moved(p: Prepared, model_id: str, reason: str) -> RouteDecision:
    """The request leaves the model the router chose (admission/model_choice.py), saying why in
    its response headers."""
    p.notes["x-admission"] = MOVES[reason]
    return RouteDecision(model_id, reason)


class ReplicaFailed(APIError):
    """The model replica failed under the request (a 503): safe to retry until output was sent."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(503, f"the model replica failed: {type(exc).__name__}", code="backend_error")
        self.replica_gone = _replica_gone(exc)


class Permit:
    """An admission slot, released exactly once whoever gets there first."""

    def __init__(self, gate: AdmissionGate | None, ticket: Ticket | None = None) -> None:
        self._gate = gate
        self._ticket = ticket
        self._released = False
        self._also: list[Callable[[], None]] = []

    def also(self, callback: Callable[[], None]) -> None:
        """Run this on release too (the router's in-flight count of the model)."""
        self._also.append(callback)

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._gate is not None and self._ticket is not None:
                self._gate.release(self._ticket)
            for callback in self._also:
                callback()


@dataclass
class InFlight:
    """What one request has under way between the steps of `Pipeline._serve`."""

    lookup: asyncio.Future | None = None  # the cache lookup
    routing: asyncio.Future | None = None  # the router's verdict
    permit: Permit | None = None  # its admission slot
    stream: ModelStream | None = None  # the model call
    first_chunk: asyncio.Future | None = None
    decision: RouteDecision | None = None  # the model that answers, and why
    builder: PromptBuilder | None = None  # that model's prompt builder
    generate: GenerateRequest | None = None  # what was sent to it
    first_at: float = 0.0  # perf_counter() at its first chunk

    def call_off(self) -> None:
        """A cache hit beside the model call: stop the model, free the slot."""
        if self.first_chunk is not None:
            self.first_chunk.cancel()
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
        if self.permit is not None:
            self.permit.release()

    def abandon(self) -> None:
        """An error, a timeout or the client gone (CancelledError): free the slot, stop the model."""
        if self.permit is not None:
            self.permit.release()
        for pending in (self.lookup, self.routing, self.first_chunk):
            if pending is not None and not pending.done():
                pending.cancel()
        if self.stream is not None:
            self.stream.cancel()


class Pipeline:
    def __init__(
        self, args: AppArgs, backends: Backends, prompts: dict[str, PromptBuilder], embedder: Embedder | None = None
    ) -> None:
        self.args = args
        self.served_by = ""  # this ingress replica and its node (x-ingress-replica), set by its deployment
        self.backends = backends
        self.embedder = embedder  # the classifier's, for requests that skip the cache (the lookup brings one)
        self._embedder_loading: asyncio.Future[Embedder] | None = None  # /v1/embeddings, without a classifier
        self.flights = Flights()
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # Host tuning: a model call started beside the lookup leaves the lookup a core.
        self.lookup_window = LookupWindow(args.host_tuning.window)
        # L1: exact answers this replica served or wrote recently, so a repeat costs no hop.
        # The SemanticCache deployment stays the shared source of truth (L2).
        near = args.cache.model_copy(update={"max_entries": max(1, args.cache.near_entries), "ttl_s": args.cache.near_ttl_s})
        self.near_cache = ExactCache(near) if args.cache.near_entries > 0 else None
        self.prompts = prompts  # model id -> prompt builder ("auto" uses the target's)
        self.keys = KeyRing(args.auth, args.admission.tenants)
        self.admission = AdmissionPolicy(args.admission, own_buckets=self.keys.owners())
        self.preparer = Preparer(args, prompts, self.admission)
        self.gate = self.admission.gate
        # llama.cpp holds a fixed number of sequences per replica; the gate counts them.
        self.admission.set_seats({
            stage.engine.model_id: (deployment, stage.engine.max_sequences)
            for deployment, stage in (("TargetModel", args.target), ("DraftModel", args.draft))
            if stage.engine.kind == "llama_cpp"
        })
        self.ready = True  # the deployment sets False until its downstream stages answer
        large, small = args.target.engine.model_id, args.draft.engine.model_id
        # Built here even with placement: remote, to know which requests need the embedding.
        self.router = make_router(args.router, large, small)
        self.load = LoadTracker(args.router.load_aware, large, small)
        # Where an auto request runs, once the router has judged it (admission/model_choice.py).
        self.choice = ModelChoice(self.gate, large, small, args.host_tuning.small_from)
        # Models whose replicas draft from a request's hint (a semantic-cache near miss).
        self._hint_models = {
            stage.engine.model_id for stage in (args.target, args.draft)
            if stage.engine.kind != "vllm" and stage.speculative.method != "none" and stage.speculative.use_hints
        }
        mode = args.cache.semantic.mode
        if args.cache.enabled and args.cache.semantic.enabled and mode != "trust" and not self._hint_models:
            log.warning("cache.semantic.mode %s: no model here drafts from hints (vLLM, or speculation off), so "
                        "a semantic match is generated as a miss (and teaches nothing); exact hits are served as "
                        "before", mode)
        self.route_counts: dict[str, int] = {}  # "model/reason" -> requests
        self.cache_failures = 0  # lookups that failed or timed out and were served as misses
        self.stalled_readers: Callable[[], int] = lambda: 0  # responses cut for a reader that stopped reading
        # Set by the deployment (telemetry/): None records nothing, as in unit tests without Ray.
        self.metrics: RequestMetrics | None = None
        self.tracer = None  # an OpenTelemetry tracer when tracing is on

    # ------------------------------------------------------------------ entry points

    async def handle(self, request: Request, kind: Kind) -> Response:
        clock = StageClock()
        trace = None
        if self.tracer is not None:
            trace = RequestTrace(self.tracer, f"POST {request.url.path}", request.headers, clock)
        prepared: Prepared | None = None
        ctx: RequestContext | None = None
        response: Response | None = None
        shed: str | None = None
        try:
            if not self.ready:
                await self.wait_ready()
            ctx = context_from_headers(request.headers, self.keys.identify(request.headers))
            mode = self.admission.mode(request.headers)
            tier = self.admission.tier(ctx)
            if mode == "fifo":  # admission off: no deadlines, first come first served
                ctx.deadline = ctx.target_deadline = ctx.ttft_deadline = None
            body = await self.preparer.read_json(request)
            prepared = self.preparer.prepare(kind, body, ctx, tier, mode)
            prepared.clock, prepared.trace = clock, trace
            if prepared.grammar_param is not None:  # paid for before it is converted, refused or not
                self.admission.charge_work(ctx, grammar_cost(prepared.sampling.structured))
                await self.preparer.check_grammar(prepared)
            clock.stage("parse")
            if self.args.ingress.log_prompts:  # opt-in only: prompts are user data
                log.info("request %s tenant=%s %s: %s", ctx.request_id, ctx.tenant, kind, json.dumps(body)[:4000])
            n = prepared.request.n or 1
            response = await (self._serve(prepared) if n == 1 else choices.serve_choices(
                prepared, n, self._serve, self.admission.gate.max_inflight
            ))
            return response
        except (APIError, AdmissionError) as raised:
            err = from_admission(raised) if isinstance(raised, AdmissionError) else raised
            shed = err.code if err.code in SHED_REASONS else None
            response = err.response()
            response.headers["server-timing"] = clock.server_timing()  # a 4xx/503 says where its time went too
            if trace is not None and trace.sampled:
                trace.attributes["error.type"] = err.code
            return response
        except ClientDisconnect:
            response = Response(status_code=499)
            return response
        finally:
            self._account(prepared, ctx, clock, trace, response, shed)

    def _account(
        self, p: Prepared | None, ctx: RequestContext | None, clock: StageClock, trace: RequestTrace | None,
        response: Response | None, shed: str | None,
    ) -> None:
        """Metrics and spans for a request that got its response (a stream's end comes later,
        in _sse). Never raises: telemetry must not fail a request."""
        status = response.status_code if response is not None else 499  # None: cancelled (client gone)
        try:
            if trace is not None:
                if response is not None:
                    response.headers["traceresponse"] = trace.traceresponse()
                if p is not None:
                    trace.attributes.update({
                        "tenant.id": p.ctx.tenant, "slo.tier": p.ctx.tier, "gen_ai.request.model": p.requested_model,
                        "gen_ai.response.model": p.model or None, "route.reason": p.route or None,
                        "cache.result": p.cache_state, "gen_ai.usage.input_tokens": len(p.prompt_ids) or None,
                    })
                if shed is not None:
                    trace.attributes["admission.shed_reason"] = shed
                if p is None or not p.streaming:
                    trace.finish(status)
            if self.metrics is not None:
                tier = ctx.tier if ctx is not None else "none"
                model, route, cache = (p.model or "none", p.route or "none", p.cache_state) if p else ("none", "none", "none")
                self.metrics.request(model, route, cache, status, shed, tier)
                if p is None or not p.streaming:
                    self.metrics.stages(clock)
        except Exception as exc:
            log.debug("telemetry failed: %s", self._why(exc))

    async def invalidate(self, request: Request) -> Response:
        """DELETE /v1/cache: an admin key drops one tenant's cached answers: `?tenant=ID` (as
        `python -m admission.tenant KEY` prints it), else its own."""
        try:
            caller = self.keys.identify(request.headers)
            if not caller.admin:
                raise APIError(
                    403, "dropping cached answers needs an admin key (auth.admin_keys)", code="admin_key_required"
                )
            tenant = request.query_params.get("tenant") or context_from_headers(request.headers, caller).tenant
            if len(tenant) > 200:
                raise bad_request("tenant: at most 200 characters", "tenant")
            if self.near_cache is not None:
                self.near_cache.invalidate(tenant)
            dropped = await asyncio.wait_for(self.backends.cache_invalidate(tenant), self.args.ingress.stage_timeout_s)
        except APIError as err:
            return err.response()
        except Exception as exc:
            return APIError(503, f"the cache did not answer: {type(exc).__name__}", code="cache_unavailable").response()
        return JSONResponse({"object": "cache.invalidation", "tenant": tenant, "deleted": dropped})

    async def embeddings(self, request: Request) -> Response:
        """POST /v1/embeddings on MiniLM (ingress/embeddings.py): the caller's key and tenant
        rate limits as for a chat, the vectors made on the embedder's own thread."""
        try:
            if not self.ready:
                await self.wait_ready()
            ctx = context_from_headers(request.headers, self.keys.identify(request.headers))
            self.admission.precheck_tenant(ctx)
            body = await self.preparer.read_json(request)
            limits = self.args.ingress.limits
            req, texts = embeddings.parse(body, limits.max_embedding_inputs, limits.max_embedding_tokens,
                                           embeddings.DIMENSIONS)
            embedder = await self._api_embedder()
            counts = await embedder.count_tokens_async(texts)
            embeddings.check_lengths(counts, limits.max_embedding_tokens)
            self.admission.charge_tenant(ctx, sum(counts))
            parts = []
            for start in range(0, len(texts), embeddings.CHUNK):  # a client that left stops its job here
                if start and await request.is_disconnected():
                    return Response(status_code=499)
                parts.append(await embedder.embed_many_async(texts[start:start + embeddings.CHUNK]))
            loop = asyncio.get_running_loop()
            body_out = await loop.run_in_executor(None, lambda: JSONResponse(
                embeddings.response(np.concatenate(parts), req.encoding_format, sum(counts))
            ))
            return body_out
        except (APIError, AdmissionError) as raised:
            return (from_admission(raised) if isinstance(raised, AdmissionError) else raised).response()
        except ClientDisconnect:
            return Response(status_code=499)

    async def _api_embedder(self) -> Embedder:
        """A MiniLM on a thread of its own: an embeddings job never queues in front of the
        router's embedding of a chat request. The router's model on another thread where it
        runs here; else one loaded on the first embeddings call."""
        if self._embedder_loading is None and self.embedder is not None:
            self._embedder_loading = asyncio.ensure_future(
                asyncio.get_running_loop().run_in_executor(None, self.embedder.sibling)
            )
        if self._embedder_loading is None:
            from semantic_cache.embedder import Embedder as Loaded

            semantic = self.args.cache.semantic
            self._embedder_loading = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                None, lambda: Loaded(precision=semantic.embed_precision, runtime=semantic.embed_runtime)
            ))
        return await asyncio.shield(self._embedder_loading)

    async def wait_ready(self) -> None:
        """Before every stage answers: wait for it up to `ingress.warmup_wait_s`, then a 503
        that says so (never a deadline or load message: nothing is known of either yet).
        `/v1/models` waits too: a client that polls it before its first request (load tools
        do) would otherwise send that request ~1.3 s before the stages answer."""
        deadline = time.monotonic() + self.args.ingress.warmup_wait_s
        while not self.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.ready:
            raise APIError(
                503, "the service is warming up: its stages are loading; retry shortly", code="warming_up",
                headers={"Retry-After": "5"},
            )

    def forget_tenants(self, tenants: list[str | None]) -> None:
        """Invalidations made through another ingress replica: the near cache drops them too
        (None: everything)."""
        if self.near_cache is not None:
            for tenant in tenants:
                self.near_cache.invalidate(tenant)

    def authorize(self, request: Request) -> None:
        """A 401 (APIError) where keys are required and this request's is missing or unknown."""
        self.keys.identify(request.headers)

    def models(self) -> dict[str, Any]:
        now = int(time.time())
        ids = self.args.ingress.served_model_ids or list(self.preparer.max_model_len)
        return {
            "object": "list",
            "data": [{"id": m, "object": "model", "created": now, "owned_by": "latency-serve"} for m in ids],
        }

    # ------------------------------------------------------------------ 2. admit, look up, generate

    async def _serve(self, p: Prepared) -> Response:
        """The spine: a repeat → the lookup leaves, tokenize, tenant limits → shed the hopeless
        → look up ∥ route → admit and call the model → a hit beside it calls it off → the
        first token → respond (whole, or streamed). Whatever raises on the way (an error, a
        deadline, the client gone) lets go of everything in flight."""
        repeat = self._repeat(p)
        if repeat is not None:
            return repeat
        f = InFlight()
        try:
            await self._start(p, f)
            forced, tickets = self._shed_hopeless(p)
            decision, found = await self._lookup_and_route(p, f, forced, tickets)
            if decision is None:
                return self._cached(p, found)  # hits take no admission slot: served even at capacity
            await self._admit_and_call(p, f, decision, found)
            found = await self._lookup_beside(p, f)
            if found is not None and found.outcome == "hit":
                return self._cached(p, found)
            first = await self._first_token(p, f)
            return await self._respond(p, f, first)
        except BaseException:
            f.abandon()
            raise

    def _repeat(self, p: Prepared) -> Response | None:
        """A repeat this replica answered lately: no tokenizer, no admission slot, no hop."""
        if p.cache_key is None or p.ctx.no_cache or self.near_cache is None:
            return None
        near = self.near_cache.get(p.cache_key)
        if near is None:
            return None
        self.admission.charge_tenant(p.ctx, near.prompt_tokens + near.completion_tokens)
        p.clock.stage("lookup")
        return self._cached(p, Lookup("hit", near, 1.0, "exact_near"))

    async def _start(self, p: Prepared, f: InFlight) -> None:
        """The cache lookup leaves first; the prompt is tokenized while it flies, and charged to
        the tenant's rate (a tenant already over it costs no tokenizer pass)."""
        # Paid for before any of it is done: the request and a floor of its prompt's tokens now
        # (a request that ends in a 400 after tokenizing or a lookup is charged too), the rest
        # once the tokenizer has counted them.
        floor = p.chars // CHARS_PER_TOKEN_FLOOR
        self.admission.charge_tenant(p.ctx, floor)
        use_cache = p.cache_key is not None and not p.ctx.no_cache
        p.cache_state = "miss" if use_cache else "bypass"
        if use_cache:
            f.lookup = asyncio.ensure_future(self._lookup(p))
            await asyncio.sleep(0)  # let the exact-match hop leave, then tokenize while it flies
        else:
            p.lookup_done.set()
        if p.chars > INLINE_TOKENIZE_CHARS:  # a long prompt: off the loop that answers everyone
            await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self.preparer.tokenize, p)
        else:
            self.preparer.tokenize(p)
        p.clock.stage("tokenize")
        self.admission.charge_work(p.ctx, len(p.prompt_ids) + p.sampling.max_tokens - floor)

    def _shed_hopeless(self, p: Prepared) -> tuple[RouteDecision | None, list[Ticket]]:
        """Hopeless for every model that could answer: shed now, before waiting on the lookup
        or routing (the hop in flight is cancelled), so a shed costs microseconds even under
        load; even a would-be cache hit is shed. Returns a decision admission already forces
        (only the small model can take it), and the candidates' tickets."""
        forced: RouteDecision | None = None
        tickets: list[Ticket] = []
        if p.mode == "predictive":
            auto = p.requested_model == self.args.router.auto_model_id
            large, small = self.args.target.engine.model_id, self.args.draft.engine.model_id
            models = [large, small] if auto else [p.requested_model]
            if auto and not p.tier.downgrade and fixed_route(self.args.router, p.features, large) is not None:
                models = [large]  # too big for the small model, and no downgrade: only large counts
            tickets = [self.admission.ticket(m, p.ctx, p.tier, len(p.prompt_ids), p.sampling.max_tokens) for m in models]
            forced = self._only_small(p, self.admission.shed_early(tickets))
        p.clock.stage("admit")
        return forced, tickets

    async def _lookup_and_route(
        self, p: Prepared, f: InFlight, forced: RouteDecision | None, tickets: list[Ticket]
    ) -> tuple[RouteDecision | None, Lookup | None]:
        """Routing beside the lookup. The lookup's answer is awaited here unless the model
        starts beside it (`_overlap_lookup`); then it comes back in `_lookup_beside`. A hit
        here needs no decision (None)."""
        f.routing = asyncio.ensure_future(self._route(p)) if forced is None else None
        if f.routing is not None and tickets:
            forced = await self._await_verdict(p, f.routing, tickets)
            if forced is not None:
                f.routing.cancel()
                f.routing = None
        found = None
        if f.lookup is not None and not self._overlap_lookup():
            found, f.lookup = await f.lookup, None
            p.clock.stage("lookup")
            if found.outcome == "hit":
                if f.routing is not None:
                    f.routing.cancel()
                    f.routing = None
                return None, found
        decision = await f.routing if f.routing is not None else forced
        f.routing = None
        assert decision is not None
        p.clock.stage("route")
        return decision, found

    async def _admit_and_call(self, p: Prepared, f: InFlight, decision: RouteDecision, found: Lookup | None) -> None:
        """Admission (start, queue, move or shed), then the model call: a near miss rides along
        as a draft; an identical request in flight is followed rather than repeated."""
        f.permit, decision = await self._admit(p, decision)
        p.clock.stage("queue")
        p.model, p.route = decision.model_id, decision.reason
        f.decision = decision
        self._count_route(decision)
        f.builder = builder = self.prompts[decision.model_id]
        if builder is not self.prompts[p.requested_model]:
            p.prompt_ids = p.tokenize(builder)  # the routed model speaks another vocabulary
        generate = GenerateRequest(p.ctx.request_id, p.prompt_ids, p.sampling, p.ctx.target_unix())
        generate.cache_salt = p.ctx.cache_salt
        if found is not None and found.outcome == "hint":
            # A near miss: not safe to serve, but a good guess. The target verifies every
            # token of it, so the answer is exactly what it would have produced anyway.
            generate.draft_hint_ids = self._hint_ids(p, decision.model_id, builder, found)
        if p.trace is not None and p.trace.sampled:
            generate.trace = p.trace.start_model_call(decision.model_id)
        if f.lookup is not None:  # the model starts beside the lookup (overlap_cache_lookup)
            generate.lookup_overlap = self.lookup_window.open(p.ctx.request_id)
        generate.sent_unix = time.time()
        f.generate = generate
        f.stream = self._call(decision.model_id, generate, p)
        if not p.coalesced:  # a follower adds no load to the model
            self.load.started(decision.model_id)
            f.permit.also(lambda: self.load.finished(decision.model_id))
        f.first_chunk = asyncio.ensure_future(self._next(f.stream, p))

    async def _lookup_beside(self, p: Prepared, f: InFlight) -> Lookup | None:
        """The lookup's answer, where the model started beside it: a hit calls the model off;
        a near miss follows the request to its replica as a late draft."""
        if f.lookup is None:
            return None
        found, f.lookup = await f.lookup, None
        p.clock.stage("lookup")
        if found.outcome == "hit":
            f.call_off()
            return found
        if found.outcome == "hint" and not p.coalesced:
            # The replica hands it to the request's drafters, idle until its prefill is done.
            hint_ids = self._hint_ids(p, f.decision.model_id, f.builder, found)
            if hint_ids:
                self.backends.late_hint(f.decision.model_id, p.ctx.request_id, hint_ids)
        self.lookup_window.close(f.generate.lookup_overlap)  # the lookup's work is over
        return None

    async def _first_token(self, p: Prepared, f: InFlight) -> GenerateChunk:
        """The model's first chunk (a dead replica retried once), and where its time went."""
        model_id = f.decision.model_id
        try:
            first = await f.first_chunk
        except ReplicaFailed as err:
            f.stream = None
            f.stream, first = await self._retry(p, model_id, f.generate, f.permit, err)
        if first.finish_reason == "abort" and p.coalesced and p.ctx.remaining_s(self.args.ingress.request_timeout_s) > 0:
            # The engine gave up on the leader at its deadline; this follower's is later.
            f.stream.cancel()
            f.stream = None
            f.stream, first = await self._alone(p, model_id, f.generate, f.permit)
        f.first_at = first_at = time.perf_counter()
        self._time_first_chunk(p, first, first_at)
        ttft_ms = (first_at - p.clock.start) * 1000
        if p.ticket is not None:
            self.gate.first_token(p.ticket)
        if not p.coalesced:
            self.load.observe_ttft(model_id, ttft_ms)
        if first.finish_reason == "abort":
            raise APIError(503, "the request's deadline passed before the model could start", code="deadline_exceeded")
        if self.metrics is not None:
            self.metrics.first_token(model_id, p.ctx.tier, ttft_ms / 1000)
        return first

    def _time_first_chunk(self, p: Prepared, first: GenerateChunk, first_at: float) -> None:
        """From the model call to its first chunk: the replica's queue and prefill as it
        measured them, the rest is the hop there and back; the replica's details inside each
        (engine_queue.*, hop.in, prefill.*); its inner counts for admins only."""
        clock = p.clock
        p.engine_queue_ms = first.timings_ms.get("engine_queue", 0.0)
        p.prefill_ms = first.timings_ms.get("prefill")
        clock.stage_parts([("engine_queue", p.engine_queue_ms), ("prefill", p.prefill_ms or 0.0)], "hop", first_at)
        for stage in ("engine_queue", "hop", "prefill"):
            clock.details_in_stage(stage, [(k, ms) for k, ms in first.timings_ms.items() if k.startswith(stage + ".")])
        if p.ctx.admin or self.args.ingress.debug_timings:  # they tell one tenant about others' traffic
            for key in (*ENGINE_QUEUE_COUNTS, "prefix_reused_tokens"):
                if key in first.timings_ms:
                    clock.counts[key] = first.timings_ms[key]

    async def _respond(self, p: Prepared, f: InFlight, first: GenerateChunk) -> Response:
        """The whole answer as JSON, or a stream whose SSE body owns the model call from here."""
        decision, clock = f.decision, p.clock
        headers = self._headers(p, decision, p.cache_state)
        if first.replica:
            headers["x-model-replica"] = first.replica
        if p.coalesced:
            headers["x-coalesced"] = "true"
        if not p.stream:
            try:
                text, last = await self._collect(first, f.stream, p)
            except ReplicaFailed as err:  # nothing was sent yet: the whole answer can be redone
                f.stream = None
                f.stream, first = await self._retry(p, decision.model_id, f.generate, f.permit, err)
                text, last = await self._collect(first, f.stream, p)
            if p.retried:
                headers["x-retried"] = "1"
            if p.cache_state in ("verified", "hint"):
                headers["x-cache-accepted"] = _accepted(last)
            f.stream = None  # finished: nothing left to cancel
            clock.stage("decode")
            self._finished(p, last, f.first_at)
            self._completed(p, last, 200)
            f.permit.release()
            self._store(p, decision, text, last)
            clock.stage("respond")
            headers["server-timing"] = clock.server_timing()
            body = full_response(
                p.kind, _response_id(p), decision.model_id, text, last.finish_reason or "stop",
                last.prompt_tokens, last.completion_tokens, p.logprobs, tools=p.tools is not None,
            )
            return JSONResponse(body, headers=headers)
        if p.retried:
            headers["x-retried"] = "1"
        clock.stage("respond")
        headers["server-timing"] = clock.server_timing()  # a stream's headers leave with its first token
        if p.trace is not None:
            p.trace.stream_from = f.first_at
        p.streaming = True
        body_iter = self._sse(p, decision, first, f.stream, f.permit, f.first_at)
        f.stream = f.permit = None  # from here on the SSE body owns the stream and the permit
        head = await body_iter.__anext__()  # started: its `finally` now runs even if nobody reads on
        return StreamingResponse(_prepend(head, body_iter), media_type="text/event-stream", headers=headers)

    def _only_small(self, p: Prepared, feasible: list[bool]) -> RouteDecision | None:
        """Only the small model of an auto request's two can take it: with downgrade allowed,
        admission would send it there whatever the router says, so it goes now (the router's
        embedding costs 15-80 ms on a loaded box); without, the router's verdict alone decides
        between serving and shedding. None: the router decides."""
        if p.requested_model != self.args.router.auto_model_id or not self.choice.only_small(feasible, downgrade=p.tier.downgrade):
            return None
        return _moved(p, self.args.draft.engine.model_id, "deadline_downgrade")

    async def _await_verdict(self, p: Prepared, routing: asyncio.Future, tickets: list[Ticket]) -> RouteDecision | None:
        """Wait for the router `verdict_wait_ms`, and longer only while the box is idle. Its
        embedding took 45-105 ms on a loaded box, and a request that waited that long for it,
        feasible at arrival, was shed later (the slowest 503s: 77-114 ms) because the box
        filled up meanwhile. So once the wait is over, and the box is busy, the request commits
        against what it can take now: none of the models, shed; only the small one, downgrade
        (returned) or, where the tier forbids it, shed; the large one (or the model it named),
        routed there without the verdict ("router_late"; admission may still downgrade it). An
        idle box keeps waiting (checked every RECHECK_S): a long prompt's embedding takes
        longer than the wait even there, and nothing competes for its slot. None: the router
        answered."""
        wait_s = self.args.admission.verdict_wait_ms / 1000
        while True:
            await asyncio.wait({routing}, timeout=wait_s)
            if routing.done():
                return None
            feasible = self.admission.shed_early(tickets)  # raises if no model can take it now
            forced = self._only_small(p, feasible)
            if forced is not None:
                return forced
            if feasible == [False, True]:
                raise self.admission.shed_undecided(tickets[0], (time.perf_counter() - p.clock.start) * 1000)
            if not self._idle():
                # The router's safe choice without an embedding, as when the embedder is down.
                return RouteDecision(tickets[0].model_id, "router_late")
            wait_s = RECHECK_S

    def _hint_ids(self, p: Prepared, model_id: str, builder: PromptBuilder, hint: Lookup) -> list[int] | None:
        """A near miss's answer as draft tokens for `model_id`, or None where that model can't
        draft from it (no speculation, hints off, vLLM): then it costs no encode and no hop."""
        if hint.response is None or model_id not in self._hint_models:
            return None
        p.cache_state = "verified" if hint.reason == "verify" else "hint"
        p.notes["x-cache-match"] = f"{hint.reason};score={hint.score or 0:.3f}"
        if p.cache_state == "verified":
            p.verifying = hint
        return builder.tokenizer.encode(hint.response.text, add_special_tokens=False)

    def _overlap_lookup(self) -> bool:
        """Start the model before the cache lookup returns? `idle`: only while nothing runs on
        any model, here or (as last synced) in another ingress, so a hit's wasted prefill
        delays no one; under load the lookup's 15-20 ms is small against the queue anyway."""
        mode = self.args.ingress.overlap_cache_lookup
        if mode == "idle":
            return self._idle()
        return mode

    def _idle(self) -> bool:
        """No model runs anything: this ingress's count and the others', as last synced."""
        return self.gate.concurrency() == 0 and not any(s.inflight for s in self.load.stages.values())

    async def _admit(self, p: Prepared, decision: RouteDecision) -> tuple[Permit, RouteDecision]:
        """Start, queue or shed (503); downgrade to the small model when only it can make the
        deadline and the tier allows it. fifo mode admits everything, in arrival order."""
        decision = self._moved_by_load(p, decision)
        if p.mode == "fifo":
            p.admitted_at = time.perf_counter()
            return Permit(None), decision
        large, small = self.args.target.engine.model_id, self.args.draft.engine.model_id
        ticket = self.admission.ticket(decision.model_id, p.ctx, p.tier, len(p.prompt_ids), p.sampling.max_tokens)
        if p.requested_model == self.args.router.auto_model_id and decision.model_id in (large, small):
            other = small if decision.model_id == large else large
            alt = self.admission.ticket(other, p.ctx, p.tier, len(p.prompt_ids), p.sampling.max_tokens)
            choice = self.choice.choose(ticket, alt, downgrade=p.tier.downgrade)
            ticket = choice.ticket
            if choice.reason is not None:
                decision = _moved(p, ticket.model_id, choice.reason)
        await self.admission.admit(ticket)
        # The gate's promise, so a client (and bench load) can hold it to it.
        p.notes["x-admission-predicted"] = (
            f"ttft_ms={(ticket.first_at - ticket.arrived) * 1000:.0f}; e2e_ms={(ticket.finish_at - ticket.arrived) * 1000:.0f}"
        )
        p.ticket = ticket
        p.admitted_at = time.perf_counter()
        return Permit(self.gate, ticket), decision

    def _moved_by_load(self, p: Prepared, decision: RouteDecision) -> RouteDecision:
        """An auto request the classifier judged: the threshold moved by live load may send it to
        the other model (admission/model_choice.py); the router itself judges difficulty only."""
        if p.requested_model != self.args.router.auto_model_id or decision.p_hard is None or decision.threshold is None:
            return decision
        c = self.args.router.classifier
        moved = self.choice.by_load(decision.model_id, decision.p_hard, decision.threshold, self.load.threshold_shift(),
                                    (c.min_threshold, c.max_threshold))
        if moved is None:
            return decision
        model_id, reason, threshold = moved
        return RouteDecision(model_id, reason, decision.p_hard, threshold)

    def _finished(self, p: Prepared, last: GenerateChunk, first_at: float) -> None:
        """A complete answer teaches admission how long this model takes (coalesced followers
        and fifo requests don't: they measure someone else's generation, or no slot)."""
        if p.ticket is None or p.coalesced or p.retried:
            return
        now = time.perf_counter()
        self.admission.observe(
            p.ticket,
            ttft_ms=(first_at - p.admitted_at) * 1000,
            queue_ms=p.engine_queue_ms,
            prefill_ms=p.prefill_ms,
            completion_tokens=last.completion_tokens,
            total_ms=(now - p.admitted_at) * 1000,
            chunks=p.decode_chunks,
        )

    async def _retry(
        self, p: Prepared, model_id: str, request: GenerateRequest, permit: Permit, err: ReplicaFailed
    ) -> tuple[ModelStream, GenerateChunk]:
        """Once, and only when the replica died (a crash, a kill, a lost node) and nothing reached
        the client: an error the model raised itself would only repeat."""
        if p.retried or not err.replica_gone:
            raise err
        p.retried = True
        log.warning("model replica of %s died under request %s; retrying once", model_id, p.ctx.request_id)
        return await self._alone(p, model_id, request, permit)

    async def _alone(
        self, p: Prepared, model_id: str, request: GenerateRequest, permit: Permit
    ) -> tuple[ModelStream, GenerateChunk]:
        """Start this request's own generation (it followed another's, which ended for it)."""
        if p.coalesced:
            p.coalesced = False
            self.load.started(model_id)
            permit.also(lambda: self.load.finished(model_id))
        stream = self.backends.generate(model_id, request)
        try:
            return stream, await self._next(stream, p)
        except BaseException:
            stream.cancel()
            raise

    def _call(self, model_id: str, request: GenerateRequest, p: Prepared) -> ModelStream:
        """Start generating, or join an identical generation already in flight."""
        # no-cache asks for a fresh answer: it neither reads the cache nor joins a flight.
        if (
            p.cache_key is None or p.ctx.no_cache or not self.args.cache.coalesce or request.draft_hint_ids
            or _reshaped(p)
        ):
            return self.backends.generate(model_id, request)
        stream, followed = self.flights.join(f"{model_id}:{p.cache_key}", lambda: self.backends.generate(model_id, request))
        p.coalesced = followed
        return stream

    async def _lookup(self, p: Prepared) -> Lookup:
        """One hop: the SemanticCache checks the exact key and, on a miss, embeds the query and
        searches its scope. The embedding comes back with the answer, for the router and the
        write. One hop instead of two saves ~6 ms on every miss and semantic hit; embedding
        beside the exact hop instead was measured slower on two cores (both fight for them)."""
        t = time.perf_counter()
        scope = p.scope if self.args.cache.semantic.enabled else None
        try:
            found = await asyncio.wait_for(self.backends.cache_lookup(p.cache_key, scope, p.query), self._stage_timeout(p))
            if found.vector is not None:
                p.vector = found.vector
            self.lookup_window.learn(found.timings_ms)
            p.clock.details_within(t, time.perf_counter(), [(f"lookup.{k}", ms) for k, ms in found.timings_ms.items()])
            if found.outcome == "hit" and found.response is not None:
                self._remember(p, found.response)  # the next identical request skips the hop
            return found
        except Exception as exc:  # a cache failure is a miss, never an error
            self.cache_failures += 1
            log.warning("cache lookup failed, treating as a miss: %s", self._why(exc))
            return Lookup("miss", reason="cache_unavailable")
        finally:
            p.lookup_done.set()  # a router waiting for the embedding goes on (with it or without)
            p.clock.detail("lookup.cache", t)

    def _remember(self, p: Prepared, response: CachedResponse) -> None:
        if self.near_cache is not None and p.cache_key is not None:
            self.near_cache.put(p.cache_key, p.ctx.tenant, response)

    async def _embed(self, p: Prepared) -> Any:
        """The request's embedding: the one the cache lookup brought back, else computed here
        (the cache was skipped), else None (no embedder in this ingress)."""
        if p.vector is None and self.embedder is not None:
            t = time.perf_counter()
            text = p.query if p.query is not None else p.features.last_user_message
            p.vector = await self.embedder.embed_async(text)
            p.clock.detail("lookup.embed", t)
        return p.vector

    async def _route(self, p: Prepared) -> RouteDecision:
        features = p.features
        try:
            if features.last_user_message and self.router.wants_embedding(features):
                # Share the cache lookup's embedding (made in the SemanticCache replica): wait
                # for it rather than encode a second time beside it on a small box.
                await asyncio.wait_for(p.lookup_done.wait(), self._stage_timeout(p))
                features.vector = await asyncio.wait_for(self._embed(p), self._stage_timeout(p))
            t = time.perf_counter()
            try:
                if self.args.router.placement == "inline":
                    return self.router.route(features)
                return await asyncio.wait_for(self.backends.route(features), self._stage_timeout(p))
            finally:
                p.clock.detail("route.decide", t)  # the routing itself, beyond the shared embedding
        except Exception as exc:  # router down: the target can answer anything
            log.warning("router failed, using the target model: %s", self._why(exc))
            fallback = p.requested_model
            if fallback == self.args.router.auto_model_id:
                fallback = self.args.target.engine.model_id
            return RouteDecision(fallback, "router_unavailable")

    def _count_route(self, decision: RouteDecision) -> None:
        key = f"{decision.model_id}/{decision.reason}"
        self.route_counts[key] = self.route_counts.get(key, 0) + 1

    def router_stats(self) -> dict[str, Any]:
        downgrades = sum(n for k, n in self.route_counts.items() if k.endswith("/load_downgrade"))
        return {"routes": dict(self.route_counts), "load_downgrades": downgrades, "load": self.load.snapshot()}

    def _why(self, exc: BaseException) -> str:
        return describe(exc, with_message=self.args.ingress.log_prompts)

    def _stage_timeout(self, p: Prepared) -> float:
        return max(0.001, p.ctx.remaining_s(self.args.ingress.stage_timeout_s))

    async def _next(self, stream: ModelStream, p: Prepared) -> GenerateChunk:
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
            log.warning("model call failed: %s", self._why(exc))
            raise ReplicaFailed(exc) from None

    async def _collect(self, first: GenerateChunk, stream: ModelStream, p: Prepared) -> tuple[str, GenerateChunk]:
        parts, chunk = [first.text], first
        p.logprobs = list(first.logprobs) if first.logprobs is not None else None
        last_at = time.perf_counter()
        while chunk.finish_reason is None:
            chunk = await self._next(stream, p)
            last_at = self._token_gap(p, chunk, last_at)
            parts.append(chunk.text)
            if p.logprobs is not None and chunk.logprobs:
                p.logprobs.extend(chunk.logprobs)
        return "".join(parts), chunk

    def _token_gap(self, p: Prepared, chunk: GenerateChunk, last_at: float) -> float:
        """Inter-token latency of a chunk, as the ingress saw it arrive; returns its arrival."""
        now = time.perf_counter()
        if chunk.num_tokens:
            p.decode_chunks += 1
        if self.metrics is not None and chunk.num_tokens:
            self.metrics.tokens(p.model, now - last_at, chunk.num_tokens)
        return now if chunk.num_tokens else last_at

    def _completed(self, p: Prepared, last: GenerateChunk | None, status: int) -> None:
        """A generated request's end (streamed or not): its metrics and, for streams, its spans."""
        try:
            if self.metrics is not None and last is not None:
                queue_s = ((p.clock.ms("queue") or 0.0) + p.engine_queue_ms) / 1000
                self.metrics.finished(
                    p.model, p.ctx.tier, p.clock.elapsed_ms() / 1000, queue_s, last.prompt_tokens, last.completion_tokens
                )
                if p.streaming:
                    self.metrics.stages(p.clock)
            if p.trace is not None and p.trace.sampled:
                if last is not None:
                    p.trace.attributes.update({
                        "gen_ai.usage.output_tokens": last.completion_tokens,
                        "speculative.accepted_tokens": int(last.timings_ms.get("spec_accepted", 0)),
                        "speculative.proposed_tokens": int(last.timings_ms.get("spec_proposed", 0)),
                    })
                if p.streaming:
                    p.trace.finish(status)
        except Exception as exc:  # telemetry never fails a request
            log.debug("telemetry failed: %s", self._why(exc))

    async def _sse(
        self, p: Prepared, decision: RouteDecision, first: GenerateChunk, stream: ModelStream, permit: Permit,
        first_at: float,
    ) -> AsyncIterator[bytes]:
        writer = SSEWriter(p.kind, _response_id(p), decision.model_id, tools=p.tools is not None)
        parts: list[str] = []
        chunk = first
        finished = False
        failed = False
        last_at = first_at
        try:
            yield writer.delta(chunk.text, logprobs=chunk.logprobs)
            parts.append(chunk.text)
            while chunk.finish_reason is None:
                try:
                    chunk = await self._next(stream, p)
                except APIError as err:
                    failed = True
                    yield writer.error(err.message, err.code or "backend_error")
                    yield writer.done()
                    return
                last_at = self._token_gap(p, chunk, last_at)
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
            self._finished(p, chunk, first_at)
            permit.release()
            self._store(p, decision, "".join(parts), chunk)
            tail_logprobs = chunk.logprobs if chunk is not first else None
            if tail or tail_logprobs:
                yield writer.delta(tail, logprobs=tail_logprobs)
            yield writer.delta("", chunk.finish_reason)
            if p.include_usage:
                yield writer.usage(chunk.prompt_tokens, chunk.completion_tokens)
            yield writer.done()
        finally:
            permit.release()
            if not finished:
                stream.cancel()  # the client left: stop the model within one step
            # 200 went out with the headers; a stream cut short is a 503 (backend) or 499 (client gone).
            self._completed(p, chunk if finished else None, 200 if finished else 503 if failed else 499)

    # ------------------------------------------------------------------ 3. cache

    def _cached(self, p: Prepared, found: Lookup) -> Response:
        hit = found.response
        assert hit is not None
        decision = RouteDecision(hit.model_id, "cache")
        p.model, p.route, p.cache_state = hit.model_id, "cache", "hit"
        self._count_route(decision)
        headers = self._headers(p, decision, "hit")
        headers["x-cache-match"] = f"{found.reason};score={found.score or 0:.3f}"
        p.clock.stage("respond")
        headers["server-timing"] = p.clock.server_timing()
        if not p.stream:
            body = full_response(
                p.kind, _response_id(p), hit.model_id, hit.text, hit.finish_reason, hit.prompt_tokens, hit.completion_tokens,
                tools=p.tools is not None,
            )
            return JSONResponse(body, headers=headers)

        async def replay() -> AsyncIterator[bytes]:
            writer = SSEWriter(p.kind, _response_id(p), hit.model_id, tools=p.tools is not None)
            for piece in _pieces(hit.text, self.args.cache.replay_chunk_words):
                yield writer.delta(piece)
            yield writer.delta("", hit.finish_reason)
            if p.include_usage:
                yield writer.usage(hit.prompt_tokens, hit.completion_tokens)
            yield writer.done()

        return StreamingResponse(replay(), media_type="text/event-stream", headers=headers)

    def _store(self, p: Prepared, decision: RouteDecision, text: str, last: GenerateChunk) -> None:
        if p.verifying is not None and p.verifying.response is not None and last.finish_reason in ("stop", "length"):
            # A label for semantic.mode bounded: did the model give the cached answer, exactly?
            cached = p.verifying.response
            correct = text == cached.text and last.finish_reason == cached.finish_reason
            try:
                self.backends.cache_verified(p.scope or "", p.verifying.entry_key, p.verifying.score or 0.0, correct)
            except Exception as exc:
                log.warning("cache feedback failed: %s", self._why(exc))
        if (
            p.cache_key is None or p.ctx.no_store or p.coalesced or last.finish_reason not in ("stop", "length")
            or _reshaped(p)
        ):
            return
        value = CachedResponse(text, last.finish_reason, last.prompt_tokens, last.completion_tokens, decision.model_id)
        vector = p.vector if p.vector is not None and p.scope is not None else None
        entry = CacheEntry(p.cache_key, p.ctx.tenant, p.scope if vector is not None else None, p.query, vector, value,
                           shard=p.scope or p.cache_key)
        self._remember(p, value)
        try:
            self.backends.cache_store(entry)
        except Exception as exc:
            log.warning("cache write failed: %s", self._why(exc))

    def _headers(self, p: Prepared, decision: RouteDecision, cache: str) -> dict[str, str]:
        echo = {"x-request-id": p.ctx.client_request_id} if p.ctx.client_request_id else {}
        return {
            **echo,
            "x-cache": cache,
            "x-route": decision.header(),
            "x-slo-tier": p.ctx.tier,
            **({"x-ingress-replica": self.served_by} if self.served_by else {}),
            **p.notes,
        }


def _accepted(last: GenerateChunk) -> str:
    """How much of a cached answer offered as a draft the model kept: `accepted/proposed`
    tokens, and the answer's length."""
    accepted = int(last.timings_ms.get("spec_hint_accepted", 0))
    proposed = int(last.timings_ms.get("spec_hint_proposed", 0))
    return f"accepted={accepted};proposed={proposed};completion_tokens={last.completion_tokens}"


# Ray's "the actor is gone" errors, by name so this module needs no Ray: RayActorError and its
# ActorDiedError, and ActorUnavailableError (unreachable, being replaced). Another way to a
# replica says so with a true `replica_gone` class attribute.
_REPLICA_GONE = {"RayActorError", "ActorDiedError", "ActorUnavailableError"}


def _replica_gone(exc: BaseException) -> bool:
    return getattr(type(exc), "replica_gone", False) or any(cls.__name__ in _REPLICA_GONE for cls in type(exc).__mro__)


def _reshaped(p: Prepared) -> bool:
    """The tier clamped max_tokens or trimmed the conversation: the answer is not the one the
    request's cache key names, so it is neither cached nor shared with identical requests."""
    return "x-max-tokens-clamped" in p.notes or "x-context-trimmed" in p.notes


def _response_id(p: Prepared) -> str:
    return ("chatcmpl-" if p.kind == "chat" else "cmpl-") + p.ctx.request_id


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
