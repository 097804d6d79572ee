"""Spans as plain records, made and exported off the request path as OTLP.

Why not the SDK's `Span` objects: a cache hit's eight SDK spans are slow to make on the request
path and to encode on the exporter thread (the SDK's encoder fills each protobuf field from
Python), all of it under the GIL the ingress's event loop needs, and a whole hit is only a
little of the ingress's CPU: full sampling would cost a visible share of hit throughput. Here a
request queues a function that makes its spans (a few µs on its path); the export thread makes
them as tuples, writes OTLP protobuf by hand and sends it through
the official exporter's HTTP client (endpoint, headers, compression, TLS and retries as the
`OTEL_EXPORTER_OTLP_*` variables say). The SDK still supplies the resource
(`OTEL_RESOURCE_ATTRIBUTES` included), the ratio sampler's bound and the console exporter.
"""

from __future__ import annotations

import atexit
import collections
import hashlib
import logging
import os
import random
import re
import struct
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

log = logging.getLogger(__name__)

# OTLP's SpanKind numbers.
INTERNAL, SERVER, CLIENT = 1, 2, 3
# OTLP span flags: the W3C sampled bit, and "whether the parent is remote" is known (+ its value).
_FLAGS_LOCAL_PARENT, _FLAGS_REMOTE_PARENT = 0x101, 0x301
# Spans per export request. Each POST costs the exporter's Python (requests, urllib3) more than
# many spans' encoding: under a few hundred cache hits a second, small batches would make the
# POSTs most of the tracing's CPU.
MAX_BATCH = 2048
WAKE_AT = 256  # requests' spans queued that wake the export thread before its interval
# The export thread works in slices of this many requests' or spans' worth and offers the GIL
# back between them. Held for a whole batch, the event loop would wait out Python's switch
# interval again and again, and cache-hit throughput would fall.
SLICE = 16
MAX_QUEUE = 4096  # requests' spans waiting; past that new ones are dropped (counted, logged), never piled up


def _yield_gil() -> None:
    time.sleep(0)  # releases the GIL: a thread waiting for it (the event loop) may take it


class SpanData(NamedTuple):
    """One finished span. Ids are ints (0: no parent); times are Unix ns."""

    trace_id: int
    span_id: int
    parent_id: int
    name: str
    start_ns: int
    end_ns: int
    kind: int = INTERNAL
    attributes: Mapping[str, Any] | None = None
    error: str | None = None  # set: status ERROR with this message
    remote_parent: bool = False
    trace_state: str = ""


class TraceParent(NamedTuple):
    trace_id: int
    span_id: int
    sampled: bool
    trace_state: str = ""


def new_id(bits: int = 64) -> int:
    """A random non-zero id, as the SDK's RandomIdGenerator makes them."""
    while True:
        value = random.getrandbits(bits)
        if value:
            return value


# W3C trace context: version 00 has exactly four fields; later versions may append more.
_TRACEPARENT = re.compile(r"^\s*([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\s*$")


def parse_traceparent(headers: Mapping[str, str] | None) -> TraceParent | None:
    """W3C `traceparent` (and `tracestate`) from headers, or None when absent or malformed."""
    value = headers.get("traceparent") if headers else None
    match = _TRACEPARENT.match(value) if value else None
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace, span = int(trace_id, 16), int(span_id, 16)
    if not trace or not span:
        return None
    return TraceParent(trace, span, bool(int(flags, 16) & 1), _trace_state(headers.get("tracestate")))


MAX_TRACESTATE_CHARS = 512  # W3C: 32 members; a propagator may cut at 512 characters


def _trace_state(value: str | None) -> str:
    """A client's `tracestate`, as the OpenTelemetry SDK's propagator parses it (invalid
    members dropped, at most 32), or "" when it is malformed or long: copied into every span."""
    if not value or len(value) > MAX_TRACESTATE_CHARS:
        return ""
    from opentelemetry.trace.span import TraceState

    return TraceState.from_header([value]).to_header()


def traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


class SpanExporter(Protocol):
    def export(self, spans: list[SpanData]) -> bool: ...

    def shutdown(self) -> None: ...


