"""OpenTelemetry traces: one trace per request, across the ingress and the model replica.

The hot path only reads clocks (telemetry/clock.py). Spans are made when a request ends, from
the intervals it recorded, with their real start and end times; only the root span and the span
of the model call exist while it runs, because the model replica needs its parent id. With
`exporter: none` no tracer exists and nothing here runs.

Context crosses process boundaries as W3C `traceparent`: from the client's header into the root
span, and from the ingress to the model replica inside GenerateRequest.trace.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from configs.schemas import TracingConfig
from engines.types import ENGINE_QUEUE_COUNTS
from telemetry.clock import StageClock

log = logging.getLogger(__name__)
_PROPAGATOR = TraceContextTextMapPropagator()
# Stages the model call's own span (and the replica's spans under it) already covers.
MODEL_STAGES = {"hop", "engine_queue", "prefill"}


def make_tracer(config: TracingConfig, component: str) -> trace.Tracer | None:
    """A tracer exporting as configured, or None for `exporter: none`."""
    if config.exporter == "none":
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if config.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.endpoint, timeout=5)
    else:
        exporter = ConsoleSpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": config.service_name, "service.component": component}),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    # Spans leave in batches from a background thread, never on the request path.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=config.export_interval_ms))
    log.info("tracing: %s exporter for %s", config.exporter, component)
    return provider.get_tracer("latency_serve", "0.1.0")


def carrier(span: trace.Span) -> dict[str, str]:
    """The W3C headers that make `span` the parent on the other side of a hop."""
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out, context=trace.set_span_in_context(span))
    return out


def parent_context(headers: Mapping[str, str] | None):
    return _PROPAGATOR.extract(dict(headers)) if headers else None


class RequestTrace:
    """The spans of one request at the ingress. `finish` is idempotent: the first call ends it."""

    __slots__ = ("tracer", "root", "clock", "model_span", "attributes", "done", "stream_from")

    def __init__(self, tracer: trace.Tracer, name: str, headers: Mapping[str, str], clock: StageClock) -> None:
        self.tracer = tracer
        self.clock = clock
        self.root = tracer.start_span(
            name, context=parent_context(headers), kind=SpanKind.SERVER, start_time=clock.wall_start
        )
        self.model_span: trace.Span | None = None
        self.attributes: dict[str, Any] = {}
        self.stream_from: float | None = None  # perf_counter of the first token, for the stream span
        self.done = False

    @property
    def sampled(self) -> bool:
        return self.root.get_span_context().trace_flags.sampled

    def traceresponse(self) -> str:
        ctx = self.root.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def start_model_call(self, model_id: str) -> dict[str, str]:
        """Open the span of the call to the model replica; returns its traceparent for the replica."""
        if self.model_span is not None:  # a retry: the first call's span ends here
            self.model_span.end()
        self.model_span = self.tracer.start_span(
            "generate", context=trace.set_span_in_context(self.root), kind=SpanKind.CLIENT,
            attributes={"gen_ai.request.model": model_id},
        )
        return carrier(self.model_span)

    def finish(self, status: int, error: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        end = time.perf_counter()
        if not self.sampled:
            self.root.end()
            return
        parent = trace.set_span_in_context(self.root)
        for name, start, stop in self.clock.stages:
            if name not in MODEL_STAGES:
                self._child(name, start, stop, parent)
        for name, start, stop in self.clock.details:
            self._child(name.split(".", 1)[-1], start, stop, parent)
        if self.stream_from is not None:
            self._child("stream", self.stream_from, end, parent)
        if self.model_span is not None:
            self.model_span.end(end_time=self.clock.wall_ns(end))
        self.root.set_attributes({k: v for k, v in self.attributes.items() if v is not None})
        self.root.set_attribute("http.response.status_code", status)
        if error is not None or status >= 500:
            self.root.set_status(Status(StatusCode.ERROR, error or str(status)))
        self.root.end(end_time=self.clock.wall_ns(end))

    def _child(self, name: str, start: float, stop: float, parent) -> None:
        span = self.tracer.start_span(name, context=parent, start_time=self.clock.wall_ns(start))
        span.end(end_time=self.clock.wall_ns(stop))


class ModelCallTrace:
    """The model replica's side: queue, prefill and decode spans under the ingress's `generate`."""

    def __init__(self, tracer: trace.Tracer, headers: Mapping[str, str], model_id: str) -> None:
        self.tracer = tracer
        self.parent = parent_context(headers)
        self.model_id = model_id
        self.called_ns = time.time_ns()
        self.first_ns: int | None = None
        self.last_ns: int | None = None
        self.queue_ms = self.prefill_ms = 0.0
        self.queue_ahead: dict[str, float] = {}

    def first_chunk(self, timings_ms: Mapping[str, float]) -> None:
        self.first_ns = time.time_ns()
        self.queue_ms = timings_ms.get("engine_queue", 0.0)
        self.prefill_ms = timings_ms.get("prefill", 0.0)
        # What ran ahead on the model's worker while this prompt queued (engines/worker_clock.py).
        self.queue_ahead = {f"engine.queue.{k.split('.', 1)[1]}_ms": round(ms, 1)
                            for k, ms in timings_ms.items() if k.startswith("engine_queue.")}
        for key in ENGINE_QUEUE_COUNTS:  # engine_queue_longest_ms -> engine.queue.longest_ms
            if key in timings_ms:
                self.queue_ahead["engine.queue." + key.removeprefix("engine_queue_")] = timings_ms[key]

    def last_chunk(self) -> None:
        """The final chunk is made. The generator resumes after the caller already has it (and
        may have ended its own spans), so the decode span ends here."""
        self.last_ns = time.time_ns()

    def finish(self, tokens: int, timings_ms: Mapping[str, float], outcome: str) -> None:
        end = self.last_ns or time.time_ns()
        t = self.called_ns
        spans = [("engine.queue", t, t + int(self.queue_ms * 1e6), self.queue_ahead)]
        t += int(self.queue_ms * 1e6)
        spans.append(("engine.prefill", t, t + int(self.prefill_ms * 1e6), {}))
        if self.first_ns is not None:
            spans.append(("engine.decode", self.first_ns, end, {
                "gen_ai.usage.output_tokens": tokens,
                "speculative.proposed_tokens": int(timings_ms.get("spec_proposed", 0)),
                "speculative.accepted_tokens": int(timings_ms.get("spec_accepted", 0)),
                "outcome": outcome,
            }))
        for name, start, stop, attributes in spans:
            span = self.tracer.start_span(
                name, context=self.parent, start_time=start, attributes={"gen_ai.request.model": self.model_id, **attributes}
            )
            span.end(end_time=max(start, stop))
