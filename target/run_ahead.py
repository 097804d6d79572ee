"""A lone request's next decode step, run by the worker the moment its last one ends.

Between two steps of a request the worker otherwise waits for a round trip through the event
loop: the loop takes the step's chunk, asks for the next step (`ModelService._step_ahead`), and
the worker wakes for it: two thread wake-ups a token. While one request decodes and no job
waits for the worker, the worker claims that request's next step here, hands the loop the
chunk it has, and runs the claimed step at once; the loop, asking for the request's next step,
takes the claim up instead of queueing a step, and the worker answers the future it left.

The bound stays one step ahead of the loop, as with the loop's own step ahead: a request has one
claim at most, and the worker claims again only once the loop has taken the last claim up. The
loop owns the futures, the worker the steps; this object, under its lock, is where they meet.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

NOTHING = object()  # a claimed step whose result has not come yet


class _Claim:
    __slots__ = ("future", "result")

    def __init__(self) -> None:
        self.future: asyncio.Future | None = None  # the loop's, once it takes the claim up
        self.result: Any = NOTHING  # the step's, where it came before the loop took the claim up


class RunAhead:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._claims: dict[Any, _Claim] = {}  # generation -> its claimed next step

    def __len__(self) -> int:
        return len(self._claims)

    def claim(self, gen: Any) -> bool:
        """Worker: claim `gen`'s next step, before handing the loop the chunk it has. False
        while an earlier claim of `gen`'s is under way."""
        with self._lock:
            if gen in self._claims:
                return False
            self._claims[gen] = _Claim()
            return True

    def finish(self, gen: Any, result: Any) -> asyncio.Future | None:
        """Worker: the claimed step's result. The loop's future for it where the loop took the
        claim up (the claim ends: answer that future); else None, and the result waits here for
        the loop, or is dropped with its request."""
        with self._lock:
            claim = self._claims.get(gen)
            if claim is None:
                return None
            if claim.future is None:
                claim.result = result
                return None
            del self._claims[gen]
            return claim.future

    def take_up(self, gen: Any, loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Future, Any] | None:
        """Loop: `gen`'s claimed step, as (the future its chunk comes to, the chunk where it is
        here already, for the caller to answer the future with; else NOTHING, and the worker
        answers it). None: nothing claimed; queue the step."""
        with self._lock:
            claim = self._claims.get(gen)
            if claim is None:
                return None
            future = loop.create_future()
            if claim.result is NOTHING:
                claim.future = future
                return future, NOTHING
            del self._claims[gen]
            return future, claim.result

    def forget(self, gen: Any) -> None:
        """Loop: `gen`'s request is over; a step claimed for it is dropped when it ends."""
        with self._lock:
            self._claims.pop(gen, None)