class Tracer:
    """Starts traces (sampling as ParentBased(TraceIdRatioBased)), and takes finished spans into
    a queue that a daemon thread exports every `interval_s`, or at once when WAKE_AT requests wait."""

    def __init__(self, exporter: SpanExporter, sample_ratio: float = 1.0, interval_s: float = 2.0) -> None:
        from opentelemetry.sdk.trace.sampling import TraceIdRatioBased

        self.exporter = exporter
        self._bound = TraceIdRatioBased.get_bound_for_rate(sample_ratio)
        self._sample_key = os.urandom(16)
        self.interval_s = interval_s
        # Each entry is one request's spans, or the function that makes them.
        self._queue: collections.deque[list[SpanData] | Callable[[], list[SpanData]]] = collections.deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # one export at a time (the thread, flush, shutdown)
        self._closed = False
        self.dropped = 0
        self._dropped_logged = 0.0
        self._thread = threading.Thread(target=self._run, name="span-export", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    def start_trace(self, headers: Mapping[str, str] | None) -> tuple[TraceParent | None, int, bool]:
        """(the client's parent or None, this trace's id, sampled). A trace is kept at
        `sample_ratio`, by its id; a client's parent can turn sampling off for its trace but
        not force it past the ratio (a client could make every request pay for spans)."""
        parent = parse_traceparent(headers)
        if parent is not None:
            return parent, parent.trace_id, parent.sampled and self._keep(parent.trace_id)
        trace_id = new_id(128)
        return None, trace_id, self._keep(trace_id)

    def _keep(self, trace_id: int) -> bool:
        """Sampled at the ratio by a keyed hash of the id: a client chooses its trace ids, so
        the id's own bits (all zero, say) must not decide."""
        digest = hashlib.blake2b(trace_id.to_bytes(16, "big"), digest_size=8, key=self._sample_key).digest()
        return int.from_bytes(digest, "big") < self._bound

    def emit(self, spans: list[SpanData] | Callable[[], list[SpanData]]) -> None:
        """Queue finished spans, or a function that makes them (called on the export thread, so
        the request pays for neither); never blocks the caller."""
        if self._closed:
            return
        if len(self._queue) >= MAX_QUEUE:
            self.dropped += 1
            now = time.monotonic()
            if now - self._dropped_logged > 10:
                self._dropped_logged = now
                log.warning("tracing: export queue full, %d requests' spans dropped so far", self.dropped)
            return
        self._queue.append(spans)
        if len(self._queue) >= WAKE_AT:  # ~MAX_BATCH spans: send them now rather than at the interval
            self._wake.set()

    def flush(self) -> None:
        """Export everything queued now, on the caller's thread."""
        with self._lock:
            # What is queued now, not what trickles in meanwhile: that waits for the next
            # round, so a busy service sends a few large requests rather than many small ones.
            batch: list[SpanData] = []
            for left in reversed(range(len(self._queue))):  # how many remain after this one
                item = self._queue.popleft()
                try:
                    batch.extend(item() if callable(item) else item)
                except Exception as exc:  # one request's broken spans never stop the others'
                    log.warning("tracing: spans not made: %r", exc)
                if left % SLICE == 0:
                    _yield_gil()
                if len(batch) >= MAX_BATCH or not left:
                    self._export(batch)
                    batch = []

    def _export(self, batch: list[SpanData]) -> None:
        try:
            self.exporter.export(batch)
        except Exception as exc:  # an exporter failure loses a batch, never the thread
            log.warning("tracing: export failed: %r", exc)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self.flush()
        try:
            self.exporter.shutdown()
        except Exception:
            pass

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            self.flush()


# ------------------------------------------------------------------ exporters


# OTLP's protobuf, written by hand: the official classes are slower to fill from Python.
# tests/test_telemetry_units.py reads it back with the official classes.
_pack_fixed64 = struct.Struct("<Q").pack
_pack_double = struct.Struct("<d").pack
_pack_fixed32 = struct.Struct("<I").pack


def _varint(n: int) -> bytes:
    if n < 0x80:
        return bytes((n,))
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(tag: bytes, payload: bytes) -> bytes:
    return tag + _varint(len(payload)) + payload


def _any_value(value: Any) -> bytes:
    """AnyValue: string (1), bool (2), int (3), double (4)."""
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _pack_double(value)
    return _len_field(b"\x0a", str(value).encode())


# Most attributes and names repeat from request to request (tier, model, route, cache result):
# their encodings are kept, up to a bound.
_encoded: dict[tuple, bytes] = {}


def _key_value(tag: bytes, key: str, value: Any) -> bytes:
    """KeyValue{key (1), value (2)} under field `tag`."""
    memo = (tag, key, type(value), value)  # the type: True == 1, and both hash alike
    out = _encoded.get(memo)
    if out is None:
        out = _len_field(tag, _len_field(b"\x0a", key.encode()) + _len_field(b"\x12", _any_value(value)))
        if len(_encoded) >= 4096:
            _encoded.clear()
        _encoded[memo] = out
    return out


def _key_values(tag: bytes, attributes: Mapping[str, Any]) -> list[bytes]:
    return [_key_value(tag, k, v) for k, v in attributes.items() if v is not None]


def _name(name: str) -> bytes:
    out = _encoded.get((name,))
    if out is None:
        out = _encoded[(name,)] = _len_field(b"\x2a", name.encode())
    return out


def _span(s: SpanData) -> bytes:
    """Span: trace_id 1, span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6, start 7,
    end 8, attributes 9, status 15 {message 2, code 3}, flags 16."""
    parts = [b"\x0a\x10", s.trace_id.to_bytes(16, "big"), b"\x12\x08", s.span_id.to_bytes(8, "big")]
    if s.trace_state:
        parts.append(_len_field(b"\x1a", s.trace_state.encode()))
    if s.parent_id:
        parts += (b"\x22\x08", s.parent_id.to_bytes(8, "big"))
    parts += (_name(s.name), b"\x30", bytes((s.kind,)),
              b"\x39", _pack_fixed64(s.start_ns), b"\x41", _pack_fixed64(max(s.start_ns, s.end_ns)))
    if s.attributes:
        parts += _key_values(b"\x4a", s.attributes)
    if s.error is not None:
        parts.append(_len_field(b"\x7a", _len_field(b"\x12", s.error.encode()) + b"\x18\x02"))  # STATUS_CODE_ERROR
    parts += (b"\x85\x01", _pack_fixed32(_FLAGS_REMOTE_PARENT if s.remote_parent else _FLAGS_LOCAL_PARENT))
    return b"".join(parts)


def encode_otlp(spans: list[SpanData], resource: Mapping[str, Any], scope: tuple[str, str],
                pause: Callable[[], None] | None = None) -> bytes:
    """An OTLP ExportTraceServiceRequest {resource_spans 1: {resource 1: {attributes 1},
    scope_spans 2: {scope 1: {name 1, version 2}, spans 2}}} holding `spans`. `pause` is called
    between slices of spans."""
    scope_msg = _len_field(b"\x0a", _len_field(b"\x0a", scope[0].encode()) + _len_field(b"\x12", scope[1].encode()))
    parts = [scope_msg]
    for i in range(0, len(spans), SLICE * 4):
        parts += [_len_field(b"\x12", _span(s)) for s in spans[i:i + SLICE * 4]]
        if pause is not None:
            pause()
    scope_spans = b"".join(parts)
    resource_msg = _len_field(b"\x0a", b"".join(_key_values(b"\x0a", resource)))
    return _len_field(b"\x0a", resource_msg + _len_field(b"\x12", scope_spans))


def _resource(service_name: str, component: str) -> dict[str, Any]:
    """The SDK's resource (telemetry.sdk.*, OTEL_RESOURCE_ATTRIBUTES, OTEL_SERVICE_NAME) plus ours."""
    from opentelemetry.sdk.resources import Resource

    return dict(Resource.create({"service.name": service_name, "service.component": component}).attributes)


SCOPE = ("latency_serve", "0.1.0")


class OtlpHttpExporter:
    """OTLP/HTTP through the official exporter package's client: it does the POST, headers,
    compression, TLS and retries; we hand it the encoded request."""

    def __init__(self, endpoint: str, service_name: str, component: str, timeout_s: float = 5) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        self._official = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)
        self._resource = _resource(service_name, component)

    def export(self, spans: list[SpanData]) -> bool:
        result = self._official._client.export(encode_otlp(spans, self._resource, SCOPE, pause=_yield_gil))
        if not result.success:
            log.warning("tracing: OTLP export of %d spans failed: %s", len(spans), result.error)
        return result.success

    def shutdown(self) -> None:
        self._official.shutdown()


