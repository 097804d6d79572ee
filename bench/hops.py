"""Suite `hops`: what one hop costs, replica to replica, over each transport.

Two bench-only deployments: `HopCaller` calls `HopEcho` and times it from inside a replica,
which is where the serving graph's hops happen (ingress -> cache/router/model). The caller holds
one handle per transport (`actor`: a Ray actor call, Serve's default; `grpc`: the replica's own
gRPC server, `handle_transport: grpc` in serve_config.yaml) and the echo replica's same-node side
channel (`channel`: a Unix socket, what cache lookups take, deployments/channel.py; unary only).
It rotates between them in blocks, so all see the same machine at the same time.
"""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve.handle import DeploymentHandle

from deployments.channel import ChannelClient, ChannelServer
from deployments.transport import over

TRANSPORTS = ("actor", "grpc")  # handles: unary and streams
UNARY = (*TRANSPORTS, "channel")


@serve.deployment(name="HopEcho", ray_actor_options={"num_cpus": 0.01}, max_ongoing_requests=1000)
class HopEcho:
    async def __init__(self) -> None:
        self._channel = await ChannelServer({"ping": self.ping}).start()

    async def channel_address(self) -> tuple[str, bytes]:
        return self._channel.path, self._channel.secret

    async def ping(self, payload: bytes) -> bytes:
        return payload

    async def stream(self, n: int):
        for i in range(n):
            yield i


@serve.deployment(name="HopCaller", ray_actor_options={"num_cpus": 0.01}, max_ongoing_requests=1000)
class HopCaller:
    def __init__(self, echo: DeploymentHandle) -> None:
        self.unary_handles = {t: over(echo, t) for t in TRANSPORTS}
        self.stream_handles = {t: over(echo, t).options(stream=True) for t in TRANSPORTS}
        self._echo = echo
        self._channel: ChannelClient | None = None

    @staticmethod
    def _order(block: int, transports: tuple[str, ...] = TRANSPORTS) -> tuple[str, ...]:
        shift = block % len(transports)
        return transports[shift:] + transports[:shift]

    async def _ping(self, transport: str, payload: bytes) -> bytes:
        if transport != "channel":
            return await self.unary_handles[transport].ping.remote(payload)
        if self._channel is None:  # both replicas run on this one node
            self._channel = await ChannelClient(*await self._echo.channel_address.remote()).connect()
        return await self._channel.call("ping", payload)

    async def unary(self, requests: int, concurrency: int, payload_bytes: int = 256, block: int = 20) -> dict:
        payload = b"x" * payload_bytes
        samples: dict[str, list[float]] = {t: [] for t in UNARY}

        async def one(transport: str, sem: asyncio.Semaphore) -> None:
            async with sem:
                t = time.perf_counter()
                await self._ping(transport, payload)
                samples[transport].append((time.perf_counter() - t) * 1000)

        for b in range(max(1, requests // block)):
            for transport in self._order(b, UNARY):
                sem = asyncio.Semaphore(concurrency)
                await asyncio.gather(*(one(transport, sem) for _ in range(block)))
        return samples

    async def stream_items(self, streams: int, items: int) -> dict:
        """Time to the first item (a hop) and between items (per-chunk cost of streaming)."""
        out = {t: {"first_item_ms": [], "per_item_ms": []} for t in TRANSPORTS}
        for s in range(streams):
            for transport in self._order(s):
                t = time.perf_counter()
                last = None
                async for _ in self.stream_handles[transport].stream.remote(items):
                    now = time.perf_counter()
                    if last is None:
                        out[transport]["first_item_ms"].append((now - t) * 1000)
                    else:
                        out[transport]["per_item_ms"].append((now - last) * 1000)
                    last = now
        return out


def measure_hops(requests: int = 300) -> dict:
    """Per transport: unary hop at concurrency 1/8/32, a stream's first item and per item, in ms
    (streams over the two handle transports only)."""
    from bench.stats import summary

    quiet = {"enable_access_log": False, "log_level": "WARNING"}  # a log line per call would be timed too
    echo = HopEcho.options(logging_config=quiet).bind()
    handle = serve.run(HopCaller.options(logging_config=quiet).bind(echo), name="hops", route_prefix=None)
    handle.unary.remote(40, 1).result()  # warm both ends, both transports
    out: dict = {t: {} for t in UNARY}
    for concurrency in (1, 8, 32):
        block = max(20, concurrency)
        samples = handle.unary.remote(requests, concurrency, block=block).result()
        for t in UNARY:
            out[t][f"unary_c{concurrency}_ms"] = summary(samples[t])
    streamed = handle.stream_items.remote(20, 50).result()
    for t in TRANSPORTS:
        out[t]["stream_first_item_ms"] = summary(streamed[t]["first_item_ms"])
        out[t]["stream_per_item_ms"] = summary(streamed[t]["per_item_ms"])
    out["grpc_vs_actor_p50"] = {
        key: round(out["grpc"][key]["p50"] / out["actor"][key]["p50"], 3) for key in out["actor"]
    }
    out["channel_vs_grpc_p50"] = {
        key: round(out["channel"][key]["p50"] / out["grpc"][key]["p50"], 3) for key in out["channel"]
    }
    serve.delete("hops")
    return out


def run(requests: int = 400, quick: bool = False) -> dict:
    import ray

    from bench.local import OFFLINE_ENV, free_port

    if quick:
        requests = min(requests, 100)
    ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": dict(OFFLINE_ENV)})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()}, logging_config={"enable_access_log": False})
        return {"requests_per_point": requests, **measure_hops(requests)}
    finally:
        serve.shutdown()
        ray.shutdown()
