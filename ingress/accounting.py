"""A request's metrics and spans (telemetry/), recorded at its end: when its response leaves,
or, for a stream, when the stream ends. Telemetry never fails a request: nothing here raises.
Without a recorder or a tracer (unit tests without Ray, telemetry off) it records nothing."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response

from admission.request import RequestContext
from engines.types import GenerateChunk
from ingress.prepare import Prepared
from telemetry.clock import StageClock
from telemetry.metrics import RequestMetrics
from telemetry.tracing import RequestTrace

log = logging.getLogger(__name__)


class RequestAccounting:
    def __init__(self, metrics: RequestMetrics | None = None, tracer=None) -> None:
        self.metrics = metrics
        self.tracer = tracer  # an OpenTelemetry tracer when tracing is on

    def trace(self, request: Request, clock: StageClock) -> RequestTrace | None:
        if self.tracer is None:
            return None
        return RequestTrace(self.tracer, f"POST {request.url.path}", request.headers, clock)

    def answered(
        self, p: Prepared | None, ctx: RequestContext | None, clock: StageClock, trace: RequestTrace | None,
        response: Response | None, shed: str | None,
    ) -> None:
        """A request that got its response (a stream's end comes later, in `ended`)."""
        status = response.status_code if response is not None else 499  # None: cancelled (client gone)
        try:
            if trace is not None:
                if response is not None:
                    response.headers["traceresponse"] = trace.traceresponse()
                if p is not None:
                    trace.attributes.update({
                        "tenant.id": p.ctx.tenant, "slo.tier": p.ctx.tier, "gen_ai.request.model": p.requested_model,
                        "gen_ai.response.model": p.model or None, "route.reason": p.route or None,
                        "cache.result": p.cache_state, "gen_ai.usage.input_tokens": len(p.prompt_ids) or None,
                    })
                if shed is not None:
                    trace.attributes["admission.shed_reason"] = shed
                if p is None or not p.streaming:
                    trace.finish(status)
            if self.metrics is not None:
                tier = ctx.tier if ctx is not None else "none"
                model, route, cache = (p.model or "none", p.route or "none", p.cache_state) if p else ("none", "none", "none")
                self.metrics.request(model, route, cache, status, shed, tier)
                if p is None or not p.streaming:
                    self.metrics.stages(clock)
        except Exception as exc:
            log.debug("telemetry failed: %r", type(exc).__name__)

    def first_token(self, model_id: str, tier: str, ttft_s: float) -> None:
        if self.metrics is not None:
            self.metrics.first_token(model_id, tier, ttft_s)

    def ended(self, p: Prepared, last: GenerateChunk | None, status: int) -> None:
        """A generated request's end (streamed or not): its metrics and, for streams, its spans."""
        try:
            if self.metrics is not None and last is not None:
                queue_s = ((p.clock.ms("queue") or 0.0) + p.engine_queue_ms) / 1000
                self.metrics.finished(
                    p.model, p.ctx.tier, p.clock.elapsed_ms() / 1000, queue_s, last.prompt_tokens, last.completion_tokens
                )
                if p.streaming:
                    self.metrics.stages(p.clock)
            if p.trace is not None and p.trace.sampled:
                if last is not None:
                    p.trace.attributes.update({
                        "gen_ai.usage.output_tokens": last.completion_tokens,
                        "speculative.accepted_tokens": int(last.timings_ms.get("spec_accepted", 0)),
                        "speculative.proposed_tokens": int(last.timings_ms.get("spec_proposed", 0)),
                    })
                if p.streaming:
                    p.trace.finish(status)
        except Exception as exc:  # telemetry never fails a request
            log.debug("telemetry failed: %r", type(exc).__name__)
