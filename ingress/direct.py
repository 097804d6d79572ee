"""The ingress replica's own HTTP listener: clients that connect here skip Ray Serve's proxy.

Through the proxy a request costs two extra process hops before our code runs: the proxy hands
the request to the replica, and the replica then fetches the body back from the proxy with an
actor call: on a small box, most of an exact cache hit's time (`python -m bench cache`
measures both paths side by side). The same FastAPI app answers on
both; the proxy's port keeps working for everything that expects Ray Serve's front door.

Every ingress replica on a node binds the same port with SO_REUSEPORT, and the kernel spreads
new connections over them. Requests that arrive here are not counted by Ray Serve's
ongoing-requests autoscaling of the ingress deployment (the model deployments still see every
call).
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

log = logging.getLogger(__name__)


class ReaderStalled(Exception):
    """A client stopped reading its response for longer than the send timeout."""


class CancelOnDisconnect:
    """ASGI wrapper: a client that disconnects, or stops reading for `send_timeout_s`, cancels
    its request's handler.

    Ray's proxy cancels the replica call when its client goes away; plain uvicorn does not, and
    a non-streaming handler would generate on for nobody. A pump reads the connection's messages
    for the app; on `http.disconnect` before the response is complete it cancels the handler,
    which unwinds like a Ray cancellation (the model call is cancelled, the slot released)."""

    def __init__(self, app, send_timeout_s: float = 30.0) -> None:
        self.app = app
        self.send_timeout_s = send_timeout_s
        self.stalled = 0  # responses cut because their reader stopped reading

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        inbox: asyncio.Queue = asyncio.Queue(maxsize=16)  # a body the app stopped reading is not buffered on
        complete = disconnected = False

        async def tracked_send(message) -> None:
            nonlocal complete
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            try:  # a full socket buffer blocks the send: a reader that stalls is cut
                async with asyncio.timeout(self.send_timeout_s):
                    await send(message)
            except TimeoutError:
                self.stalled += 1
                raise ReaderStalled from None

        handler = asyncio.ensure_future(self.app(scope, inbox.get, tracked_send))

        async def pump() -> None:
            nonlocal disconnected
            while True:
                message = await receive()
                await inbox.put(message)
                if message["type"] == "http.disconnect":
                    if not complete:
                        disconnected = True
                        handler.cancel()
                    return

        pumping = asyncio.ensure_future(pump())
        try:
            await handler
        except ReaderStalled:
            log.info("cut a response whose client stopped reading for %g s", self.send_timeout_s)
        except asyncio.CancelledError:
            handler.cancel()
            if not disconnected:  # we were cancelled ourselves (server shutdown): pass it on
                raise
        finally:
            pumping.cancel()


class DirectListener:
    def __init__(
        self, app, host: str, port: int, keep_alive_s: float = 5.0, send_timeout_s: float = 30.0, drain_s: float = 30.0
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise RuntimeError(f"ingress.direct_port: cannot listen on {host}:{port}: {e}") from e
        self.url = f"http://{host}:{port}"
        self.app = CancelOnDisconnect(app, send_timeout_s)
        self._server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                lifespan="off",
                access_log=False,
                log_config=None,
                timeout_keep_alive=keep_alive_s,
                timeout_graceful_shutdown=drain_s,
            )
        )
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Serve on the running event loop (the replica's, where the pipeline's handles live)."""
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self._sock]))
        self._task.add_done_callback(self._ended)

    def stop(self) -> None:
        self._server.should_exit = True

    async def drain(self) -> None:
        """Stop accepting (the other replicas on the port take new connections) and let the
        requests under way finish, up to `drain_s`, as Serve drains its own proxy."""
        self._server.should_exit = True
        if self._task is not None:
            try:
                await asyncio.shield(self._task)
            except Exception:
                pass

    @staticmethod
    def _ended(task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the direct HTTP listener stopped: %r", task.exception())
