"""Whether every stage on the request path answers yet. The ingress deployment owns it (it
warms the stages and then says so); requests and /health read it."""

from __future__ import annotations

import asyncio
import time

from ingress.errors import APIError


class Readiness:
    def __init__(self, ready: bool = True) -> None:
        self.ready = ready

    def set(self, ready: bool = True) -> None:
        self.ready = ready

    async def wait(self, wait_s: float) -> None:
        """Before every stage answers: wait for it up to `wait_s`, then a 503 that says so (never
        a deadline or load message: nothing is known of either yet). `/v1/models` waits too: a
        client that polls it before its first request (load tools do) would otherwise send that
        request before the stages answer."""
        deadline = time.monotonic() + wait_s
        while not self.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.ready:
            raise APIError(
                503, "the service is warming up: its stages are loading; retry shortly", code="warming_up",
                headers={"Retry-After": "5"},
            )
