"""What one request holds while it is served: its admission slot (`Permit`) and the work under
way between the spine's steps (`InFlight`), each let go of exactly once, whoever gets there
first: the answer, an error, a timeout or the client leaving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from admission.gate import AdmissionGate, Ticket
from engines.types import GenerateChunk, GenerateRequest
from ingress.errors import APIError
from ingress.prompts import PromptBuilder
from router.base import RouteDecision
from router.load import LoadTracker


class ModelStream(Protocol):
    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...
    async def __anext__(self) -> GenerateChunk: ...
    def cancel(self) -> None: ...  # never raises: it runs in cleanup paths


# Ray's "the actor is gone" errors, by name so the ingress needs no Ray: RayActorError and its
# ActorDiedError, and ActorUnavailableError (unreachable, being replaced). Another way to a
# replica says so with a true `replica_gone` class attribute.
_REPLICA_GONE = {"RayActorError", "ActorDiedError", "ActorUnavailableError"}


def replica_gone(exc: BaseException) -> bool:
    return getattr(type(exc), "replica_gone", False) or any(cls.__name__ in _REPLICA_GONE for cls in type(exc).__mro__)


class ReplicaFailed(APIError):
    """The model replica failed under the request (a 503): safe to retry until output was sent."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(503, f"the model replica failed: {type(exc).__name__}", code="backend_error")
        self.replica_gone = replica_gone(exc)


class Permit:
    """An admission slot, released exactly once whoever gets there first. `model_load` is the
    router's in-flight count of the model the request runs on, released with the slot."""

    def __init__(self, gate: AdmissionGate | None, ticket: Ticket | None = None) -> None:
        self._gate = gate
        self._ticket = ticket
        self._released = False
        self._loads: list[tuple[LoadTracker, str]] = []

    def count_on(self, load: LoadTracker, model_id: str) -> None:
        """Count the request on `load` (router/load.py's LoadTracker) until the slot is released."""
        load.started(model_id)
        self._loads.append((load, model_id))

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._gate is not None and self._ticket is not None:
                self._gate.release(self._ticket)
            for load, model_id in self._loads:
                load.finished(model_id)


@dataclass
class InFlight:
    """What one request has under way between the steps of `Pipeline.serve`."""

    lookup: asyncio.Future | None = None  # the cache lookup
    routing: asyncio.Future | None = None  # the router's verdict
    permit: Permit | None = None  # its admission slot
    stream: ModelStream | None = None  # the model call
    first_chunk: asyncio.Future | None = None
    decision: RouteDecision | None = None  # the model that answers, and why
    builder: PromptBuilder | None = None  # that model's prompt builder
    generate: GenerateRequest | None = None  # what was sent to it
    first_at: float = 0.0  # perf_counter() at its first chunk
    tickets: list[Ticket] = field(default_factory=list)  # admission's candidates, before routing

    def call_off(self) -> None:
        """A cache hit beside the model call: stop the model, free the slot."""
        if self.first_chunk is not None:
            self.first_chunk.cancel()
        if self.stream is not None:
            self.stream.cancel()
            self.stream = None
        if self.permit is not None:
            self.permit.release()

    def abandon(self) -> None:
        """An error, a timeout or the client gone (CancelledError): free the slot, stop the model."""
        if self.permit is not None:
            self.permit.release()
        for pending in (self.lookup, self.routing, self.first_chunk):
            if pending is not None and not pending.done():
                pending.cancel()
        if self.stream is not None:
            self.stream.cancel()