class ConsoleExporter:
    """The SDK's console exporter (one JSON object per span on stdout), fed SDK ReadableSpans."""

    def __init__(self, service_name: str, component: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        self._console = ConsoleSpanExporter()
        self._resource = Resource.create({"service.name": service_name, "service.component": component})

    def export(self, spans: list[SpanData]) -> bool:
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        kinds = {INTERNAL: SpanKind.INTERNAL, SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}
        sampled = TraceFlags(TraceFlags.SAMPLED)
        readable = [
            ReadableSpan(
                name=s.name,
                context=SpanContext(s.trace_id, s.span_id, is_remote=False, trace_flags=sampled),
                parent=SpanContext(s.trace_id, s.parent_id, is_remote=s.remote_parent, trace_flags=sampled)
                if s.parent_id else None,
                resource=self._resource, attributes=dict(s.attributes or {}), kind=kinds[s.kind],
                status=Status(StatusCode.ERROR, s.error) if s.error is not None else Status(StatusCode.UNSET),
                start_time=s.start_ns, end_time=max(s.start_ns, s.end_ns),
            )
            for s in spans
        ]
        self._console.export(readable)
        return True

    def shutdown(self) -> None:
        self._console.shutdown()


class MemoryExporter:
    """Keeps what it is sent (tests)."""

    def __init__(self) -> None:
        self.spans: list[SpanData] = []

    def export(self, spans: list[SpanData]) -> bool:
        self.spans.extend(spans)
        return True

    def shutdown(self) -> None:
        pass
