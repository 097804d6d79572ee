"""The same-node side channel (deployments/channel.py) over real Unix sockets, without Ray."""

from __future__ import annotations

import asyncio
import os
import stat
import time

import numpy as np
import pytest

from deployments.channel import ChannelClient, ChannelError, ChannelPool, ChannelServer, RemoteError
from semantic_cache.cache import Lookup


async def _slow_echo(value, delay_s: float):
    await asyncio.sleep(delay_s)
    return value


async def _lookup(key, scope, query) -> Lookup:
    return Lookup("miss", reason="no_match", vector=np.arange(4, dtype=np.float32))


async def _broken(*_):
    raise ValueError("bad input")


def test_calls_share_one_connection_and_answer_out_of_order():
    async def scenario():
        server = await ChannelServer({"echo": _slow_echo, "lookup": _lookup, "broken": _broken}).start()
        try:
            assert stat.S_IMODE(os.stat(os.path.dirname(server.path)).st_mode) == 0o700  # this user only
            client = await ChannelClient(server.path, server.secret).connect()
            # The slow call goes first and ends last: each answer finds its own caller.
            slow = asyncio.ensure_future(client.call("echo", "slow", 0.2))
            await asyncio.sleep(0.01)
            assert client.in_flight == 1
            fast = await asyncio.gather(*(client.call("echo", i, 0.0) for i in range(20)))
            assert fast == list(range(20)) and not slow.done()
            assert await slow == "slow"
            found = await client.call("lookup", "k", "scope", "q")  # the real reply type, numpy inside
            assert found.outcome == "miss" and found.vector.tolist() == [0, 1, 2, 3]
            # An error at the other end is the caller's, and the channel goes on.
            with pytest.raises(RemoteError, match="ValueError: bad input"):
                await client.call("broken")
            with pytest.raises(RemoteError, match="KeyError"):
                await client.call("no_such_method")
            assert await client.call("echo", "after", 0.0) == "after" and not client.broken
            client.close()
        finally:
            server.close()
        assert not os.path.exists(server.path)

    asyncio.run(scenario())


def test_a_lost_server_fails_pending_calls_and_the_pool_drops_it():
    async def scenario():
        server = await ChannelServer({"echo": _slow_echo}).start()
        other = await ChannelServer({"echo": _slow_echo}).start()
        pool = ChannelPool(node_id="node-a", max_in_flight=2)
        try:
            assert not await pool.learn(None)  # the replica has no channel
            assert not await pool.learn({"node_id": "node-b", "path": server.path, "secret": server.secret.hex()})  # another node's
            assert await pool.learn({"node_id": "node-a", "path": server.path, "secret": server.secret.hex()})
            assert not await pool.learn({"node_id": "node-a", "path": server.path, "secret": server.secret.hex()})  # already known
            assert await pool.learn({"node_id": "node-a", "path": other.path, "secret": other.secret.hex()})
            assert len(pool) == 2
            busy = pool.pick()
            pending = asyncio.ensure_future(busy.call("echo", "never", 30))
            await asyncio.sleep(0.05)
            idle = pool.pick()
            assert idle is not busy  # the one with fewer calls in flight
            extra = [asyncio.ensure_future(c.call("echo", "never", 30)) for c in (idle, idle, busy)]
            await asyncio.sleep(0.05)
            assert pool.pick() is None  # both at max_in_flight (2): the caller takes the handle
            for call in extra:
                call.cancel()
            await asyncio.sleep(0.05)
            assert pool.pick() is idle

            # The busy replica goes away: its pending call fails at once (not at a timeout)
            # with ChannelError, which callers take as "try the handle".
            (server if busy.path == server.path else other).close()
            with pytest.raises(ChannelError):
                await asyncio.wait_for(pending, timeout=5)
            assert busy.broken and len(pool) == 1
            with pytest.raises(ChannelError):
                await busy.call("echo", 1, 0.0)
            survivor = pool.pick()
            assert survivor is not busy and await survivor.call("echo", "ok", 0.0) == "ok"
            # A socket that is gone is not learned.
            assert not await pool.learn({"node_id": "node-a", "path": server.path + ".gone", "secret": server.secret.hex()})
        finally:
            pool.close()
            server.close()
            other.close()

    asyncio.run(scenario())


