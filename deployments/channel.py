"""A same-node side channel to a deployment's replica: a Unix socket, beside its Serve handle.

A cache lookup runs beside a prefill, and every millisecond it takes keeps the prefill on one
thread (host_tuning/lookup_window.py); a model call's way there and its first chunk back are on
every request's TTFT. Over a Serve handle those hops cost milliseconds, more beside a prefill
(the router thread, gRPC, the replica's request machinery, and back); over this socket a call
is one write and one read (`python -m bench hops` compares them). Serve
still places, starts, scales and health-checks the replica: the channel is only another door
to the same object.

- Unary calls (a lookup, a cache write, a late hint) and streams (`generate`), many at once
  on one connection; answers come back by call id. A cancel frame closes a stream's generator
  at the other end, as Serve does when its caller goes.
- Only the replica's callers get in: the socket lives in a fresh 0700 directory, the peer must
  run as this user (SO_PEERCRED), and it must answer a challenge with an HMAC of the replica's
  secret, which callers learn from `channel()` over the Serve handle. Frames are pickles of
  the known message types only (`_Frames`: no other class is ever built from one) and at most
  MAX_FRAME bytes, so a frame can't run code.
- A caller uses the handle instead on another node, with no socket known yet, past
  `max_in_flight`, or where the deployment autoscales (`offer`): Serve scales on the calls
  it sees (`ChannelPool`).
- A graceful shutdown drains it (`shut`): new calls are refused, calls under way end whole.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import inspect
import io
import itertools
import logging
import os
import pickle
import shutil
import socket
import struct
import tempfile
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_FRAME = 16 << 20  # a prompt's ids, a cache entry: far below this
HANDSHAKE_TIMEOUT_S = 5.0
_NONCE = 32

# The classes a frame may hold besides plain data: the calls' arguments and answers.
_ALLOWED = {
    ("engines.types", "GenerateRequest"), ("engines.types", "SamplingParams"), ("engines.types", "GenerateChunk"),
    ("engines.types", "StructuredOutput"),
    ("semantic_cache.cache", "CacheEntry"), ("semantic_cache.cache", "Lookup"),
    ("semantic_cache.exact", "CachedResponse"), ("host_tuning.lookup_window", "LookupOverlap"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.numeric", "_frombuffer"), ("copyreg", "_reconstructor"), ("builtins", "object"),
}


class _Frames(pickle.Unpickler):
    """Unpickles only the known message types: any other global in a frame is an error."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a side-channel frame may not hold {module}.{name}")

# Past this many calls in flight on a channel, callers take the handle, where Serve's own
# limits (max_ongoing_requests, max_queued_requests) apply: the socket itself queues without end.
MAX_IN_FLIGHT = 128


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"a {size}-byte frame is over the {MAX_FRAME}-byte limit")
    return _Frames(io.BytesIO(await reader.readexactly(size))).load()


def _frame(obj: Any) -> bytes:
    body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


_CANCEL = "__cancel__"  # a call's name that cancels the call with that id


