"""SemanticCache: the exact and semantic response cache, one call per lookup."""

from __future__ import annotations

import asyncio
import functools
import logging

from ray import serve

from configs.schemas import CacheConfig, HostTuningConfig
from deployments.channel import ChannelServer, offer, shut
from host_tuning.niceness import ahead_of_compute
from semantic_cache.cache import CacheEntry, Lookup, ResponseCache
from semantic_cache.store import make_store

log = logging.getLogger(__name__)


@serve.deployment(name="SemanticCache")
class SemanticCache:
    """Exact + semantic response cache. A lookup is one call: the exact match, then (on a miss)
    the MiniLM embedding, made here, and the Qdrant search. The vector goes back to the ingress,
    which shares it with the router and sends it with the write: computed once per request."""

    async def __init__(self, args: dict, controller=None, host_tuning: dict | None = None) -> None:
        config = CacheConfig.model_validate(args)
        host = HostTuningConfig.model_validate(host_tuning or {})
        if host.front_level is not None:
            ahead_of_compute(host.front_level, "SemanticCache")
        self.embedder = None
        store = None
        if config.semantic.enabled:
            from semantic_cache.embedder import Embedder

            load = functools.partial(
                Embedder, precision=config.semantic.embed_precision, runtime=config.semantic.embed_runtime
            )
            self.embedder = await asyncio.get_running_loop().run_in_executor(None, load)  # off the loop
            store = make_store(config.semantic.store, self.embedder.dimensions)
        self.cache = ResponseCache(config, store)
        self._indexing: asyncio.Future | None = None
        self._purge_task = asyncio.create_task(self._purge_forever(min(60.0, config.ttl_s / 4)))
        self._invalidation_seq = -1
        self._follow_task = asyncio.create_task(self._follow_invalidations(controller)) if controller else None
        # Lookups and writes on a Unix socket too, for ingresses on this node (deployments/channel.py).
        self._doors = {"handle": 0, "channel": 0}
        self._channel = None
        if host.channels:
            self._channel = await ChannelServer(
                {"lookup": self._channel_lookup, "store": self.store, "verified": self.verified}
            ).start()

    async def channel(self) -> dict | None:
        """Where an ingress on this node can reach `lookup` and `store` without the handle."""
        return offer(self._channel)

    async def _channel_lookup(self, key: str, scope: str | None, query: str | None) -> Lookup:
        self._doors["channel"] += 1
        return await self._lookup(key, scope, query)

    async def lookup(self, key: str, scope: str | None, query: str | None) -> Lookup:
        self._doors["handle"] += 1
        return await self._lookup(key, scope, query)

    async def _lookup(self, key: str, scope: str | None, query: str | None) -> Lookup:
        embed = self.embedder.embed_async if self.embedder is not None else None
        return await self.cache.lookup(key, scope, query, embed)

    async def store(self, entry: CacheEntry) -> None:
        self.cache.put(entry)
        if self.cache.needs_index() and (self._indexing is None or self._indexing.done()):
            # HNSW build takes seconds at 10k entries: a thread, never the request path.
            self._indexing = asyncio.get_running_loop().run_in_executor(None, self.cache.build_index)

    async def verified(self, shard: str, entry_key: str, score: float, correct: bool) -> None:
        self.cache.verified(entry_key, score, correct)

    async def invalidate(self, tenant: str | None = None) -> int:
        return self.cache.invalidate(tenant)

    async def stats(self) -> dict:
        embedding = {}
        if (e := self.embedder) is not None:  # which pass the lookups run, and why (timed at load)
            embedding = {"embed_precision": e.precision, "embed_bf16_check": e.bf16_check,
                         "embed_runtime": e.runtime, "embed_onnx_check": e.onnx_check}
        lookups_by = {"lookups_by_handle": self._doors["handle"], "lookups_by_channel": self._doors["channel"]}
        return {**self.cache.stats(), **embedding, **lookups_by}

    def __del__(self):
        channel, self._channel = getattr(self, "_channel", None), None
        return shut(channel, drain_s=2.0)  # lookups in flight finish (deployments/channel.py)

    async def _follow_invalidations(self, controller, every_s: float = 1.0) -> None:
        """Apply the fleet's invalidations (DELETE /v1/cache reached another replica)."""
        while True:
            try:
                news = await asyncio.wait_for(controller.invalidations_since.remote(self._invalidation_seq), 10)
                for tenant in news.tenants:
                    self.cache.invalidate(tenant)  # None: everything (this replica fell behind)
                self._invalidation_seq = news.seq
            except Exception as exc:  # the controller is restarting: asked again next round
                log.debug("invalidations: %r", exc)
            await asyncio.sleep(every_s)

    async def _purge_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                self.cache.purge_expired()
            except Exception as exc:  # retried next round; searches filter expired entries anyway
                log.warning("cache purge failed: %r", exc)
