"""One request as admission, the cache and the engines see it: who, which tier, by when."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestContext:
    request_id: str  # ours, unique: what the engines, the cache's flights and response ids use
    tenant: str
    tier: str  # resolved against the configured tiers by the admission policy
    deadline: float | None  # time.monotonic(): the client's own deadline (a hard cut-off), or None
    no_cache: bool = False  # Cache-Control: no-cache -> skip the lookup
    no_store: bool = False  # Cache-Control: no-store -> skip the write
    cache_sampled: bool = False  # x-cache-sampled: allow -> a temperature > 0 request may use the cache
    received: float = field(default_factory=time.monotonic)
    tier_from_header: bool = False
    # What admission aims for: the client's deadline, else its tier's. Missing it is an SLO
    # miss, not an error: only the client's own deadline cuts a request off.
    target_deadline: float | None = None
    ttft_deadline: float | None = None
    client_request_id: str | None = None  # the client's x-request-id: echoed and logged, never used as a key
    admin: bool = False  # an admin key: admin routes, engine-internal counts in Server-Timing

    @property
    def cache_salt(self) -> str:
        """The tenant, hashed: what the engines key prefix KV by (never the tenant's name)."""
        return hashlib.sha256(self.tenant.encode()).hexdigest()[:32]

    def remaining_s(self, ceiling: float) -> float:
        """Seconds left for this request: its deadline, capped by a ceiling."""
        if self.deadline is None:
            return max(0.0, ceiling - (time.monotonic() - self.received))
        return max(0.0, min(self.deadline - time.monotonic(), ceiling))

    def target_unix(self) -> float | None:
        """The target deadline as wall-clock time (what the engine orders and drops by)."""
        target = self.target_deadline or self.deadline
        if target is None:
            return None
        return time.time() + (target - time.monotonic())