class _Outbox:
    """A connection's outgoing frames, sent together once per turn of the event loop. A model
    step ends many streams' tokens at once; sent frame by frame, each is a system call and a
    wake-up of the reading process, per token. Gathered, one step's tokens cross in one write
    and wake the reader once, at no delay: the flush runs as soon as the loop is free."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self._frames: list[bytes] = []

    def put(self, frame: bytes) -> None:
        if not self._frames:
            asyncio.get_running_loop().call_soon(self._flush)
        self._frames.append(frame)

    def _flush(self) -> None:
        frames, self._frames = self._frames, []
        if not self.writer.is_closing():
            self.writer.write(b"".join(frames))


class ChannelServer:
    """Serves `methods` (name -> async function, or async generator function for a stream) on
    a Unix socket until `close()`. A caller that hangs up cancels its calls still running (a
    stream's generator is closed, as Serve closes it when its caller goes)."""

    def __init__(self, methods: dict[str, Callable[..., Any]]) -> None:
        self._methods = methods
        self.secret = os.urandom(32)  # a caller proves it knows this (learned over the Serve handle)
        self.refused = 0  # connections that failed the peer check or the challenge
        self._dir = tempfile.mkdtemp(prefix="ls-chan-")  # mkdtemp makes it 0700
        self.path = os.path.join(self._dir, "s")
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._running: set[asyncio.Task] = set()  # every connection's calls
        self._draining = False

    async def start(self) -> "ChannelServer":
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        return self

    async def _admit(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The peer runs as this user and answers the challenge with the secret's HMAC."""
        sock = writer.get_extra_info("socket")
        try:
            creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            _, uid, _ = struct.unpack("3i", creds)
            if uid != os.getuid():
                return False
            nonce = os.urandom(_NONCE)
            writer.write(nonce)
            proof = await asyncio.wait_for(reader.readexactly(32), HANDSHAKE_TIMEOUT_S)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            return False
        return hmac.compare_digest(proof, _proof(self.secret, nonce))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not await self._admit(reader, writer):
            self.refused += 1
            log.warning("side channel: refused a connection that failed the peer check")
            writer.close()
            return
        self._writers.add(writer)
        outbox = _Outbox(writer)
        calls: dict[int, asyncio.Task] = {}
        try:
            while True:
                call_id, name, args = await _read_frame(reader)
                if name == _CANCEL:
                    if (task := calls.get(call_id)) is not None:
                        task.cancel()
                    continue
                if self._draining:  # the caller takes another way (the handle) and stops coming here
                    outbox.put(_frame((call_id, "refused", "the replica is shutting down")))
                    continue
                task = asyncio.ensure_future(self._answer(outbox, call_id, name, args))
                calls[call_id] = task
                self._running.add(task)
                task.add_done_callback(lambda t, call_id=call_id: (calls.pop(call_id, None), self._running.discard(t)))
        except (asyncio.IncompleteReadError, ConnectionError, pickle.UnpicklingError, ValueError, TypeError):
            pass  # hung up, or sent what no caller of ours sends: the connection ends
        finally:
            self._writers.discard(writer)
            for task in list(calls.values()):
                task.cancel()
            writer.close()

    async def _answer(self, outbox: _Outbox, call_id: int, name: str, args: tuple) -> None:
        try:
            result = self._methods[name](*args)
            if inspect.isasyncgen(result):
                try:
                    async for item in result:
                        outbox.put(_frame((call_id, "item", item)))
                        await outbox.writer.drain()  # a caller that stopped reading holds the stream here
                finally:
                    await result.aclose()
                reply = (call_id, "end", None)
            else:
                reply = (call_id, "ok", await result)
        except Exception as exc:  # the caller raises it (RemoteError); the channel goes on
            reply = (call_id, "error", f"{type(exc).__name__}: {exc}")
        outbox.put(_frame(reply))

    async def drain(self, timeout_s: float) -> None:
        """For a graceful shutdown: refuse new calls, give those running up to `timeout_s` to
        finish (a stream that already sent tokens ends whole, as Serve drains its own), then
        close. Serve awaits this from the replica's `__del__`."""
        self._draining = True
        if self._server is not None:
            self._server.close()
        if running := [t for t in self._running if not t.done()]:
            await asyncio.wait(running, timeout=timeout_s)
        self.close()

    def close(self) -> None:
        """Stop listening and hang up on every caller (their pending calls fail at once)."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class ChannelError(ConnectionError):
    """The connection failed: the call may not have run; another way to the replica may work."""

    replica_gone = True  # to the request path: as a dead replica (retried once over the handle)


class RemoteError(RuntimeError):
    """The call ran and raised at the other end (its type and message, as text)."""


class ChannelStream:
    """The items of one streamed call, as an async iterator; `cancel()` stops it at the other end.
    It is the ingress pipeline's `ModelStream` as it stands: a lost connection raises
    ChannelError, which the pipeline takes as a dead replica (retried once, over the handle, if
    nothing reached the client)."""

    def __init__(self, client: "ChannelClient", call_id: int, items: asyncio.Queue) -> None:
        self._client, self._call_id, self._items = client, call_id, items
        self._done = False

    def __aiter__(self) -> "ChannelStream":
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        kind, payload = await self._items.get()
        if kind == "item":
            return payload
        self._done = True
        self._client._waiting.pop(self._call_id, None)
        if kind == "end":
            raise StopAsyncIteration
        raise RemoteError(payload) if kind == "error" else ChannelError(payload)  # lost, refused

    def cancel(self) -> None:
        """Never raises: with the connection gone, the call is gone at the other end too."""
        if not self._done:
            self._done = True
            self._client._waiting.pop(self._call_id, None)
            try:
                self._client._send((self._call_id, _CANCEL, ()))
            except ChannelError:
                pass


class ChannelClient:
    """One connection to a `ChannelServer`; `call` and `stream` are safe from many tasks at once."""

    def __init__(self, path: str, secret: bytes) -> None:
        self.path = path
        self._secret = secret
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future | asyncio.Queue] = {}  # a call's future, a stream's queue
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self.broken = False  # the connection is gone
        self.retired = False  # the replica refused a call: it is shutting down

    async def connect(self) -> "ChannelClient":
        reader, self._writer = await asyncio.open_unix_connection(self.path)
        try:
            nonce = await asyncio.wait_for(reader.readexactly(_NONCE), HANDSHAKE_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
            self._writer.close()
            raise ConnectionError(f"side channel {self.path} sent no challenge") from exc
        self._writer.write(_proof(self._secret, nonce))
        self._reader_task = asyncio.ensure_future(self._read_forever(reader))
        return self

    async def _read_forever(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                call_id, kind, payload = await _read_frame(reader)
                waiting = self._waiting.get(call_id)
                if kind == "refused":
                    self.retired = True  # pick() passes it by from now on; calls in flight go on
                if isinstance(waiting, asyncio.Queue):
                    waiting.put_nowait((kind, payload))
                    if kind != "item":  # over: not in flight, even if no one reads this far
                        del self._waiting[call_id]
                elif waiting is not None:
                    del self._waiting[call_id]
                    if waiting.done():
                        continue
                    if kind == "error":
                        waiting.set_exception(RemoteError(payload))
                    elif kind == "refused":
                        waiting.set_exception(ChannelError(payload))
                    else:
                        waiting.set_result(payload)
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.broken = True
        waiting, self._waiting = self._waiting, {}
        why = f"channel to {self.path} lost: {exc!r}"
        for target in waiting.values():
            if isinstance(target, asyncio.Queue):
                target.put_nowait(("lost", why))
            elif not target.done():
                target.set_exception(ChannelError(why))
        if self._writer is not None:
            self._writer.close()

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    def _send(self, frame: tuple) -> None:
        if self.broken or self._writer is None:
            raise ChannelError(f"channel to {self.path} is closed")
        try:
            self._writer.write(_frame(frame))
        except (OSError, RuntimeError) as exc:  # the transport closed under us
            self._fail(exc)
            raise ChannelError(f"channel to {self.path} lost: {exc!r}") from exc

    async def call(self, name: str, *args: Any) -> Any:
        call_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[call_id] = future
        try:
            self._send((call_id, name, args))
            return await future
        finally:
            self._waiting.pop(call_id, None)

    def stream(self, name: str, *args: Any) -> ChannelStream:
        """Start a streamed call now; raises ChannelError if the connection is gone."""
        call_id = next(self._ids)
        items: asyncio.Queue = asyncio.Queue()
        self._waiting[call_id] = items
        try:
            self._send((call_id, name, args))
        except ChannelError:
            self._waiting.pop(call_id, None)
            raise
        return ChannelStream(self, call_id, items)

    def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._fail(ConnectionError("closed"))


def _proof(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, nonce, hashlib.sha256).digest()


def shut(server: ChannelServer | None, drain_s: float):
    """What a replica's `__del__` returns for its channel. Serve calls `__del__` on the
    replica's loop at a graceful shutdown and awaits a coroutine it returns: the drain.
    Without a running loop (the process is going) the socket just closes."""
    if server is None:
        return None
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        server.close()
        return None
    return server.drain(drain_s)


def offer(server: ChannelServer | None) -> dict | None:
    """What a replica's `channel()` method answers: where its socket is and the secret that
    opens it, or None when it has none or its deployment autoscales (Serve scales on the calls
    it sees, and these it would not). Read at every ask, so an in-place config change turns
    the channel off too."""
    if server is None:
        return None
    import ray
    from ray import serve

    try:
        config = getattr(serve.get_replica_context(), "_deployment_config", None)
    except Exception:  # outside a replica (unit use)
        config = None
    if getattr(config, "autoscaling_config", None) is not None:
        return None
    return {"node_id": ray.get_runtime_context().get_node_id(), "path": server.path, "secret": server.secret.hex()}


class ChannelPool:
    """The side channels one caller knows of, to the replicas of one deployment on its node.

    `learn` takes what a replica's `channel()` method said (over the handle, off the request
    path); `pick` gives the live channel with the fewest calls in flight, or None (use the
    handle): none known, or all at `max_in_flight`. A replica that went away breaks its
    connection and drops out here."""

    def __init__(self, node_id: str, max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.node_id = node_id
        self.max_in_flight = max_in_flight
        self.enabled = True  # False: pick() gives None, the callers take the handle
        self._clients: dict[str, ChannelClient] = {}  # by socket path

    async def learn(self, where: dict | None) -> bool:
        """Connect to a replica's channel if it is on this node and new; True if connected."""
        if not where or where.get("node_id") != self.node_id or where.get("path") in self._clients:
            return False
        try:
            client = await ChannelClient(where["path"], bytes.fromhex(where["secret"])).connect()
        except (OSError, KeyError, ValueError) as exc:  # gone since it answered, or a socket this user can't open
            log.warning("no side channel to %s: %r", where["path"], exc)
            return False
        self._clients[client.path] = client
        return True

    def pick(self) -> ChannelClient | None:
        for path in [p for p, c in self._clients.items() if c.broken or c.retired]:
            del self._clients[path]
        if not self._clients or not self.enabled:
            return None
        least = min(self._clients.values(), key=lambda c: c.in_flight)
        return least if least.in_flight < self.max_in_flight else None

    def __len__(self) -> int:
        return sum(not (c.broken or c.retired) for c in self._clients.values())

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
