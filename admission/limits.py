"""Per-tenant token buckets on requests and tokens: over the rate is a 429 with Retry-After.

Each ingress replica enforces its share of a tenant's rate (rate / live ingress replicas, from
the controller), so the check is in-process and the service-wide rate holds.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from configs.schemas import AdmissionConfig


@dataclass
class TokenBucket:
    rate: float  # per second
    burst: float
    level: float
    at: float

    def take(self, amount: float, now: float, share: float) -> float:
        """Take `amount`; return 0 on success, else the seconds until it would be available."""
        rate, burst = self.rate * share, max(1.0, self.burst * share)
        self.level = min(burst, self.level + (now - self.at) * rate)
        self.at = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > burst:  # more than a full bucket holds: it goes through once the bucket is
            if self.level >= burst:  # full, leaving a debt that later requests wait out
                self.level -= amount
                return 0.0
            return (burst - self.level) / rate
        return (amount - self.level) / rate

    def give_back(self, amount: float) -> None:
        self.level += amount


@dataclass
class OverLimit(Exception):
    limit: str  # "requests" | "tokens"
    retry_after_s: int
    rate: float


class TenantLimiter:
    def __init__(self, config: AdmissionConfig, clock=time.monotonic, max_tenants: int = 100_000) -> None:
        self.config = config
        self._clock = clock
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self._max_tenants = max_tenants
        self.share = 1.0  # 1 / live ingress replicas
        self.limited = 0

    def check(self, owner: str, tokens: int) -> None:
        """Charge one request and its tokens to the tenant, or raise `OverLimit` (charging nothing)."""
        limits = self.config.tenant(owner)
        now = self._clock()
        pair = self._buckets.get(owner)
        if pair is None:
            if len(self._buckets) >= self._max_tenants:  # bounded memory: forget the idle ones
                self._buckets.clear()
            pair = (
                TokenBucket(limits.requests_per_s, limits.request_burst, limits.request_burst * self.share, now),
                TokenBucket(limits.tokens_per_s, limits.token_burst, limits.token_burst * self.share, now),
            )
            self._buckets[owner] = pair
        requests, token_bucket = pair
        wait = requests.take(1, now, self.share)
        if wait:
            self.limited += 1
            raise OverLimit("requests", max(1, math.ceil(wait)), limits.requests_per_s)
        wait = token_bucket.take(tokens, now, self.share)
        if wait:
            requests.give_back(1)
            self.limited += 1
            raise OverLimit("tokens", max(1, math.ceil(wait)), limits.tokens_per_s)
