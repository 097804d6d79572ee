"""Fair share between tenants: how much of the service one API key may hold, and whose turn it
is in the queue.

While more than one tenant is active (seen within TENANT_ACTIVE_S, on any ingress replica),
one holds at most `share` of the slots, of each model's seats (of this ingress replica's share
of them) and of the queue, so another tenant's request always finds room; a tenant alone has
all of it. Activity is the fleet's: a client keeps its connection to one ingress replica, and
judged by its own callers alone, the replica a flood's connections land on would see one
tenant and let it take every seat of a model, while the other tenant, on the other replica,
waits for seats that never free. The queue is served by a virtual token counter (VTC): the
tenant served the fewest tokens goes next, and
a tenant back from a pause starts level with the least-served tenant waiting, not with credit
banked while it was away. Plain data, no asyncio: the gate (admission/gate.py) asks it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Protocol

# A tenant seen within this long counts as active: while another is, each is held to its share.
TENANT_ACTIVE_S = 60.0
# Tenants a replica reports as active here (the most recent): two are enough for every other
# replica to know that someone other than any one tenant is active.
REPORTED_TENANTS = 2
MAX_TENANTS = 100_000  # counters kept; the least-served (idlest) go first past it


class Holder(Protocol):
    tenant: str
    model_id: str
    cost: int


class TenantShares:
    def __init__(self, share: float = 1.0, clock=time.monotonic) -> None:
        self.share = share
        # This ingress replica's share of the fleet (1 / live ingress replicas, from the
        # controller): a tenant's cap on a model's seats is of this replica's share of them,
        # so the replicas together never let one tenant take the seats kept for others.
        self.ingress_share = 1.0
        self._clock = clock
        self._served: dict[str, float] = {}  # tenant -> tokens started (the virtual token counter)
        self._seen: dict[str, float] = {}  # tenant -> when it last asked for a slot
        self.elsewhere: frozenset[str] = frozenset()  # active on the other ingress replicas (synced)

    @property
    def capped(self) -> bool:
        return self.share < 1.0

    def cap(self, limit: float) -> int:
        """A tenant's share of `limit`."""
        return max(1, math.ceil(self.share * limit))

    def seen(self, tenant: str) -> None:
        now = self._clock()
        self._seen[tenant] = now
        if len(self._seen) > 10_000:
            self._seen = {k: v for k, v in self._seen.items() if v >= now - TENANT_ACTIVE_S}

    def others_active(self, tenant: str) -> bool:
        """Has another tenant asked for a slot within TENANT_ACTIVE_S, here or elsewhere?"""
        if any(other != tenant for other in self.elsewhere):
            return True
        horizon = self._clock() - TENANT_ACTIVE_S
        return any(at >= horizon for other, at in self._seen.items() if other != tenant)

    def active_here(self) -> tuple[str, ...]:
        """The most recently active tenants of this replica, for the others (REPORTED_TENANTS)."""
        horizon = self._clock() - TENANT_ACTIVE_S
        recent = sorted(((at, t) for t, at in self._seen.items() if at >= horizon), reverse=True)
        return tuple(t for _, t in recent[:REPORTED_TENANTS])

    def room(self, t: Holder, running: Iterable[Holder], max_inflight: int, seats: int | None) -> bool:
        """May `t`'s tenant start one more: under its share of the slots and of its model's
        seats? A tenant alone on the service has the whole of it."""
        if not self.capped or not self.others_active(t.tenant):
            return True
        mine = [r for r in running if r.tenant == t.tenant]
        if len(mine) >= self.cap(max_inflight):
            return False
        return seats is None or sum(1 for r in mine if r.model_id == t.model_id) < self.cap(seats * self.ingress_share)

    def first_of(self, t: Holder, running: Iterable[Holder]) -> bool:
        """Would `t` be its tenant's only request running here, while another tenant is active?
        Past the knee (a per-token target the box can't keep with one more sequence) it starts
        all the same: the knee another tenant's flood reached is no reason for this one to wait
        for that flood to end."""
        return self.others_active(t.tenant) and not any(r.tenant == t.tenant for r in running)

    def queue_full(self, tenant: str, queued: int, max_queued: int) -> bool:
        """Does the tenant hold its share of the queue while another tenant is active?"""
        return self.capped and self.others_active(tenant) and queued >= self.cap(max_queued)

    def crowded(self, t: Holder, running: Iterable[Holder], seats: int | None, elsewhere: int = 0) -> bool:
        """While other tenants are active, do they hold half or more of this replica's share of
        `t`'s model's seats, or of all of them counting `elsewhere` (the model's requests on the
        other ingress replicas, known only as a count) as theirs? A flood's connections may all
        be on another replica."""
        if seats is None or not self.capped or not self.others_active(t.tenant):
            return False
        here = sum(1 for r in running if r.model_id == t.model_id and r.tenant != t.tenant)
        return here >= max(1.0, seats * self.ingress_share / 2) or here + elsewhere >= max(1.0, seats / 2)

    def counter(self, tenant: str, waiting: set[str]) -> float:
        """A tenant's virtual counter, lifted to the least-served waiting tenant's if it fell
        behind while it had nothing waiting."""
        own = self._served.get(tenant, 0.0)
        if tenant in waiting:
            return own
        others = [self._served.get(x, 0.0) for x in waiting]
        return max(own, min(others)) if others else own

    def started(self, t: Holder, waiting: set[str]) -> None:
        """`t` started: its tenant's counter moves on by its cost."""
        self._served[t.tenant] = self.counter(t.tenant, waiting) + t.cost
        if len(self._served) > MAX_TENANTS:
            for tenant in sorted(self._served, key=self._served.__getitem__)[: MAX_TENANTS // 10]:
                del self._served[tenant]
