"""OpenTelemetry traces: one trace per request, across the ingress and the model replica.

The hot path only reads clocks (telemetry/clock.py). Spans are made when a request ends, from
the intervals it recorded, with their real start and end times, as plain records that a
background thread encodes and exports (telemetry/spans.py says why not the SDK's Span objects).
With `exporter: none` no tracer exists and nothing here runs.

Context crosses process boundaries as W3C `traceparent`: from the client's header into the root
span, and from the ingress to the model replica inside GenerateRequest.trace.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

from configs.schemas import TracingConfig
from engines.types import ENGINE_QUEUE_COUNTS
from telemetry.clock import StageClock
from telemetry.spans import (
    CLIENT, INTERNAL, SERVER, ConsoleExporter, OtlpHttpExporter, SpanData, Tracer, new_id, parse_traceparent, traceparent,
)

log = logging.getLogger(__name__)
# Stages the model call's own span (and the replica's spans under it) already covers.
MODEL_STAGES = {"hop", "engine_queue", "prefill"}


def make_tracer(config: TracingConfig, component: str) -> Tracer | None:
    """A tracer exporting as configured, or None for `exporter: none`."""
    if config.exporter == "none":
        return None
    if config.exporter == "otlp":
        exporter = OtlpHttpExporter(config.endpoint, config.service_name, component)
    else:
        exporter = ConsoleExporter(config.service_name, component)
    log.info("tracing: %s exporter for %s", config.exporter, component)
    # Spans leave in batches from a background thread, never on the request path.
    return Tracer(exporter, config.sample_ratio, config.export_interval_ms / 1000)


class RequestTrace:
    """The spans of one request at the ingress. `finish` is idempotent: the first call ends it."""

    __slots__ = ("tracer", "clock", "name", "parent", "trace_id", "span_id", "sampled", "model_calls",
                 "attributes", "done", "stream_from")

    def __init__(self, tracer: Tracer, name: str, headers: Mapping[str, str], clock: StageClock) -> None:
        self.tracer = tracer
        self.clock = clock
        self.name = name
        self.parent, self.trace_id, self.sampled = tracer.start_trace(headers)
        self.span_id = new_id()
        # (span id, start, end or None, model id) of each call to a model replica (a retry adds one).
        self.model_calls: list[list] = []
        self.attributes: dict[str, Any] = {}
        self.stream_from: float | None = None  # perf_counter of the first token, for the stream span
        self.done = False

    def traceresponse(self) -> str:
        return traceparent(self.trace_id, self.span_id, self.sampled)

    def start_model_call(self, model_id: str) -> dict[str, str]:
        """Open the span of the call to the model replica; returns its traceparent for the replica."""
        now = time.perf_counter()
        if self.model_calls and self.model_calls[-1][2] is None:  # a retry: the first call's span ends here
            self.model_calls[-1][2] = now
        span_id = new_id()
        self.model_calls.append([span_id, now, None, model_id])
        carrier = {"traceparent": traceparent(self.trace_id, span_id, self.sampled)}
        if self.parent is not None and self.parent.trace_state:
            carrier["tracestate"] = self.parent.trace_state
        return carrier

    def finish(self, status: int, error: str | None = None) -> None:
        """The request ended: its spans are made and sent later, off the request path."""
        if self.done:
            return
        self.done = True
        if not self.sampled:
            return
        # Copies (microseconds): the export thread must not see later changes.
        recorded = (list(self.clock.stages), list(self.clock.details), dict(self.attributes))
        self.tracer.emit(functools.partial(self._spans, time.perf_counter(), status, error, *recorded))

    def _spans(self, end: float, status: int, error: str | None, stages: list, details: list, attributes: dict
               ) -> list[SpanData]:
        """The request's spans, made on the export thread from what it recorded."""
        wall, trace_id, root = self.clock.wall_ns, self.trace_id, self.span_id
        state = self.parent.trace_state if self.parent is not None else ""
        # Positional: a NamedTuple built with keywords costs twice as much, thousands of times a second.
        spans = [SpanData(trace_id, new_id(), root, name, wall(start), wall(stop), INTERNAL, None, None, False, state)
                 for name, start, stop in stages if name not in MODEL_STAGES]
        spans += [SpanData(trace_id, new_id(), root, name.split(".", 1)[-1], wall(start), wall(stop), INTERNAL, None, None,
                           False, state) for name, start, stop in details]
        if self.stream_from is not None:
            spans.append(SpanData(trace_id, new_id(), root, "stream", wall(self.stream_from), wall(end), INTERNAL, None,
                                  None, False, state))
        for span_id, start, stop, model_id in self.model_calls:
            spans.append(SpanData(trace_id, span_id, root, "generate", wall(start), wall(end if stop is None else stop),
                                  CLIENT, {"gen_ai.request.model": model_id}, trace_state=state))
        attributes = {k: v for k, v in attributes.items() if v is not None}
        attributes["http.response.status_code"] = status
        failed = error if error is not None else (str(status) if status >= 500 else None)
        spans.append(SpanData(
            trace_id, root, self.parent.span_id if self.parent is not None else 0, self.name,
            self.clock.wall_start, wall(end), SERVER, attributes, failed, self.parent is not None, state,
        ))
        return spans


class ModelCallTrace:
    """The model replica's side: queue, prefill and decode spans under the ingress's `generate`."""

    def __init__(self, tracer: Tracer, headers: Mapping[str, str], model_id: str) -> None:
        self.tracer = tracer
        self.parent = parse_traceparent(headers)
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
        """The generation ended: its spans are made later, on the export thread."""
        if self.parent is None or not self.parent.sampled:
            return
        proposed, accepted = int(timings_ms.get("spec_proposed", 0)), int(timings_ms.get("spec_accepted", 0))
        self.tracer.emit(functools.partial(self._spans, self.last_ns or time.time_ns(), tokens, proposed, accepted, outcome))

    def _spans(self, end: int, tokens: int, proposed: int, accepted: int, outcome: str) -> list[SpanData]:
        t = self.called_ns
        spans = [("engine.queue", t, t + int(self.queue_ms * 1e6), self.queue_ahead)]
        t += int(self.queue_ms * 1e6)
        spans.append(("engine.prefill", t, t + int(self.prefill_ms * 1e6), {}))
        if self.first_ns is not None:
            spans.append(("engine.decode", self.first_ns, end, {
                "gen_ai.usage.output_tokens": tokens,
                "speculative.proposed_tokens": proposed,
                "speculative.accepted_tokens": accepted,
                "outcome": outcome,
            }))
        parent = self.parent
        return [
            SpanData(parent.trace_id, new_id(), parent.span_id, name, start, stop,
                     attributes={"gen_ai.request.model": self.model_id, **attributes},
                     remote_parent=True, trace_state=parent.trace_state)
            for name, start, stop, attributes in spans
        ]
