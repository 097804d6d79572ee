"""What one Ray Serve handle hop costs, replica to replica, on this machine.

Two bench-only deployments: `HopCaller` calls `HopEcho` and times it from inside a replica,
which is where the serving graph's hops happen (ingress -> cache/router/model).
"""

from __future__ import annotations

import asyncio
import time

from ray import serve
from ray.serve.handle import DeploymentHandle


@serve.deployment(name="HopEcho", ray_actor_options={"num_cpus": 0.01}, max_ongoing_requests=1000)
class HopEcho:
    async def ping(self, payload: bytes) -> bytes:
        return payload

    async def stream(self, n: int):
        for i in range(n):
            yield i


@serve.deployment(name="HopCaller", ray_actor_options={"num_cpus": 0.01}, max_ongoing_requests=1000)
class HopCaller:
    def __init__(self, echo: DeploymentHandle) -> None:
        self.echo = echo
        self.streaming = echo.options(stream=True)

    async def unary(self, requests: int, concurrency: int, payload_bytes: int = 256) -> list[float]:
        payload = b"x" * payload_bytes
        samples: list[float] = []
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                t = time.perf_counter()
                await self.echo.ping.remote(payload)
                samples.append((time.perf_counter() - t) * 1000)

        await asyncio.gather(*(one() for _ in range(requests)))
        return samples

    async def stream_items(self, streams: int, items: int) -> dict[str, list[float]]:
        """Time to the first item (a hop) and between items (per-chunk cost of streaming)."""
        first, gaps = [], []
        for _ in range(streams):
            t = time.perf_counter()
            last = None
            async for _ in self.streaming.stream.remote(items):
                now = time.perf_counter()
                if last is None:
                    first.append((now - t) * 1000)
                else:
                    gaps.append((now - last) * 1000)
                last = now
        return {"first_item_ms": first, "per_item_ms": gaps}


def measure_hops(requests: int = 300) -> dict:
    from bench.stats import summary

    handle = serve.run(HopCaller.bind(HopEcho.bind()), name="hops", route_prefix=None)
    handle.unary.remote(50, 1).result()  # warm both ends
    out: dict = {}
    for concurrency in (1, 8, 32):
        out[f"unary_c{concurrency}_ms"] = summary(handle.unary.remote(requests, concurrency).result())
    streamed = handle.stream_items.remote(20, 50).result()
    out["stream_first_item_ms"] = summary(streamed["first_item_ms"])
    out["stream_per_item_ms"] = summary(streamed["per_item_ms"])
    serve.delete("hops")
    return out
