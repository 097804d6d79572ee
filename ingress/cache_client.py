"""The semantic cache as one request's ingress sees it: a repeat this replica answered lately
(L1, no hop), the lookup hop to the SemanticCache (L2: exact key, then the embedding and the
Qdrant search), a near miss's answer as draft tokens, and the write and verification label
after a complete answer, off the request path. A cache failure is a miss, never an error."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from configs.schemas import AppArgs
from engines.types import GenerateChunk
from host_tuning.lookup_window import LookupWindow
from ingress.errors import describe
from ingress.prepare import Prepared
from ingress.prompts import PromptBuilder
from semantic_cache.cache import CacheEntry, Lookup
from semantic_cache.exact import CachedResponse, ExactCache
from telemetry.clock import StageClock

log = logging.getLogger(__name__)


@dataclass
class CacheState:
    """One request's dealings with the cache, written by CacheClient alone: whether it looks
    up, the embedding its lookup brought back (or the router's), and the semantic match the
    model was handed as a draft."""

    result: str  # bypass / miss, then hint / verified when a near miss rides along as a draft
    clock: StageClock  # the request's, for the lookup's details
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the lookup is over (or skipped)
    vector: Any = None
    verifying: Lookup | None = None  # the semantic match the model is verifying (mode verify)
    match: dict[str, str] = field(default_factory=dict)  # x-cache-match, once a match rides along


class CacheClient:
    def __init__(self, args: AppArgs, backends, embedder=None) -> None:
        self.args = args
        self.backends = backends
        stages = (args.target, args.draft)
        # Models whose replicas verify a match or near miss as a draft: the CPU engines by
        # speculating (any request), vLLM in one prefill (greedy requests).
        self.greedy_hint_models = {
            s.engine.model_id for s in stages if s.engine.kind == "vllm" and s.engine.vllm.verify_hints
        }
        self.hint_models = self.greedy_hint_models | {
            s.engine.model_id for s in stages
            if s.engine.kind != "vllm" and s.speculative.method != "none" and s.speculative.use_hints
        }
        self.embedder = embedder  # the router's, for requests that skip the lookup (it brings one)
        # Host tuning: a model call started beside the lookup leaves the lookup a core.
        self.lookup_window = LookupWindow(args.host_tuning.window)
        # L1: exact answers this replica served or wrote recently, so a repeat costs no hop.
        # The SemanticCache deployment stays the shared source of truth (L2).
        near = args.cache.model_copy(update={"max_entries": max(1, args.cache.near_entries), "ttl_s": args.cache.near_ttl_s})
        self.near_cache = ExactCache(near) if args.cache.near_entries > 0 else None
        self.failures = 0  # lookups that failed or timed out and were served as misses

    def repeat(self, p: Prepared) -> Lookup | None:
        """A repeat this replica answered lately: no tokenizer, no admission slot, no hop."""
        if p.cache_key is None or p.ctx.no_cache or self.near_cache is None:
            return None
        near = self.near_cache.get(p.cache_key)
        return None if near is None else Lookup("hit", near, 1.0, "exact_near")

    def state(self, p: Prepared, clock: StageClock) -> CacheState:
        """Whether the request looks up (`miss` until the lookup says otherwise) or not (`bypass`)."""
        looks_up = p.cache_key is not None and not p.ctx.no_cache
        state = CacheState("miss" if looks_up else "bypass", clock)
        if not looks_up:
            state.done.set()
        return state

    async def lookup(self, p: Prepared, state: CacheState, timeout_s: float) -> Lookup:
        """One hop: the SemanticCache checks the exact key and, on a miss, embeds the query and
        searches its scope. The embedding comes back with the answer, for the router and the
        write: one hop where two would each cost a round trip."""
        t = time.perf_counter()
        scope = p.scope if self.args.cache.semantic.enabled else None
        try:
            found = await asyncio.wait_for(self.backends.cache_lookup(p.cache_key, scope, p.query), timeout_s)
            if found.vector is not None:
                state.vector = found.vector
            self.lookup_window.learn(found.timings_ms)
            state.clock.details_within(t, time.perf_counter(), [(f"lookup.{k}", ms) for k, ms in found.timings_ms.items()])
            if found.outcome == "hit" and found.response is not None:
                self._remember(p, found.response)  # the next identical request skips the hop
            return found
        except Exception as exc:  # a cache failure is a miss, never an error
            self.failures += 1
            log.warning("cache lookup failed, treating as a miss: %s", self._why(exc))
            return Lookup("miss", reason="cache_unavailable")
        finally:
            state.done.set()  # a router waiting for the embedding goes on (with it or without)
            state.clock.detail("lookup.cache", t)

    async def embedding(self, p: Prepared, state: CacheState, timeout_s: float) -> Any:
        """The request's embedding, for the router: the one its lookup brought back (made in the
        SemanticCache replica: waited for rather than encoded a second time beside it on a small
        box), else made here (the lookup was skipped or failed), else None (no embedder here)."""
        await asyncio.wait_for(state.done.wait(), timeout_s)
        if state.vector is None and self.embedder is not None:
            t = time.perf_counter()
            text = p.query if p.query is not None else p.features.last_user_message
            state.vector = await asyncio.wait_for(self.embedder.embed_async(text), timeout_s)
            state.clock.detail("lookup.embed", t)
        return state.vector

    def hint_ids(
        self, state: CacheState, model_id: str, builder: PromptBuilder, hint: Lookup, greedy: bool = True,
        late: bool = False,
    ) -> list[int] | None:
        """A near miss's answer as draft tokens for `model_id`, or None where that model can't
        verify it (no speculation, hints off; on vLLM, a sampled request, or a hint that comes
        `late`, after the request started): then it costs no encode and no hop."""
        if hint.response is None or model_id not in self.hint_models:
            return None
        if model_id in self.greedy_hint_models and (late or not greedy):
            return None
        state.result = "verified" if hint.reason == "verify" else "hint"
        state.match["x-cache-match"] = f"{hint.reason};score={hint.score or 0:.3f}"
        if state.result == "verified":
            state.verifying = hint
        return builder.tokenizer.encode(hint.response.text, add_special_tokens=False)

    def store(
        self, p: Prepared, state: CacheState, model_id: str, text: str, last: GenerateChunk, shared: bool
    ) -> None:
        """After a complete answer: the verification label of a semantic match, and the write
        (not of an answer `shared` with an identical request: its leader writes it)."""
        verifying = state.verifying
        if verifying is not None and verifying.response is not None and last.finish_reason in ("stop", "length"):
            # A label for semantic.mode bounded: did the model give the cached answer, exactly?
            cached = verifying.response
            correct = text == cached.text and last.finish_reason == cached.finish_reason
            try:
                self.backends.cache_verified(p.scope or "", verifying.entry_key, verifying.score or 0.0, correct)
            except Exception as exc:
                log.warning("cache feedback failed: %s", self._why(exc))
        if (
            p.cache_key is None or p.ctx.no_store or shared or last.finish_reason not in ("stop", "length")
            or p.reshaped
        ):
            return
        value = CachedResponse(text, last.finish_reason, last.prompt_tokens, last.completion_tokens, model_id)
        vector = state.vector if state.vector is not None and p.scope is not None else None
        entry = CacheEntry(p.cache_key, p.ctx.tenant, p.scope if vector is not None else None, p.query, vector, value,
                           shard=p.scope or p.cache_key)
        self._remember(p, value)
        try:
            self.backends.cache_store(entry)
        except Exception as exc:
            log.warning("cache write failed: %s", self._why(exc))

    async def invalidate(self, tenant: str) -> int:
        """Drop one tenant's answers here and in the SemanticCache; how many it dropped."""
        if self.near_cache is not None:
            self.near_cache.invalidate(tenant)
        return await asyncio.wait_for(self.backends.cache_invalidate(tenant), self.args.ingress.stage_timeout_s)

    def forget_tenants(self, tenants: list[str | None]) -> None:
        """Invalidations made through another ingress replica: the near cache drops them too
        (None: everything)."""
        if self.near_cache is not None:
            for tenant in tenants:
                self.near_cache.invalidate(tenant)

    def _remember(self, p: Prepared, response: CachedResponse) -> None:
        if self.near_cache is not None and p.cache_key is not None:
            self.near_cache.put(p.cache_key, p.ctx.tenant, response)

    def _why(self, exc: BaseException) -> Any:
        return describe(exc, with_message=self.args.ingress.log_prompts)
