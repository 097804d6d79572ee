"""A minimal OTLP/HTTP trace receiver on loopback: keeps the spans it is sent, in memory.

For tests and benchmarks that need a real OTLP endpoint for the real exporter to talk to,
without running an OpenTelemetry Collector.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class SpanRecord:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    service: str  # service.component of the process that made it (Ingress, TargetModel ...)
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class OTLPSink:
    def __init__(self, keep: bool = True) -> None:
        self.spans: list[SpanRecord] = []
        self.requests = 0
        self._keep = keep  # False: count and drop (throughput runs)
        self._lock = threading.Lock()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a collector: a new connection per export would be the sink's cost

            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                sink._receive(body)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _receive(self, body: bytes) -> None:
        if not self._keep:  # a throughput run: a collector's parsing is not the service's cost
            with self._lock:
                self.requests += 1
            return
        request = ExportTraceServiceRequest.FromString(body)
        records = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope in resource_spans.scope_spans:
                for s in scope.spans:
                    records.append(SpanRecord(
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        str(resource.get("service.component", "")), s.start_time_unix_nano, s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                    ))
        with self._lock:
            self.requests += 1
            self.spans.extend(records)

    def trace(self, trace_id: str) -> list[SpanRecord]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
