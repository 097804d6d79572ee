"""What one request has under way between the steps of `Pipeline.serve`, let go of exactly
once, whoever gets there first: the answer, an error, a timeout or the client leaving."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from admission.gate import Ticket
from ingress.cache_client import CacheState
from ingress.model_calls import Call
from admission.arrivals import Arrival
from ingress.placement import Admitted
from ingress.prompts import PromptBuilder


@dataclass
class InFlight:
    """The spine's own: each field set by the step that started it."""

    tickets: list[Ticket] = field(default_factory=list)  # admission's candidates, before routing
    arrival: Arrival | None = None  # counted on the box as about to run, until placed
    cache: CacheState | None = None  # the request's dealings with the cache
    lookup: asyncio.Future | None = None  # the cache lookup
    routing: asyncio.Future | None = None  # the router's verdict
    admitted: Admitted | None = None  # where it runs, and its admission slot
    builder: PromptBuilder | None = None  # that model's prompt builder
    call: Call | None = None  # the model call
    first_chunk: asyncio.Future | None = None

    def call_off(self) -> None:
        """A cache hit beside the model call: stop the model, free the slot."""
        if self.first_chunk is not None:
            self.first_chunk.cancel()
        if self.call is not None:
            self.call.cancel()
            self.call = None
        if self.admitted is not None:
            self.admitted.permit.release()

    def placed(self) -> None:
        """Its model is chosen, or a cache hit needs none: no longer about to run."""
        if self.arrival is not None:
            self.arrival.end()

    def abandon(self) -> None:
        """An error, a timeout or the client gone (CancelledError): free the slot, stop the model."""
        self.placed()
        if self.admitted is not None:
            self.admitted.permit.release()
        for pending in (self.lookup, self.routing, self.first_chunk):
            if pending is not None and not pending.done():
                pending.cancel()
        if self.call is not None:
            self.call.cancel()
