"""Ingress: the OpenAI API. Thin: the request path lives in ingress/pipeline.py."""

from __future__ import annotations

import asyncio
import functools
import logging
import os

import ray
from fastapi import FastAPI
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from admission.node_board import NodeBoard
from admission.sync import AdmissionSync
from configs.limits import check_ingress
from configs.schemas import AppArgs, EngineConfig
from deployments.channel import ChannelClient, ChannelError, ChannelPool
from deployments.limits import own_max_ongoing_requests
from deployments.serve_status import deployment_states_async
from deployments.transport import over
from engines.model_store import resolve_model_dir
from host_tuning.niceness import ahead_of_compute
from engines.types import GenerateChunk, GenerateRequest
from ingress.api import build_api
from ingress.direct import DirectListener
from ingress.errors import APIError
from ingress.accounting import RequestAccounting
from ingress.model_calls import ModelStream
from ingress.pipeline import Pipeline
from ingress.readiness import Readiness
from ingress.prompts import PromptBuilder
from router.base import RouteDecision, RouteFeatures
from semantic_cache.cache import CacheEntry, Lookup
from telemetry.metrics import RequestMetrics
from telemetry.tracing import make_tracer

log = logging.getLogger(__name__)
# Ray Serve's own logger: a replica's lines there reach `serve run`'s terminal at the
# configured `logging_config.log_level`, where a user waits to hear that the service is up.
terminal = logging.getLogger("ray.serve")


class ServeModelStream:
    """A model call over a Ray handle, as the pipeline's `ModelStream`. Serve refuses a call
    past the model's `max_queued_requests` with BackPressureError: that is a 503 with
    Retry-After, not a replica failure. And Ray's `cancel()` first fetches the call's result, so
    on a refused call it raises the refusal again; a `ModelStream`'s cancel must not raise (the
    pipeline's and the coalescer's cleanups call it, and a raise there would replace their error
    with a 500 or cut an SSE stream without its error event)."""

    __slots__ = ("_response", "_model_id")

    def __init__(self, response, model_id: str) -> None:
        self._response = response
        self._model_id = model_id

    def __aiter__(self) -> "ServeModelStream":
        return self

    async def __anext__(self) -> GenerateChunk:
        try:
            return await self._response.__anext__()
        except BackPressureError:
            self.cancel()  # let go of the refused call
            raise APIError(
                503, "the model's queue is full; retry later", code="model_queue_full",
                headers={"Retry-After": "1"}, extra={"model": self._model_id},
            ) from None

    def cancel(self) -> None:
        try:
            self._response.cancel()
        except Exception as exc:
            log.debug("cancelling a call to %s: %s", self._model_id, type(exc).__name__)


