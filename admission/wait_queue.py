"""The requests waiting for an admission slot, and the order they start in: every one of a
higher priority first; within a priority, the least-served tenant (the virtual token counter
of admission/fair_share.py), and within a tenant the earliest deadline. A tenant at its cap
starts nothing more until one of its own ends, so its queue is ahead of no one."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import Counter
from collections.abc import Callable

from admission.fair_share import TenantShares
from admission.ticket import Ticket

INF = float("inf")
# (priority, deadline, arrival number, ticket, its waiter: set when it starts, cancelled when it leaves)
Entry = tuple[int, float, int, Ticket, "asyncio.Future[None]"]
Room = Callable[[Ticket], bool]  # may its tenant start one more now?


class WaitQueue:
    def __init__(self, shares: TenantShares) -> None:
        self.shares = shares
        self._entries: list[Entry] = []
        self._seq = itertools.count()

    def __bool__(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        """Tickets still waiting."""
        return sum(1 for *_, w in self._entries if not w.done())

    def by_model(self) -> dict[str, int]:
        return dict(Counter(t.model_id for *_, t, w in self._entries if not w.done()))

    def of(self, tenant: str) -> int:
        return sum(1 for *_, q, w in self._entries if not w.done() and q.tenant == tenant)

    def tenants(self) -> set[str]:
        return {q.tenant for *_, q, w in self._entries if not w.done()}

    def push(self, t: Ticket) -> asyncio.Future[None]:
        """Queue `t`; its waiter is set when it starts."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._entries, (t.priority, t.deadline or INF, next(self._seq), t, waiter))
        return waiter

    def remove(self, t: Ticket) -> None:
        self._entries = [e for e in self._entries if e[3] is not t]
        heapq.heapify(self._entries)

    def prune(self) -> None:
        """Forget the tickets that started or left."""
        self._entries = [e for e in self._entries if not e[4].done()]
        heapq.heapify(self._entries)

    def ahead(self, t: Ticket, room: Room) -> list[Ticket]:
        """The queued tickets that would start before `t`: every one of a higher priority; in
        its own, its tenant's with an earlier deadline, and another tenant's whose virtual
        counter, with that tenant's earlier tickets started, stays below `t`'s tenant's."""
        live = sorted((e for e in self._entries if not e[4].done() and e[0] <= t.priority), key=lambda e: e[:3])
        rooms = {q.tenant: room(q) for _, _, _, q, _ in live if q.tenant != t.tenant}
        live = [e for e in live if e[3].tenant == t.tenant or rooms[e[3].tenant]]
        ahead = [q for p, _, _, q, _ in live if p < t.priority]
        same = [q for p, _, _, q, _ in live if p == t.priority]
        own = [q for q in same if q.tenant == t.tenant and (q.deadline or INF) <= (t.deadline or INF)]
        waiting = self.tenants()
        mine_at = self.shares.counter(t.tenant, waiting) + sum(q.cost for q in own)
        counters: dict[str, float] = {}
        for q in same:
            if q.tenant == t.tenant:
                continue
            at = counters.setdefault(q.tenant, self.shares.counter(q.tenant, waiting))
            if at < mine_at:
                ahead.append(q)
            counters[q.tenant] = at + q.cost
        return ahead + own

    def next(self, room: Room) -> tuple[Ticket, asyncio.Future[None]] | None:
        """The queued ticket to start next: of the tenants under their cap, the highest
        priority; in it, the least-served tenant, and its earliest deadline. None when no queued
        ticket's tenant may start one now."""
        live = [e for e in self._entries if not e[4].done() and room(e[3])]
        if not live:
            return None
        top = min(e[0] for e in live)
        waiting = self.tenants()
        best = min((e for e in live if e[0] == top), key=lambda e: (self.shares.counter(e[3].tenant, waiting), e[1], e[2]))
        return best[3], best[4]
