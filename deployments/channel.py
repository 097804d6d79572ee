"""A same-node side channel to a deployment's replica: a Unix socket, beside its Serve handle.

A cache lookup is the one hop that runs beside a prefill, and every millisecond it takes keeps
the prefill on one thread (engines/lookup_signal.py). Over a Serve handle it took ~10 ms
more than the lookup's own work beside a prefill (router thread, gRPC, the replica's request
machinery, and back); over this socket it is one write and one read. Serve still starts,
scales and health-checks the replica: the channel is only another door to the same object.

- The socket lives in a fresh 0700 directory, so only this user's processes can connect (the
  frames are pickles, as Ray's own are).
- A caller on another node, or with no socket yet, uses the handle (`ChannelPool`).
- Several calls share one connection; answers come back in any order, by call id.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")

# Past this many calls in flight on a channel, callers take the handle, where Serve's own
# limits (max_ongoing_requests, max_queued_requests) apply: the socket itself queues without end.
MAX_IN_FLIGHT = 128


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return pickle.loads(await reader.readexactly(size))


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


class ChannelServer:
    """Serves `methods` (name -> async function) on a Unix socket until `close()`."""

    def __init__(self, methods: dict[str, Callable[..., Awaitable[Any]]]) -> None:
        self._methods = methods
        self._dir = tempfile.mkdtemp(prefix="ls-chan-")  # mkdtemp makes it 0700
        self.path = os.path.join(self._dir, "s")
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> "ChannelServer":
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                call_id, name, args = await _read_frame(reader)
                task = asyncio.ensure_future(self._answer(writer, call_id, name, args))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, call_id: int, name: str, args: tuple) -> None:
        try:
            method = self._methods[name]
            reply = (call_id, None, await method(*args))
        except Exception as exc:  # the caller raises it (RemoteError); the channel goes on
            reply = (call_id, f"{type(exc).__name__}: {exc}", None)
        if not writer.is_closing():
            writer.write(_frame(reply))

    def close(self) -> None:
        """Stop listening and hang up on every caller (their pending calls fail at once)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class ChannelError(ConnectionError):
    """The connection failed: the call may not have run; another way to the replica may work."""


class RemoteError(RuntimeError):
    """The call ran and raised at the other end (its type and message, as text)."""


class ChannelClient:
    """One connection to a `ChannelServer`; `call` is safe from many tasks at once."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self.broken = False

    async def connect(self) -> "ChannelClient":
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        self._reader_task = asyncio.ensure_future(self._read_forever(reader))
        return self

    async def _read_forever(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, error, result = await _read_frame(reader)
                future = self._waiting.pop(call_id, None)
                if future is None or future.done():
                    continue
                if error is not None:
                    future.set_exception(RemoteError(error))
                else:
                    future.set_result(result)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        waiting, self._waiting = self._waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(ChannelError(f"channel to {self.path} lost: {exc!r}"))
        if self._writer is not None:
            self._writer.close()

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def call(self, name: str, *args: Any) -> Any:
        if self.broken or self._writer is None:
            raise ChannelError(f"channel to {self.path} is closed")
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        try:
            try:
                self._writer.write(_frame((call_id, name, args)))
            except (OSError, RuntimeError) as exc:  # the transport closed under us
                self._fail(exc)
                raise ChannelError(f"channel to {self.path} lost: {exc!r}") from exc
            return await future
        finally:
            self._waiting.pop(call_id, None)

    def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._fail(ConnectionError("closed"))


class ChannelPool:
    """The side channels one caller knows of, to the replicas of one deployment on its node.

    `learn` takes what a replica's `channel()` method said (over the handle, off the request
    path); `pick` gives the live channel with the fewest calls in flight, or None (use the
    handle): none known, or all at `max_in_flight`. A replica that went away breaks its
    connection and drops out here."""

    def __init__(self, node_id: str, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.node_id = node_id
        self.max_in_flight = max_in_flight
        self._clients: dict[str, ChannelClient] = {}  # by socket path

    async def learn(self, where: dict | None) -> bool:
        """Connect to a replica's channel if it is on this node and new; True if connected."""
        if not where or where.get("node_id") != self.node_id or where.get("path") in self._clients:
            return False
        try:
            client = await ChannelClient(where["path"]).connect()
        except OSError as exc:  # gone since it answered, or a socket this user can't open
            log.warning("no side channel to %s: %r", where["path"], exc)
            return False
        self._clients[client.path] = client
        return True

    def pick(self) -> ChannelClient | None:
        for path in [p for p, c in self._clients.items() if c.broken]:
            del self._clients[path]
        if not self._clients:
            return None
        least = min(self._clients.values(), key=lambda c: c.in_flight)
        return least if least.in_flight < self.max_in_flight else None

    def __len__(self) -> int:
        return sum(not c.broken for c in self._clients.values())

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
