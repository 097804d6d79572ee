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

    def put(self, key: str, tenant: str, value: CachedResponse) -> None:
        self._entries[key] = (self._clock() + self.config.ttl_s, tenant, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.config.max_entries:
            self._entries.popitem(last=False)

    def invalidate(self, tenant: str | None = None) -> int:
        """Drop one tenant's entries (or all); return how many went."""
        if tenant is None:
            dropped = len(self._entries)
            self._entries.clear()
            return dropped
        keys = [k for k, (_, t, _) in self._entries.items() if t == tenant]
        for k in keys:
            del self._entries[k]
        return len(keys)