class HandleBackends:
    """The pipeline's view of the other deployments, over Ray handles; cache calls and model
    calls over a side channel where one to a replica on this node is known and open
    (deployments/channel.py), the handle otherwise."""

    def __init__(
        self,
        cache: DeploymentHandle,
        router: DeploymentHandle,
        models: dict[str, DeploymentHandle],
        write_timeout_s: float,
        cache_channels: ChannelPool | None = None,
        model_channels: dict[str, ChannelPool] | None = None,
        controller: DeploymentHandle | None = None,
    ) -> None:
        self._cache = cache
        self._controller = controller
        self.cache_channels = cache_channels
        self.model_channels = model_channels or {}
        self._write_timeout_s = write_timeout_s
        self._router = router
        self._models = {model_id: h.options(stream=True) for model_id, h in models.items()}
        self._unary = models
        self._pending: set[asyncio.Task] = set()

    async def cache_lookup(self, key: str, scope: str | None, query: str | None) -> Lookup:
        return await self._cache_call("lookup", key, scope, query)

    async def cache_invalidate(self, tenant: str) -> int:
        """One replica at once, whose count is the answer, then the fleet's log (every cache
        replica and near cache applies it within a sync). In this order, since a replica that
        applied the log first would have nothing left to count. The log is written on a failure
        too, within its own bound: this runs after a timeout's cancellation as well."""
        try:
            return await self._cache.invalidate.remote(tenant)
        finally:
            if self._controller is not None:
                await asyncio.wait_for(self._controller.invalidate.remote(tenant), self._write_timeout_s)

    def cache_store(self, entry: CacheEntry) -> None:
        self._fire(self._cache_call("store", entry))

    def cache_verified(self, shard: str, entry_key: str, score: float, correct: bool) -> None:
        self._fire(self._cache_call("verified", shard, entry_key, score, correct))

    async def _cache_call(self, method: str, *args):
        channel = self.cache_channels.pick() if self.cache_channels is not None else None
        if channel is not None:
            try:
                return await channel.call(method, *args)
            except ChannelError as exc:  # its replica went away mid-call: the handle finds a live one
                log.warning("cache side channel failed (%s); over the handle instead", exc)
        return await getattr(self._cache, method).remote(*args)

    def late_hint(self, model_id: str, request_id: str, hint_ids: list[int]) -> None:
        # With several model replicas it may reach one that is not running the request: there
        # it is dropped, and the request only decodes without the hint.
        channel = self._model_channel(model_id)
        if channel is not None:
            self._fire(channel.call("late_hint", request_id, hint_ids))
        else:
            self._fire(self._unary[model_id].late_hint.remote(request_id, hint_ids))

    def _model_channel(self, model_id: str) -> ChannelClient | None:
        pool = self.model_channels.get(model_id)
        return pool.pick() if pool is not None else None

    def _fire(self, response) -> None:
        # Fire and forget, but keep a reference so the call is not garbage-collected mid-flight.
        task = asyncio.ensure_future(self._await(response))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def route(self, features: RouteFeatures) -> RouteDecision:
        return await self._router.route.remote(features)

    def generate(self, model_id: str, request: GenerateRequest) -> ModelStream:
        channel = self._model_channel(model_id)
        if channel is not None:
            try:
                return channel.stream("generate", request)
            except ChannelError:
                pass  # gone since it was picked: the handle
        return ServeModelStream(self._models[model_id].generate.remote(request), model_id)

    async def _await(self, response) -> None:
        try:
            await asyncio.wait_for(response, self._write_timeout_s)  # a stuck cache holds nothing here
        except Exception:
            pass  # a lost cache write costs a future miss, a lost hint a slower decode; nothing more


async def _sole_replicas() -> set[str]:
    """The deployments of this replica's app that Serve says are healthy with one replica (in
    any state: not scaling, not starting a second). One controller call."""
    states = await deployment_states_async(serve.get_replica_context().app_name)
    return {name for name, state in states.items() if state.healthy and sum(state.replicas.values()) == 1}


def _prompt_builders(args: AppArgs) -> dict[str, PromptBuilder]:
    from transformers import AutoTokenizer

    by_dir: dict[str, PromptBuilder] = {}
    builders: dict[str, PromptBuilder] = {}

    def builder(engine: EngineConfig) -> PromptBuilder:
        path = str(resolve_model_dir(engine.source, engine.cache_dir))
        if path not in by_dir:  # one tokenizer per distinct model dir
            by_dir[path] = PromptBuilder(AutoTokenizer.from_pretrained(path))
        return by_dir[path]

    builders[args.target.engine.model_id] = builder(args.target.engine)
    builders[args.draft.engine.model_id] = builder(args.draft.engine)
    builders[args.router.auto_model_id] = builders[args.target.engine.model_id]
    return builders