class _FakeMethod:
    def __init__(self, answer) -> None:
        self.answer, self.calls = answer, 0

    def remote(self, *args):
        self.calls += 1

        async def answer():
            return self.answer

        return answer()


class _FakeCacheHandle:
    def __init__(self) -> None:
        self.lookup = _FakeMethod(Lookup("miss", reason="over_the_handle"))


def test_ingress_falls_back_to_the_handle_when_the_channel_goes():
    from deployments.ingress import HandleBackends

    servers: list[ChannelServer] = []

    async def hang_up(key, scope, query):
        servers[0].close()  # the replica goes away mid-call
        await asyncio.sleep(30)

    async def scenario():
        server = await ChannelServer({"lookup": hang_up}).start()
        servers.append(server)
        pool = ChannelPool(node_id="n")
        await pool.learn({"node_id": "n", "path": server.path, "secret": server.secret.hex()})
        handle = _FakeCacheHandle()
        backends = HandleBackends(handle, router=None, models={}, write_timeout_s=1.0, cache_channels=pool)
        found = await asyncio.wait_for(backends.cache_lookup("k", "s", "q"), timeout=5)
        assert found.reason == "over_the_handle" and handle.lookup.calls == 1
        assert len(pool) == 0  # later lookups go straight to the handle
        assert (await backends.cache_lookup("k", "s", "q")).reason == "over_the_handle"
        assert handle.lookup.calls == 2
        pool.close()

    asyncio.run(scenario())


def test_streams_end_fail_and_cancel_at_the_other_end():
    closed: list[str] = []

    async def count(n: int, fail_at: int | None = None, delay_s: float = 0.0):
        try:
            for i in range(n):
                if i == fail_at:
                    raise RuntimeError(f"failed at {i}")
                await asyncio.sleep(delay_s)
                yield i
        finally:
            closed.append(f"{n}/{fail_at}")  # the generator was closed at the other end

    async def scenario():
        server = await ChannelServer({"count": count}).start()
        client = await ChannelClient(server.path, server.secret).connect()
        try:
            assert [i async for i in client.stream("count", 5)] == [0, 1, 2, 3, 4]
            assert client.in_flight == 0
            # A caller that stops at the last item it needs (a chunk with a finish reason) and
            # never reads the end: once the end arrives, the call is no longer in flight.
            unread = client.stream("count", 1)
            assert await unread.__anext__() == 0
            for _ in range(50):
                if client.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert client.in_flight == 0
            got = []
            with pytest.raises(RemoteError, match="failed at 2"):
                async for i in client.stream("count", 5, 2):
                    got.append(i)
            assert got == [0, 1]
            # Two streams at once on one connection; one is cancelled after its first item: its
            # generator is closed there (the model would free its slot), the other goes on.
            slow = client.stream("count", 1000, None, 0.01)
            other = client.stream("count", 3, None, 0.02)
            assert await slow.__anext__() == 0
            slow.cancel()
            assert [i async for i in other] == [0, 1, 2]
            for _ in range(50):
                if "1000/None" in closed:
                    break
                await asyncio.sleep(0.01)
            assert "1000/None" in closed and client.in_flight == 0
            # The connection goes mid-stream: the next item is a ChannelError, not a hang.
            lost = client.stream("count", 1000, None, 0.01)
            unread = client.stream("count", 1000, None, 0.01)
            assert await lost.__anext__() == 0
            server.close()
            with pytest.raises(ChannelError):
                while True:
                    await asyncio.wait_for(lost.__anext__(), timeout=5)
            unread.cancel()  # the pipeline's cleanup cancels whatever it held: never raises
            with pytest.raises(ChannelError):
                client.stream("count", 1)
        finally:
            client.close()
            server.close()

    asyncio.run(scenario())


