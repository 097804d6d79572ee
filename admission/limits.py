"""Per-tenant token buckets on requests and tokens: over the rate is a 429 with Retry-After.

Each ingress replica enforces its share of a tenant's rate (rate / live ingress replicas, from
the controller), so the check is in-process and the service-wide rate holds.

Tenants with limits of their own (named in `admission.tenants` or listed API keys) each have a
bucket; every other caller shares one, so minting keys buys no extra rate. Buckets are kept
for the most recently seen tenants, the idlest forgotten first.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Iterable
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


SHARED = "*"  # the bucket of every caller without limits of its own


class TenantLimiter:
    def __init__(
        self, config: AdmissionConfig, clock=time.monotonic, max_tenants: int = 100_000, own_buckets: Iterable[str] | None = None,
    ) -> None:
        self.config = config
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[TokenBucket, TokenBucket]] = OrderedDict()
        self._max_tenants = max_tenants
        # None: every tenant has its own bucket (as in unit tests)
        self._own = None if own_buckets is None else set(own_buckets)
        self.share = 1.0  # 1 / live ingress replicas
        self.limited = 0

    def bucket_of(self, owner: str) -> str:
        return owner if self._own is None or owner in self._own else SHARED

    def _pair(self, owner: str, now: float) -> tuple[TokenBucket, TokenBucket]:
        name = self.bucket_of(owner)
        pair = self._buckets.get(name)
        if pair is not None:
            self._buckets.move_to_end(name)
            return pair
        limits = self.config.tenant(owner if name != SHARED else "default")
        pair = (
            TokenBucket(limits.requests_per_s, limits.request_burst, limits.request_burst * self.share, now),
            TokenBucket(limits.tokens_per_s, limits.token_burst, limits.token_burst * self.share, now),
        )
        self._buckets[name] = pair
        while len(self._buckets) > self._max_tenants:  # bounded memory: the idlest go first
            self._buckets.popitem(last=False)
        return pair

    def precheck(self, owner: str) -> None:
        """Raise `OverLimit` if the tenant has no request left now, charging nothing: a tenant
        over its rate is turned away before its prompt costs a tokenizer pass."""
        now = self._clock()
        requests, _ = self._pair(owner, now)
        rate, burst = requests.rate * self.share, max(1.0, requests.burst * self.share)
        level = min(burst, requests.level + (now - requests.at) * rate)
        if level < 1.0:
            self.limited += 1
            limits = self.config.tenant(owner if self.bucket_of(owner) != SHARED else "default")
            raise OverLimit("requests", max(1, math.ceil((1.0 - level) / rate)), limits.requests_per_s)

    def check(self, owner: str, tokens: int) -> None:
        """Charge one request and its tokens to the tenant, or raise `OverLimit` (charging nothing)."""
        now = self._clock()
        requests, token_bucket = self._pair(owner, now)
        limits = self.config.tenant(owner if self.bucket_of(owner) != SHARED else "default")
        wait = requests.take(1, now, self.share)
        if wait:
            self.limited += 1
            raise OverLimit("requests", max(1, math.ceil(wait)), limits.requests_per_s)
        wait = token_bucket.take(tokens, now, self.share)
        if wait:
            requests.give_back(1)
            self.limited += 1
            raise OverLimit("tokens", max(1, math.ceil(wait)), limits.tokens_per_s)

    def charge_tokens(self, owner: str, tokens: int) -> None:
        """Charge work that is not a request of its own (a grammar to convert, a guard to run)
        to the tenant's token bucket, or raise `OverLimit` (charging nothing)."""
        if tokens <= 0:
            return
        now = self._clock()
        _, token_bucket = self._pair(owner, now)
        wait = token_bucket.take(tokens, now, self.share)
        if wait:
            self.limited += 1
            limits = self.config.tenant(owner if self.bucket_of(owner) != SHARED else "default")
            raise OverLimit("tokens", max(1, math.ceil(wait)), limits.tokens_per_s)
