"""The response cache: exact match first, then a scoped semantic match that must pass guards.

    lookup(key, scope, query, embed)       -> the whole lookup in one call (one hop from the ingress):
      lookup_exact(key)                    -> hash lookup, microseconds; no embedding needed
      embed(query)                         -> only on an exact miss; the vector comes back too
      lookup_similar(scope, vector, query) -> nearest entries in the scope, then:
        score >= threshold and guards pass -> "hit"  (served; semantic.mode trust, or bounded
                                              where the skip policy allows it)
                                              "hint" with reason "verify" (semantic.mode verify
                                              or bounded: the model verifies the answer as a draft)
        score >= hint_threshold            -> "hint" (the answer becomes a speculative draft)
        else                               -> "miss"
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np

from configs.schemas import CacheConfig
from semantic_cache.exact import CachedResponse, ExactCache
from semantic_cache.guards import mismatch
from semantic_cache.skip_policy import SkipPolicy
from semantic_cache.store import VectorStore, owner_of, point_id

Outcome = Literal["hit", "hint", "miss"]


@dataclass(slots=True)
class Lookup:
    outcome: Outcome
    response: CachedResponse | None = None
    score: float | None = None
    reason: str = ""  # "exact", "semantic", "below_threshold", or the guard that refused
    query: str | None = None  # the cached question that matched
    entry_key: str = ""  # the matched entry's exact key: a verification's outcome is reported against it
    vector: np.ndarray | None = None  # the request's embedding, when the lookup made one (router, write)
    timings_ms: dict[str, float] = field(default_factory=dict)  # cache_exact / embed / cache_semantic


@dataclass(slots=True)
class CacheEntry:
    key: str  # exact key
    tenant: str
    scope: str | None  # None: exact match only (no last user turn to compare)
    query: str | None
    vector: np.ndarray | None
    response: CachedResponse
    shard: str = ""  # the scope, or the key where there is none: which cache replica holds it


class ResponseCache:
    def __init__(self, config: CacheConfig, store: VectorStore | None, clock=time.time) -> None:
        self.config = config
        self.semantic = config.semantic
        self.store = store if config.semantic.enabled else None
        self._clock = clock
        self.exact = ExactCache(config, clock=clock)
        self.counts = {"exact_hits": 0, "semantic_hits": 0, "verifications": 0, "hints": 0, "misses": 0, "guard_refusals": 0, "writes": 0}
        s = config.semantic
        # Bounded mode learns per tenant: one tenant's easy verifications never let another
        # tenant's paraphrases skip theirs. The idlest tenants' policies go first past the bound.
        self.skip: OrderedDict[str, SkipPolicy] | None = OrderedDict() if s.mode == "bounded" else None
        self._writes_since_index = 0

    async def lookup(
        self, key: str, scope: str | None, query: str | None, embed: Callable[[str], Awaitable[np.ndarray]] | None
    ) -> Lookup:
        """Exact, then (on a miss, with a scope) embed the query and search that scope. One call,
        so a lookup that reaches the semantic layer costs the ingress one hop, not two."""
        t0 = time.perf_counter()
        hit = self.lookup_exact(key)
        t1 = time.perf_counter()
        timings = {"cache_exact": (t1 - t0) * 1000}
        if hit is not None:
            return Lookup("hit", hit, 1.0, "exact", timings_ms=timings)
        if scope is None or query is None or embed is None or self.store is None:
            self.counts["misses"] += 1
            return Lookup("miss", reason="no_semantic", timings_ms=timings)
        vector = await embed(query)
        t2 = time.perf_counter()
        found = self.lookup_similar(scope, vector, query)
        found.vector = vector
        found.timings_ms = {**timings, "embed": (t2 - t1) * 1000, "cache_semantic": (time.perf_counter() - t2) * 1000}
        return found

    def lookup_exact(self, key: str) -> CachedResponse | None:
        hit = self.exact.get(key)
        if hit is not None:
            self.counts["exact_hits"] += 1
        return hit

    def lookup_similar(self, scope: str, vector: np.ndarray, query: str) -> Lookup:
        if self.store is None:
            self.counts["misses"] += 1
            return Lookup("miss", reason="semantic_disabled")
        found = self.store.search(vector, scope, self._clock(), limit=3)
        hint: Lookup | None = None
        for match in found:
            if match.score < self.semantic.hint_threshold:
                break
            cached_query = match.payload.get("query", "")
            response = CachedResponse(**match.payload["response"])
            refusal = None
            if match.score < self.semantic.threshold:
                refusal = "below_threshold"
            elif self.semantic.guards:
                refusal = mismatch(cached_query, query)
                if refusal:
                    self.counts["guard_refusals"] += 1
            entry_key = match.payload.get("key", "")
            if refusal is None and self.semantic.mode != "trust":
                skip = self._skip_policy(match.payload.get("tenant"), create=False)
                if skip is None or not skip.serve_unverified(match.score, entry_key):
                    self.counts["verifications"] += 1
                    return Lookup("hint", response, match.score, "verify", cached_query, entry_key=entry_key)
            if refusal is None:
                self.counts["semantic_hits"] += 1
                self.exact.touch(entry_key)
                reason = "semantic" if self.skip is None else "bounded"
                return Lookup("hit", response, match.score, reason, cached_query, entry_key=entry_key)
            if hint is None:
                hint = Lookup("hint", response, match.score, refusal, cached_query)
        if hint is not None:
            self.counts["hints"] += 1
            return hint
        self.counts["misses"] += 1
        return Lookup("miss", score=found[0].score if found else None, reason="no_match")

    def verified(self, entry_key: str, score: float, correct: bool, tenant: str | None = None) -> None:
        """A verification's outcome (mode bounded learns from it, for the entry's tenant): did
        the model give the cached answer?"""
        skip = self._skip_policy(tenant or self.exact.tenant_of(entry_key), create=True)
        if skip is not None:
            skip.observe(score, entry_key, correct)

    MAX_SKIP_TENANTS = 10_000

    def _skip_policy(self, tenant: str | None, create: bool) -> SkipPolicy | None:
        if self.skip is None or tenant is None:
            return None
        policy = self.skip.get(tenant)
        if policy is None and create:
            policy = self.skip[tenant] = SkipPolicy(self.semantic.max_error_rate, self.semantic.explore_rate)
            while len(self.skip) > self.MAX_SKIP_TENANTS:
                self.skip.popitem(last=False)
        if policy is not None:
            self.skip.move_to_end(tenant)
        return policy

    def put(self, entry: CacheEntry) -> None:
        self.counts["writes"] += 1
        evicted = self.exact.put(entry.key, entry.tenant, entry.response)
        if self.store is None:
            return
        if evicted:
            self.store.delete([point_id(k) for k in evicted])
        if entry.scope is None or entry.vector is None or entry.query is None:
            return
        payload = {
            "key": entry.key,
            "tenant": entry.tenant,
            "owner": owner_of(entry.tenant),
            "scope": entry.scope,
            "query": entry.query,
            "expires": self._clock() + self.config.ttl_s,
            "response": asdict(entry.response),
        }
        self.store.upsert(point_id(entry.key), entry.vector, payload)
        self._writes_since_index += 1

    def needs_index(self) -> bool:
        return self.store is not None and self._writes_since_index >= self.semantic.store.index_every

    def build_index(self) -> None:
        self._writes_since_index = 0
        if self.store is not None:
            self.store.maintain()

    def purge_expired(self) -> int:
        gone = self.exact.expired()
        if self.store is not None:
            self.store.delete_expired(self._clock())
        return len(gone)

    def invalidate(self, tenant: str | None) -> int:
        keys = self.exact.invalidate(tenant)
        if self.store is not None:
            if tenant is None:
                self.store.delete([point_id(k) for k in keys])
            else:
                self.store.delete_tenant(tenant)
        return len(keys)

    def stats(self) -> dict[str, float]:
        skip: dict[str, float] = {}
        if self.skip is not None:
            for policy in self.skip.values():
                for k, v in policy.counts.items():
                    skip[f"bounded_{k}"] = skip.get(f"bounded_{k}", 0) + v
            skip["bounded_tenants"] = len(self.skip)
        return {"entries": len(self.exact), **self.counts, **skip}