# Defaults as in serve_config.yaml, so a file without this deployments entry fits configs/limits.py.
@serve.deployment(name="Ingress", max_ongoing_requests=256, max_queued_requests=256)
@serve.ingress()
class Ingress:
    async def __init__(
        self,
        args: dict,
        admission: DeploymentHandle,
        cache: DeploymentHandle,
        router: DeploymentHandle,
        target: DeploymentHandle,
        draft: DeploymentHandle,
    ) -> None:
        config = AppArgs.model_validate(args)
        own = own_max_ongoing_requests()
        if own is not None:  # serve run: its YAML entry against admission's limits
            check_ingress(config, own[1])
        host = config.host_tuning
        if host.front_level is not None:
            ahead_of_compute(host.front_level, "Ingress")
        hop = config.handle_transport
        # Side channels (deployments/channel.py) to replicas on this node: found off the
        # request path by _find_channels, used while they answer.
        node_id = ray.get_runtime_context().get_node_id()
        finding: list[tuple[ChannelPool, DeploymentHandle, str | None]] = []
        cache_channels = None
        if config.cache.enabled and host.channels:
            cache_channels = ChannelPool(node_id)
            # Only while the cache has one replica: with more, ScopeShardRouter sends each scope to its own.
            finding.append((cache_channels, over(cache, hop), "SemanticCache"))
        model_channels = {}
        for stage, handle, name in ((config.target, target, "TargetModel"), (config.draft, draft, "DraftModel")):
            if host.channels:
                # Only while the model has one replica: with more, Serve's router places each
                # call (prefix affinity, queue lengths) and the handle goes there.
                model_channels[stage.engine.model_id] = pool = ChannelPool(node_id, max_in_flight=64)
                finding.append((pool, over(handle, hop), name))
        backends = HandleBackends(
            over(cache, hop),
            over(router, hop),
            {config.target.engine.model_id: over(target, hop), config.draft.engine.model_id: over(draft, hop)},
            write_timeout_s=config.ingress.stage_timeout_s,
            cache_channels=cache_channels,
            model_channels=model_channels,
            controller=admission,
        )
        embedder = None
        if config.router.kind == "classifier":
            # The classifier routes on the request's MiniLM embedding. A cache lookup brings it
            # back from the SemanticCache replica; this one makes it for requests that skip the
            # cache (no-cache, sampled). Loaded off the event loop.
            from semantic_cache.embedder import Embedder

            load = functools.partial(
                Embedder,
                precision=config.cache.semantic.embed_precision,
                runtime=config.cache.semantic.embed_runtime,
            )
            embedder = await asyncio.get_running_loop().run_in_executor(None, load)
        replica_id = f"{os.getpid()}-{id(self)}"
        try:
            replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            pass
        metrics = RequestMetrics(config.telemetry.metrics, [config.target.engine.model_id, config.draft.engine.model_id]) \
            if config.telemetry.metrics.enabled else None
        # Ready means every stage on the request path answers: /health says 503 until then, and
        # the first real request finds the handles' replica sets already known.
        self.readiness = Readiness(ready=False)
        self.pipeline = Pipeline(
            config, backends, _prompt_builders(config), embedder,
            accounting=RequestAccounting(metrics, make_tracer(config.telemetry.tracing, "Ingress")),
            readiness=self.readiness, served_by=f"{replica_id}@{node_id[:12]}",
        )
        if metrics is not None:
            self._gauge_task = asyncio.create_task(self._gauges_forever(metrics))
        self._admission = AdmissionSync(
            self.pipeline.admission, admission.report.remote, replica_id, config.admission.sync_interval_s,
            on_invalidated=self.pipeline.cache.forget_tenants,
        )
        self._sync_task = asyncio.create_task(self._admission.run_forever())
        try:  # the other ingress replicas on this node see what this one runs now, and it theirs
            self.pipeline.gate.board = NodeBoard(replica_id=replica_id)
        except OSError as exc:
            log.warning("no node board, admission sees the other ingress replicas only as synced: %r", exc)
        self._direct = None
        if config.ingress.direct_port is not None:
            self._direct = DirectListener(
                build_api(self.pipeline, self._stalled_readers), config.ingress.direct_host, config.ingress.direct_port,
                send_timeout_s=config.ingress.send_timeout_s, drain_s=config.ingress.drain_s,
            )  # bound now (a taken port fails the start), listening once ready: see `_warm`
        self._warm_task = asyncio.create_task(self._warm(
            [(cache.stats, None), (target.stats, config.target.engine.model_id), (draft.stats, config.draft.engine.model_id)],
            finding,
        ))

    async def __del__(self) -> None:
        """Serve awaits this at a graceful shutdown (an ingress's `__del__` may be async): the
        direct listener drains as Serve drains its own proxy's requests, then the side
        channels close."""
        if getattr(self, "_direct", None) is not None:
            await self._direct.drain()
        self._close()

    def _close(self) -> None:
        if getattr(self, "_direct", None) is not None:
            self._direct.stop()
        gate = getattr(getattr(self, "pipeline", None), "gate", None)
        if gate is not None and gate.board is not None:
            gate.board.close()
        backends = getattr(getattr(self, "pipeline", None), "backends", None)
        if backends is not None:
            for pool in [backends.cache_channels, *backends.model_channels.values()]:
                if pool is not None:
                    pool.close()

    async def _gauges_forever(self, recorder: RequestMetrics) -> None:
        """Queue depth per model, once a second, off the request path."""
        gate = self.pipeline.gate
        while True:
            try:
                recorder.queues(gate.running_by_model(), gate.queued_by_model())
            except Exception:  # a metric is never worth a dead replica
                pass
            await asyncio.sleep(1.0)

    @staticmethod
    async def _find_channels(finding: list[tuple[ChannelPool, DeploymentHandle, str | None]]) -> None:
        """Ask each deployment where one of its replicas' side channel is, off the request
        path. Serve picks the replica, so asking now and then finds them all, replacements and
        new ones included. A pool named with a deployment (the models) serves only while Serve
        says that deployment has one replica (asked once a round, for all)."""
        sole: set[str] | None = None
        for pool, handle, name in finding:
            try:
                where = await asyncio.wait_for(handle.channel.remote(), timeout=10)
                # None: no channel, or the deployment autoscales now (deployments/channel.py:offer)
                pool.enabled = where is not None
                if name is not None and pool.enabled:
                    sole = await _sole_replicas() if sole is None else sole
                    pool.enabled = name in sole
                if await pool.learn(where):
                    log.info("calls to %s on this node go over a side channel (%d known)", name or "the cache", len(pool))
            except Exception as exc:  # no channel for now: calls take the handle
                log.debug("asking for a side channel: %r", exc)

    async def _find_channels_forever(self, finding) -> None:
        while True:
            await asyncio.sleep(10.0 if all(len(pool) for pool, _, _ in finding) else 2.0)
            await self._find_channels(finding)

    async def _warm(self, calls, finding: list[tuple[ChannelPool, DeploymentHandle, str | None]]) -> None:
        """Until every stage answers: then join the direct port. A model's answer carries the
        prefill and batched decode costs its replica timed at its start, admission's priors for it."""
        for call, model_id in calls:
            while True:
                try:
                    stats = await asyncio.wait_for(call.remote(), timeout=30)
                    break
                except Exception:
                    await asyncio.sleep(0.5)
            if model_id is not None and isinstance(stats, dict) and "prefill_ms_per_token" in stats:
                self.pipeline.admission.seed_prefill(model_id, stats["prefill_fixed_ms"], stats["prefill_ms_per_token"])
            if model_id is not None and isinstance(stats, dict) and stats.get("decode_step_ms_by_batch"):
                self.pipeline.admission.seed_itl(model_id, {int(n): ms for n, ms in stats["decode_step_ms_by_batch"].items()})
        if finding:  # the first requests already take the side channels
            await self._find_channels(finding)
            self._channel_task = asyncio.create_task(self._find_channels_forever(finding))
        self.readiness.set()
        # The replicas share the direct port and the kernel hands each new connection to one of
        # those listening: a replica still warming would hold its share of first requests for
        # seconds while another stood ready. It joins the port once it answers at once.
        if self._direct is not None:
            self._direct.start()
        terminal.info("ready: the OpenAI API answers on %s", self._direct.url if self._direct else "Serve's proxy")

    def _stalled_readers(self) -> int:
        return self._direct.app.stalled if getattr(self, "_direct", None) is not None else 0

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_api(self.pipeline, self._stalled_readers)
