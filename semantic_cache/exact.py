"""Exact-match response cache with TTL and LRU eviction, namespaced by tenant."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from configs.schemas import CacheConfig


@dataclass(slots=True)
class CachedResponse:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    model_id: str
    created_unix: float = field(default_factory=time.time)


class ExactCache:
    def __init__(self, config: CacheConfig, clock=time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, str, CachedResponse]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> CachedResponse | None:
        item = self._entries.get(key)
        if item is None:
            self.misses += 1
            return None
        expires, _tenant, value = item
        if self._clock() >= expires:
            del self._entries[key]
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: str, tenant: str, value: CachedResponse) -> list[str]:
        """Store; return the keys evicted to stay within `max_entries` (oldest use first)."""
        self._entries[key] = (self._clock() + self.config.ttl_s, tenant, value)
        self._entries.move_to_end(key)
        evicted = []
        while len(self._entries) > self.config.max_entries:
            evicted.append(self._entries.popitem(last=False)[0])
        return evicted

    def touch(self, key: str) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def expired(self) -> list[str]:
        """Drop and return the keys past their TTL."""
        now = self._clock()
        gone = [k for k, (expires, _, _) in self._entries.items() if now >= expires]
        for k in gone:
            del self._entries[k]
        return gone

    def tenant_of(self, key: str) -> str | None:
        item = self._entries.get(key)
        return None if item is None else item[1]

    def invalidate(self, tenant: str | None = None) -> list[str]:
        """Drop one tenant's entries, its `x-tenant` namespaces' ("tenant/sub") included (or
        all); return their keys."""
        inside = f"{tenant}/"
        keys = [k for k, (_, t, _) in self._entries.items() if tenant is None or t == tenant or t.startswith(inside)]
        for k in keys:
            del self._entries[k]
        return keys