def test_the_tokens_of_one_step_cross_in_one_write(monkeypatch):
    """Sixteen streams whose items come out of one model step (one event set): their frames go
    out together, one write per step, not one per token, and each stream gets its own, in order."""
    writes: list[int] = []
    real_write = asyncio.StreamWriter.write

    def counted(self, data):
        writes.append(len(data))
        return real_write(self, data)

    step = {"event": None}

    async def tokens(n: int):
        for i in range(n):
            await step["event"].wait()
            yield i

    async def scenario():
        server = await ChannelServer({"tokens": tokens}).start()
        client = await ChannelClient(server.path, server.secret).connect()
        try:
            step["event"] = asyncio.Event()
            streams = [client.stream("tokens", 3) for _ in range(16)]
            await asyncio.sleep(0.05)  # every call has arrived and waits on the step
            monkeypatch.setattr(asyncio.StreamWriter, "write", counted)
            step["event"].set()  # one step: all 16 streams produce all their items
            async def read(stream):
                return [i async for i in stream]

            got = await asyncio.gather(*(read(s) for s in streams))
            assert got == [[0, 1, 2]] * 16
            assert 1 <= len(writes) <= 4, f"{len(writes)} writes for 48 items and 16 ends"
        finally:
            client.close()
            server.close()

    asyncio.run(scenario())


def test_a_replica_whose_deployment_autoscales_offers_no_channel(monkeypatch):
    """Serve autoscales on the calls it sees; calls over the channel it would not see."""
    from types import SimpleNamespace

    from ray import serve
    from ray.serve.context import ReplicaContext

    from deployments.channel import offer

    # offer() reads the replica context's deployment config: a Ray upgrade that renames it
    # must fail here, not turn the check off silently.
    assert "_deployment_config" in ReplicaContext.__dataclass_fields__

    def context(autoscaling):
        return SimpleNamespace(_deployment_config=SimpleNamespace(autoscaling_config=autoscaling))

    monkeypatch.setattr("ray.get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node-a"))
    monkeypatch.setattr(serve, "get_replica_context", lambda: context(None))
    server = SimpleNamespace(path="/tmp/x/s", secret=b"\x01" * 32)
    assert offer(server) == {"node_id": "node-a", "path": "/tmp/x/s", "secret": "01" * 32}
    assert offer(None) is None
    monkeypatch.setattr(serve, "get_replica_context", lambda: context({"min_replicas": 1, "max_replicas": 4}))
    assert offer(server) is None


def test_a_draining_replica_finishes_its_streams_and_refuses_new_calls():
    """A graceful shutdown (Serve awaits what the replica's __del__ returns): streams under way
    end whole, a new call is refused with ChannelError (the caller takes the handle), and the
    pool passes that replica by from then on."""
    from deployments.channel import shut

    async def count(n: int, delay_s: float):
        for i in range(n):
            await asyncio.sleep(delay_s)
            yield i

    async def scenario():
        server = await ChannelServer({"count": count}).start()
        pool = ChannelPool(node_id="n")
        await pool.learn({"node_id": "n", "path": server.path, "secret": server.secret.hex()})
        client = pool.pick()
        running = client.stream("count", 10, 0.02)
        assert await running.__anext__() == 0
        draining = asyncio.ensure_future(shut(server, drain_s=5.0))
        await asyncio.sleep(0.01)
        with pytest.raises(ChannelError, match="shutting down"):
            await client.stream("count", 1, 0.0).__anext__()
        assert pool.pick() is None and len(pool) == 0  # retired: new calls take the handle
        assert [i async for i in running] == list(range(1, 10))  # the stream under way ended whole
        await asyncio.wait_for(draining, timeout=5)
        assert not os.path.exists(server.path)
        pool.close()

    asyncio.run(scenario())

    # Without a running loop (the process is going), the socket just closes.
    async def make():
        return await ChannelServer({"count": count}).start()

    server = asyncio.run(make())
    assert shut(server, drain_s=5.0) is None and not os.path.exists(server.path)


