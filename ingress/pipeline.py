"""One request, top to bottom: this file orchestrates, each stage lives in its own module.

    HTTP body ─► validate (400/413), cache key                                  prepare.py
              ─► a repeat this replica answered lately: answer now, no hop      cache_client.py
              ─► tenant rate limits (429 + Retry-After), in-process             admission/
              ─► tokenize once (400 if it can't fit): immutable from here on    prepare.py
              ─► cache lookup ║ routing (one hop to the SemanticCache; the      cache_client.py
                 router judges difficulty on the embedding the lookup brought   placement.py
                 back, in-process)
              ─► hit: answer now, no admission slot; a semantic match in mode   respond.py
                 verify is checked by the model as a draft (x-cache: verified)
              ─► admission, in-process: start, queue (EDF within tier), move    placement.py
                 to the other model, or shed (503 + Retry-After + the prediction)
              ─► near miss: its answer rides along as a draft (x-cache: hint)   cache_client.py
              ─► identical requests in flight share one generation; a replica   model_calls.py
                 that dies before anything reached the client is retried once
              ─► the answer, whole or streamed; then admission learns, the slot respond.py
                 is freed and the cache written, off the request path

Each stage returns what it finds; the spine alone writes it on the request's Record
(accounting.py), which its headers and telemetry read. Every wait has a timeout derived from
the request's deadline. The cache and the router degrade (miss / default route) instead of
failing the request. Each step closes a stage on the Record's StageClock: the same intervals
become the `Server-Timing` header, the stage-duration metric and, when tracing is on, spans.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from admission.errors import AdmissionError
from admission.policy import AdmissionPolicy
from configs.schemas import AppArgs
from engines.types import ENGINE_QUEUE_COUNTS, GenerateChunk, GenerateRequest
from ingress import choices
from ingress.accounting import Record, RequestAccounting
from ingress.auth import KeyRing
from ingress.cache_client import CacheClient
from ingress.context import context_from_headers
from ingress.embeddings import EmbeddingsService
from ingress.errors import APIError, bad_request, from_admission
from ingress.inflight import InFlight
from ingress.model_calls import Call, ModelCalls, ModelStream, ReplicaFailed
from ingress.pacing import paced
from ingress.placement import Admitted, Placement
from ingress.prepare import INLINE_TOKENIZE_CHARS, Prepared, Preparer, grammar_cost
from ingress.prompts import PromptBuilder
from ingress.readiness import Readiness
from ingress.respond import Responder
from ingress.responses import Kind
from router.base import RouteDecision, RouteFeatures
from semantic_cache.cache import CacheEntry, Lookup
from telemetry.metrics import SHED_REASONS

log = logging.getLogger(__name__)


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


class Pipeline:
    def __init__(
        self, args: AppArgs, backends: Backends, prompts: dict[str, PromptBuilder], embedder: Embedder | None = None,
        *, accounting: RequestAccounting | None = None, readiness: Readiness | None = None, served_by: str = "",
    ) -> None:
        self.args = args
        self.backends = backends
        self.prompts = prompts  # model id -> prompt builder ("auto" uses the target's)
        self.readiness = readiness or Readiness()
        self.accounting = accounting or RequestAccounting()
        self.keys = KeyRing(args.auth, args.admission.tenants)
        self.admission = AdmissionPolicy(args.admission, own_buckets=self.keys.owners())
        self.gate = self.admission.gate
        # llama.cpp holds a fixed number of sequences per replica; the gate counts them.
        self.admission.set_seats({
            stage.engine.model_id: (deployment, stage.engine.max_sequences)
            for deployment, stage in (("TargetModel", args.target), ("DraftModel", args.draft))
            if stage.engine.kind == "llama_cpp"
        })
        self.preparer = Preparer(args, prompts, self.admission)
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.cache = CacheClient(args, backends, embedder)
        self.placement = Placement(args, self.admission, backends, self.cache)
        self.calls = ModelCalls(args, backends, self.placement.load, self.accounting.metrics)
        self.responder = Responder(args, self.calls, self.cache, self.admission, self.accounting, served_by)
        self.embeddings = EmbeddingsService(args, self.keys, self.admission, self.preparer, embedder)
        mode = args.cache.semantic.mode
        if args.cache.enabled and args.cache.semantic.enabled and mode != "trust" and not self.cache.hint_models:
            log.warning("cache.semantic.mode %s: no model here verifies hints (speculation or verify_hints off), so "
                        "a semantic match is generated as a miss (and teaches nothing); exact hits are served as "
                        "before", mode)

    # ------------------------------------------------------------------ 1. read, validate, tokenize

    async def handle(self, request: Request, kind: Kind) -> Response:
        rec = self.accounting.record(request)
        ctx = None
        response: Response | None = None
        shed: str | None = None
        try:
            await self.wait_ready()
            ctx = context_from_headers(request.headers, self.keys.identify(request.headers))
            mode = self.admission.mode(request.headers)
            tier = self.admission.tier(ctx)
            rec.tier = ctx.tier
            if mode == "fifo":  # admission off: no deadlines, first come first served
                ctx.deadline = ctx.target_deadline = ctx.ttft_deadline = None
            body = await self.preparer.read_json(request)
            p = self.preparer.prepare(kind, body, ctx, tier, mode)
            rec.requested_model = p.requested_model
            if p.grammar_param is not None:  # paid for before it is converted, refused or not
                self.admission.charge_work(ctx, grammar_cost(p.sampling.structured))
                await self.preparer.check_grammar(p)
            rec.clock.stage("parse")
            if self.args.ingress.log_prompts:  # opt-in only: prompts are user data
                log.info("request %s tenant=%s %s: %s", ctx.request_id, ctx.tenant, kind, json.dumps(body)[:4000])
            n = p.request.n or 1
            near = self.cache.repeat(p) if n == 1 else None
            if near is not None:  # a repeat this replica answered lately: no tokenizer, no slot, no hop
                self.admission.charge_tenant(ctx, near.response.prompt_tokens + near.response.completion_tokens)
                rec.clock.stage("lookup")
                response = self._hit(p, rec, near)
                return response
            p = await self._tokenized(p, rec)
            response = await (self.serve(p, rec) if n == 1 else self._choices(p, rec, n))
            return response
        except (APIError, AdmissionError) as raised:
            if isinstance(raised, AdmissionError):
                raised = await paced(raised, self.args.ingress.over_limit_hold_s)
            err = from_admission(raised) if isinstance(raised, AdmissionError) else raised
            shed = err.code if err.code in SHED_REASONS else None
            response = err.response()
            response.headers["server-timing"] = rec.clock.server_timing()  # a 4xx/503 says where its time went too
            if rec.trace is not None and rec.trace.sampled:
                rec.trace.attributes["error.type"] = err.code
            return response
        except ClientDisconnect:
            response = Response(status_code=499)
            return response
        finally:
            self.accounting.answered(rec, ctx.tenant if ctx is not None else None, response, shed)

    async def _tokenized(self, p: Prepared, rec: Record) -> Prepared:
        """`p` with its prompt's ids, paid for before any of it is done: the request and a floor
        of its prompt's tokens now (a tenant already over its rate costs no tokenizer pass; a
        request that ends in a 400 after tokenizing is charged too), the rest once counted."""
        floor = p.chars // CHARS_PER_TOKEN_FLOOR
        self.admission.charge_tenant(p.ctx, floor)
        if p.chars > INLINE_TOKENIZE_CHARS:  # a long prompt: off the loop that answers everyone
            p = await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, self.preparer.tokenize, p)
        else:
            p = self.preparer.tokenize(p)
        rec.clock.stage("tokenize")
        rec.prompt_tokens = len(p.prompt_ids)
        self.admission.charge_work(p.ctx, len(p.prompt_ids) + p.sampling.max_tokens - floor)
        return p

    async def _choices(self, p: Prepared, rec: Record, n: int) -> Response:
        """n > 1 (ingress/choices.py): each choice served as a request of its own; the first
        that fails stops the others."""
        copies = choices.split(p, n, self.gate.max_inflight)
        self.admission.charge_work(p.ctx, (n - 1) * (len(p.prompt_ids) + p.sampling.max_tokens))  # each a request
        turns = choices.turns(p, self.gate.max_inflight)

        async def one(copy: Prepared) -> Response:
            if turns is None:
                return await self.serve(copy, rec.copy())
            async with turns:
                return await self.serve(copy, rec.copy())

        tasks = [asyncio.ensure_future(one(c)) for c in copies]
        try:
            responses = list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        return await choices.merge(p, responses)

    # ------------------------------------------------------------------ 2. admit, look up, generate

    async def serve(self, p: Prepared, rec: Record) -> Response:
        """The spine: shed the hopeless → look up ∥ route → admit and call the model → a hit
        beside it calls it off → the first token → respond (whole, or streamed). Whatever raises
        on the way (an error, a deadline, the client gone) lets go of everything in flight."""
        f = InFlight()
        try:
            forced, f.tickets = self.placement.shed_hopeless(p)
            f.arrival = self.placement.arrival(f.tickets)
            rec.clock.stage("admit")
            f.cache = cache = self.cache.state(p, rec.clock)
            rec.cache = cache.result
            if cache.result == "miss":
                f.lookup = asyncio.ensure_future(self.cache.lookup(p, cache, self.placement.stage_timeout(p)))
            decision, found = await self._lookup_and_route(p, rec, f, forced)
            f.placed()
            if decision is None:
                return self._hit(p, rec, found)  # hits take no admission slot: served even at capacity
            admitted = await self._admit_and_call(p, rec, f, decision, found)
            found = await self._lookup_beside(p, rec, f)
            if found is not None and found.outcome == "hit":
                return self._hit(p, rec, found)
            first = await self._first_token(p, rec, f)
            return await self.responder.generated(p, rec, admitted, cache, f.call, first)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # the client left mid-answer
                self.responder.learn_cut_short(f.admitted, f.call)
            f.abandon()
            raise

    async def _lookup_and_route(
        self, p: Prepared, rec: Record, f: InFlight, forced: RouteDecision | None
    ) -> tuple[RouteDecision | None, Lookup | None]:
        """Routing beside the lookup. The lookup's answer is awaited here unless the model
        starts beside it (`overlap_cache_lookup`); then it comes back in `_lookup_beside`. A hit
        here needs no decision (None)."""
        f.routing = asyncio.ensure_future(self.placement.route(p, f.cache)) if forced is None else None
        if f.routing is not None and f.tickets:
            forced = await self.placement.await_verdict(p, f.routing, f.tickets)
            if forced is not None:
                f.routing.cancel()
                f.routing = None
        found = None
        if f.lookup is not None and not self.placement.overlap_lookup():
            found, f.lookup = await f.lookup, None
            rec.clock.stage("lookup")
            if found.outcome == "hit":
                if f.routing is not None:
                    f.routing.cancel()
                    f.routing = None
                return None, found
        decision = await f.routing if f.routing is not None else forced
        f.routing = None
        assert decision is not None
        rec.clock.stage("route")
        return decision, found

    async def _admit_and_call(
        self, p: Prepared, rec: Record, f: InFlight, decision: RouteDecision, found: Lookup | None
    ) -> Admitted:
        """Admission (start, queue, move or shed), then the model call: a near miss rides along
        as a draft; an identical request in flight is followed rather than repeated."""
        f.admitted = admitted = await self.placement.admit(p, decision)
        rec.clock.stage("queue")
        rec.decision = model = admitted.decision
        rec.notes.update(admitted.notes())
        self.placement.count(model)
        f.builder = builder = self.prompts[model.model_id]
        # The routed model may speak another vocabulary than the one the request was tokenized in.
        prompt_ids = p.prompt_ids if builder is self.prompts[p.requested_model] else p.tokenize(builder)
        generate = GenerateRequest(p.ctx.request_id, prompt_ids, p.sampling, p.ctx.target_unix())
        generate.cache_salt = p.ctx.cache_salt
        if found is not None and found.outcome == "hint":
            # A near miss: not safe to serve, but a good guess. The target verifies every
            # token of it, so the answer is exactly what it would have produced anyway.
            generate.draft_hint_ids = self._hint(p, rec, f, found, late=False)
        if rec.trace is not None and rec.trace.sampled:
            generate.trace = rec.trace.start_model_call(model.model_id)
        if f.lookup is not None:  # the model starts beside the lookup (overlap_cache_lookup)
            generate.lookup_overlap = self.cache.lookup_window.open(p.ctx.request_id)
        generate.sent_unix = time.time()
        f.call = self.calls.start(model.model_id, generate, p, admitted.permit)
        f.first_chunk = asyncio.ensure_future(self.calls.next(f.call, p))
        return admitted

    async def _lookup_beside(self, p: Prepared, rec: Record, f: InFlight) -> Lookup | None:
        """The lookup's answer, where the model started beside it: a hit calls the model off;
        a near miss follows the request to its replica as a late draft."""
        if f.lookup is None:
            return None
        found, f.lookup = await f.lookup, None
        rec.clock.stage("lookup")
        if found.outcome == "hit":
            f.call_off()
            return found
        if found.outcome == "hint" and not f.call.coalesced:
            # The replica hands it to the request's drafters, idle until its prefill is done.
            hint_ids = self._hint(p, rec, f, found, late=True)
            if hint_ids:
                self.backends.late_hint(f.call.model_id, p.ctx.request_id, hint_ids)
        self.cache.lookup_window.close(f.call.request.lookup_overlap)  # the lookup's work is over
        return None

    def _hint(self, p: Prepared, rec: Record, f: InFlight, found: Lookup, late: bool) -> list[int] | None:
        hint_ids = self.cache.hint_ids(f.cache, f.admitted.decision.model_id, f.builder, found, p.sampling.greedy, late)
        rec.cache = f.cache.result
        rec.notes.update(f.cache.match)
        return hint_ids

    async def _first_token(self, p: Prepared, rec: Record, f: InFlight) -> GenerateChunk:
        """The model's first chunk (a dead replica retried once), and where its time went."""
        call = f.call
        try:
            first = await f.first_chunk
        except ReplicaFailed as err:
            first = await self.calls.retry(call, p, err)
        if first.finish_reason == "abort" and call.coalesced and p.ctx.remaining_s(self.args.ingress.request_timeout_s) > 0:
            # The engine gave up on the leader at its deadline; this follower's is later.
            first = await self.calls.alone(call, p)
        self.calls.first(call, first)
        rec.engine_queue_ms = call.engine_queue_ms
        self._time_first_chunk(p, rec, call, first)
        ttft_ms = (call.first_at - rec.clock.start) * 1000
        if f.admitted.ticket is not None:
            self.gate.first_token(f.admitted.ticket)
        if not call.coalesced:
            self.placement.load.observe_ttft(call.model_id, ttft_ms)
        if first.finish_reason == "abort":
            raise APIError(503, "the request's deadline passed before the model could start", code="deadline_exceeded")
        self.accounting.first_token(call.model_id, p.ctx.tier, ttft_ms / 1000)
        return first

    def _time_first_chunk(self, p: Prepared, rec: Record, call: Call, first: GenerateChunk) -> None:
        """From the model call to its first chunk: the replica's queue and prefill as it observed
        them, the rest is the hop; their details (engine_queue.*, hop.in, prefill.*); counts for admins."""
        clock = rec.clock
        clock.stage_parts([("engine_queue", call.engine_queue_ms), ("prefill", call.prefill_ms or 0.0)], "hop", call.first_at)
        for stage in ("engine_queue", "hop", "prefill"):
            clock.details_in_stage(stage, [(k, ms) for k, ms in first.timings_ms.items() if k.startswith(stage + ".")])
        if p.ctx.admin or self.args.ingress.debug_timings:  # they tell one tenant about others' traffic
            for key in (*ENGINE_QUEUE_COUNTS, "prefix_reused_tokens"):
                if key in first.timings_ms:
                    clock.counts[key] = first.timings_ms[key]

    def _hit(self, p: Prepared, rec: Record, found: Lookup) -> Response:
        self.placement.count(RouteDecision(found.response.model_id, "cache"))
        return self.responder.cached(p, rec, found)

    # ------------------------------------------------------------------ 3. the other endpoints

    async def wait_ready(self) -> None:
        if not self.readiness.ready:
            await self.readiness.wait(self.args.ingress.warmup_wait_s)

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
            dropped = await self.cache.invalidate(tenant)
        except APIError as err:
            return err.response()
        except Exception as exc:
            return APIError(503, f"the cache did not answer: {type(exc).__name__}", code="cache_unavailable").response()
        return JSONResponse({"object": "cache.invalidation", "tenant": tenant, "deleted": dropped})

    async def create_embeddings(self, request: Request) -> Response:
        try:
            await self.wait_ready()
        except APIError as err:
            return err.response()
        return await self.embeddings.handle(request)

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
