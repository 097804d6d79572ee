"""Single-flight: identical cacheable requests in flight at once share one generation.

The first request (leader) starts the model; followers with the same exact cache key attach
to the same flight and replay its chunks from the start, then follow live. The generation
belongs to the flight, not to the leader: it keeps going while anyone still listens, and is
cancelled (within one decode step) when the last listener leaves.

Scope: one ingress replica. Requests spread over several ingress replicas coalesce per replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from engines.types import GenerateChunk


class ModelStream(Protocol):
    def __aiter__(self) -> AsyncIterator[GenerateChunk]: ...
    async def __anext__(self) -> GenerateChunk: ...
    def cancel(self) -> None: ...


class Flight:
    def __init__(self, key: str, source: ModelStream, on_end: Callable[["Flight"], None]) -> None:
        self.key = key
        self.chunks: list[GenerateChunk] = []
        self.error: BaseException | None = None
        self.done = False
        self.listeners = 0
        self._source = source
        self._on_end = on_end
        self._changed = asyncio.Event()
        self._pump = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        try:
            while True:
                chunk = await self._source.__anext__()
                self.chunks.append(chunk)
                self._wake()
                if chunk.finish_reason is not None:
                    break
        except StopAsyncIteration:
            pass
        except asyncio.CancelledError:
            self._source.cancel()
            self.error = asyncio.CancelledError()
        except BaseException as exc:  # the listeners see the model's failure as their own
            self.error = exc
        finally:
            self.done = True
            self._wake()
            self._on_end(self)

    def _wake(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def listen(self) -> "FlightStream":
        self.listeners += 1
        return FlightStream(self)

    def leave(self) -> None:
        self.listeners -= 1
        if self.listeners <= 0 and not self.done:
            self._pump.cancel()  # nobody is listening: stop the model


class FlightStream:
    """One listener's view of a flight; a `ModelStream` like any other."""

    def __init__(self, flight: Flight) -> None:
        self._flight = flight
        self._next = 0
        self._left = False

    def __aiter__(self) -> "FlightStream":
        return self

    async def __anext__(self) -> GenerateChunk:
        flight = self._flight
        while self._next >= len(flight.chunks):
            if flight.done:
                if flight.error is not None and not isinstance(flight.error, asyncio.CancelledError):
                    raise flight.error
                raise StopAsyncIteration
            await flight._changed.wait()
        chunk = flight.chunks[self._next]
        self._next += 1
        return chunk

    def cancel(self) -> None:
        if not self._left:
            self._left = True
            self._flight.leave()


class Flights:
    def __init__(self) -> None:
        self._active: dict[str, Flight] = {}
        self.coalesced = 0

    def join(self, key: str, start: Callable[[], ModelStream]) -> tuple[FlightStream, bool]:
        """A stream for `key`; True when it follows a generation already in flight."""
        flight = self._active.get(key)
        if flight is not None and not flight.done:
            self.coalesced += 1
            return flight.listen(), True
        flight = Flight(key, start(), self._ended)
        self._active[key] = flight
        return flight.listen(), False

    def _ended(self, flight: Flight) -> None:
        if self._active.get(flight.key) is flight:
            del self._active[flight.key]