def test_a_foreign_process_gets_no_answer_and_runs_no_code_through_a_channel(tmp_path):
    """Another user's process can't open the socket; a same-user process without the replica's
    secret is hung up on before any call runs; and even with the secret, a frame that would
    build anything but the known message types (a pickle that runs a command) is refused,
    with the connection, and nothing runs."""
    import pickle
    import socket
    import struct

    ran: list[str] = []
    marker = tmp_path / "pwned"

    async def answer(question):
        ran.append(question)
        return "secret answer"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    async def scenario():
        server = await ChannelServer({"answer": answer}).start()
        try:
            # Another user (nobody): the 0700 directory keeps it from the socket.
            if os.getuid() == 0:
                pid = os.fork()
                if pid == 0:  # the child becomes nobody and tries the socket
                    code = 1
                    try:
                        os.setgid(65534)
                        os.setuid(65534)
                        socket.socket(socket.AF_UNIX).connect(server.path)
                        code = 0
                    except PermissionError:
                        code = 13
                    finally:
                        os._exit(code)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 13, "another user's process reached the socket"
            # Same user, wrong secret: the connection ends before any call runs.
            with pytest.raises(ChannelError):
                client = await ChannelClient(server.path, os.urandom(32)).connect()
                await asyncio.wait_for(client.call("answer", "what is the secret?"), 5)
            # A raw peer that ignores the challenge and sends a call frame straight away.
            reader, writer = await asyncio.open_unix_connection(server.path)
            await reader.readexactly(32)
            body = pickle.dumps((1, "answer", ("raw",)))
            writer.write(b"\0" * 32 + struct.pack("!I", len(body)) + body)
            assert await asyncio.wait_for(reader.read(), 5) == b""  # hung up on
            writer.close()
            # The right secret, an evil frame: refused, connection closed, no command run.
            client = await ChannelClient(server.path, server.secret).connect()
            client._send((2, "answer", (Exploit(),)))
            await asyncio.sleep(0.3)
            with pytest.raises(ChannelError):
                await asyncio.wait_for(client.call("answer", "still there?"), 5)
            # An oversized frame header: the connection ends, nothing is buffered for it.
            reader, writer = await asyncio.open_unix_connection(server.path)
            nonce = await reader.readexactly(32)
            import hashlib
            import hmac

            writer.write(hmac.new(server.secret, nonce, hashlib.sha256).digest() + struct.pack("!I", 2**32 - 1))
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            assert server.refused >= 2
            # The legitimate caller still gets its answer.
            good = await ChannelClient(server.path, server.secret).connect()
            assert await good.call("answer", "hello") == "secret answer"
            good.close()
        finally:
            server.close()

    asyncio.run(scenario())
    assert not marker.exists(), "a frame ran a command"
    assert ran == ["hello"], ran


class _Replica:
    """A cache replica's `invalidate` over a real ExactCache, and the controller's log that the
    replica follows: here it applies the log the moment it is written, the interleaving a
    replica's sync can hit."""

    def __init__(self) -> None:
        from configs.schemas import CacheConfig
        from semantic_cache.exact import CachedResponse, ExactCache

        self.cache = ExactCache(CacheConfig())
        for i in range(3):
            self.cache.put(f"k{i}", "tenant-a", CachedResponse(f"a{i}", "stop", 1, 1, "m"))
        self.invalidate = _Remote(lambda tenant: len(self.cache.invalidate(tenant)))


class _Remote:
    def __init__(self, fn) -> None:
        self.fn = fn
        self.calls: list = []

    def remote(self, *args):
        self.calls.append(args)

        async def run():
            out = self.fn(*args)
            return await out if asyncio.iscoroutine(out) else out

        return run()


def test_cache_invalidation_counts_what_it_dropped_when_the_log_applies_first():
    from deployments.ingress import HandleBackends

    replica = _Replica()

    class Controller:
        invalidate = _Remote(lambda tenant: replica.cache.invalidate(tenant) and 1)

    backends = HandleBackends(replica, router=None, models={}, write_timeout_s=1.0, controller=Controller())
    assert asyncio.run(backends.cache_invalidate("tenant-a")) == 3
    assert Controller.invalidate.calls == [("tenant-a",)]  # the fleet's log still has it
    assert len(replica.cache) == 0


def test_cache_invalidation_is_bounded_when_the_replica_and_the_log_both_hang():
    from deployments.ingress import HandleBackends

    async def hang(tenant):
        await asyncio.sleep(60)

    class Stuck:
        invalidate = _Remote(hang)

    backends = HandleBackends(Stuck(), router=None, models={}, write_timeout_s=0.3, controller=Stuck())

    async def scenario():
        started = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(backends.cache_invalidate("tenant-a"), 0.2)  # the ingress's stage bound
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 5
    assert Stuck.invalidate.calls == [("tenant-a",), ("tenant-a",)]  # the log was still asked
