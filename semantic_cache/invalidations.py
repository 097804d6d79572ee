"""Invalidations every cache replica and every ingress's near cache must apply.

`DELETE /v1/cache` reaches one SemanticCache replica directly (its answer counts what it
dropped) and is also written here, in the AdmissionController, the fleet's one coordinator.
Every SemanticCache replica asks for what it has not applied yet every second, and every
ingress learns it with its admission sync: within about a second no replica serves a dropped
answer. A replica that fell so far behind that the log no longer holds what it missed drops
everything it holds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

EVERYTHING = None  # in `Invalidations.tenants`: drop every tenant's answers


@dataclass(slots=True)
class Invalidations:
    seq: int  # the log's position after these: ask with it next time
    tenants: list[str | None] = field(default_factory=list)  # None: everything (the asker fell behind)


class InvalidationLog:
    def __init__(self, keep: int = 1024) -> None:
        self._log: deque[tuple[int, str]] = deque(maxlen=keep)
        self._seq = 0

    @property
    def seq(self) -> int:
        return self._seq

    def add(self, tenant: str) -> int:
        self._seq += 1
        self._log.append((self._seq, tenant))
        return self._seq

    def since(self, seq: int) -> Invalidations:
        """What came after `seq` (a fresh replica asks with -1 and gets only the position)."""
        if seq < 0 or seq >= self._seq:
            return Invalidations(self._seq)
        if self._log and self._log[0][0] > seq + 1:  # the log no longer holds all it missed
            return Invalidations(self._seq, [EVERYTHING])
        return Invalidations(self._seq, [tenant for n, tenant in self._log if n > seq])
