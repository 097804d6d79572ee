"""In-process FIFO admission gate, run inside each ingress replica.

The decision costs no hop: the ingress checks its own counters. The controller only tells
each replica its share of the service-wide limits, off the request path.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass


@dataclass
class Rejection(Exception):
    """Why a request was not admitted. Rendered as 503 + Retry-After + JSON body."""

    reason: str  # "queue_full" | "deadline_in_queue"
    message: str
    retry_after_s: int
    queued_ahead: int
    waited_ms: float = 0.0


class AdmissionGate:
    def __init__(self, max_inflight: int, max_queued: int, retry_after_s: int = 1) -> None:
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.inflight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.admitted = 0
        self.rejected = 0

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def set_limits(self, max_inflight: int, max_queued: int) -> None:
        self.max_inflight = max(1, max_inflight)
        self.max_queued = max(0, max_queued)
        self._wake()

    async def acquire(self, timeout_s: float) -> None:
        """Admit now, wait in FIFO order, or raise `Rejection`. Pair with `release()`."""
        if self.inflight < self.max_inflight and not self._waiters:
            self.inflight += 1
            self.admitted += 1
            return
        ahead = len(self._waiters)
        if ahead >= self.max_queued:
            self.rejected += 1
            raise Rejection("queue_full", "the service is at capacity and its queue is full", self.retry_after_s, ahead)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        loop = asyncio.get_running_loop()
        start = loop.time()
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout=max(0.0, timeout_s))
        except asyncio.TimeoutError:
            if waiter.done() and not waiter.cancelled():
                return  # admitted in the same instant the timeout fired: keep the slot
            self._discard(waiter)
            self.rejected += 1
            waited = (loop.time() - start) * 1000
            raise Rejection(
                "deadline_in_queue",
                "the request's deadline passed while it waited for a slot",
                self.retry_after_s,
                ahead,
                waited,
            ) from None
        except asyncio.CancelledError:
            # Client went away while queued: give the slot back if we had just received it.
            if waiter.done() and not waiter.cancelled():
                self.release()
            else:
                self._discard(waiter)
            raise
        self.admitted += 1

    def release(self) -> None:
        self.inflight -= 1
        self._wake()

    def _discard(self, waiter: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass
        waiter.cancel()

    def _wake(self) -> None:
        while self._waiters and self.inflight < self.max_inflight:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self.inflight += 1  # the slot is handed over, not re-raced
            waiter.set_result(None)
