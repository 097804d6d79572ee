"""What happened to one request (`Record`), and its metrics and spans (telemetry/), recorded at
its end: when its response leaves, or, for a stream, when the stream ends. Telemetry never
fails a request: nothing here raises. Without a recorder or a tracer (unit tests without Ray,
telemetry off) it records nothing."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import Response

from engines.types import GenerateChunk
from router.base import RouteDecision
from telemetry.clock import StageClock
from telemetry.metrics import RequestMetrics
from telemetry.tracing import RequestTrace

log = logging.getLogger(__name__)


@dataclass
class Record:
    """What happened to one request, for its response headers, metrics and spans: its stage
    clock and trace, and what the stages returned, written by the pipeline's spine alone (the
    request itself, `Prepared`, never changes)."""

    clock: StageClock = field(default_factory=StageClock)  # where its time went: Server-Timing, spans, metrics
    trace: RequestTrace | None = None  # its spans, when tracing is on and the trace is sampled
    tier: str = "none"
    requested_model: str | None = None
    prompt_tokens: int = 0
    cache: str = "none"  # hit / verified / hint / miss / bypass
    decision: RouteDecision | None = None  # the model that answers (after routing and admission's moves;
    # the cache's for a hit), and why
    notes: dict[str, str] = field(default_factory=dict)  # response headers: what the stages changed
    engine_queue_ms: float = 0.0  # the model replica's queue, from its first chunk
    streaming: bool = False  # the SSE body owns the request's end (its metrics and spans)

    @property
    def model(self) -> str:
        return self.decision.model_id if self.decision is not None else ""

    @property
    def route(self) -> str:
        return self.decision.reason if self.decision is not None else ""

    def copy(self) -> "Record":
        """A record of its own for one of n choices: its own clock, the same trace."""
        return Record(StageClock(), self.trace, self.tier, self.requested_model, self.prompt_tokens,
                      notes=dict(self.notes))


class RequestAccounting:
    def __init__(self, metrics: RequestMetrics | None = None, tracer=None) -> None:
        self.metrics = metrics
        self.tracer = tracer  # an OpenTelemetry tracer when tracing is on

    def record(self, request: Request) -> Record:
        """A new request's record: its clock starts now, its trace (tracing on) from the headers."""
        rec = Record()
        if self.tracer is not None:
            rec.trace = RequestTrace(self.tracer, f"POST {request.url.path}", request.headers, rec.clock)
        return rec

    def answered(self, rec: Record, tenant: str | None, response: Response | None, shed: str | None) -> None:
        """A request that got its response (a stream's end comes later, in `ended`)."""
        status = response.status_code if response is not None else 499  # None: cancelled (client gone)
        trace = rec.trace
        try:
            if trace is not None:
                if response is not None:
                    response.headers["traceresponse"] = trace.traceresponse()
                if rec.requested_model is not None:
                    trace.attributes.update({
                        "tenant.id": tenant, "slo.tier": rec.tier, "gen_ai.request.model": rec.requested_model,
                        "gen_ai.response.model": rec.model or None, "route.reason": rec.route or None,
                        "cache.result": rec.cache, "gen_ai.usage.input_tokens": rec.prompt_tokens or None,
                    })
                if shed is not None:
                    trace.attributes["admission.shed_reason"] = shed
                if not rec.streaming:
                    trace.finish(status)
            if self.metrics is not None:
                self.metrics.request(rec.model or "none", rec.route or "none", rec.cache, status, shed, rec.tier)
                if not rec.streaming:
                    self.metrics.stages(rec.clock)
        except Exception as exc:
            log.debug("telemetry failed: %r", type(exc).__name__)

    def first_token(self, model_id: str, tier: str, ttft_s: float) -> None:
        if self.metrics is not None:
            self.metrics.first_token(model_id, tier, ttft_s)

    def ended(self, rec: Record, last: GenerateChunk | None, status: int) -> None:
        """A generated request's end (streamed or not): its metrics and, for streams, its spans."""
        try:
            if self.metrics is not None and last is not None:
                queue_s = ((rec.clock.ms("queue") or 0.0) + rec.engine_queue_ms) / 1000
                self.metrics.finished(
                    rec.model, rec.tier, rec.clock.elapsed_ms() / 1000, queue_s, last.prompt_tokens, last.completion_tokens
                )
                if rec.streaming:
                    self.metrics.stages(rec.clock)
            if rec.trace is not None and rec.trace.sampled:
                if last is not None:
                    rec.trace.attributes.update({
                        "gen_ai.usage.output_tokens": last.completion_tokens,
                        "speculative.accepted_tokens": int(last.timings_ms.get("spec_accepted", 0)),
                        "speculative.proposed_tokens": int(last.timings_ms.get("spec_proposed", 0)),
                    })
                if rec.streaming:
                    rec.trace.finish(status)
        except Exception as exc:  # telemetry never fails a request
            log.debug("telemetry failed: %r", type(exc).__name__)
