"""telemetry/ without Ray: the stage clock's arithmetic, spans from a request's intervals
(the OTLP encoding read back by the official protobuf classes, the real exporter client), and the Grafana dashboard's queries."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from telemetry.clock import server_timing
from telemetry.clock import StageClock
from telemetry.metrics import CONTROLLER_METRICS, ENGINE_METRICS, REQUEST_METRICS, exported_names
from telemetry.spans import (
    MAX_QUEUE, SERVER, MemoryExporter, OtlpHttpExporter, SpanData, Tracer, encode_otlp, parse_traceparent,
)
from telemetry.tracing import ModelCallTrace, RequestTrace

DASHBOARD = Path(__file__).resolve().parents[1] / "telemetry" / "grafana_dashboard.json"


def test_stages_add_up_and_details_do_not():
    clock = StageClock()
    t = clock.start
    clock.stage("parse", t + 0.002)
    clock.detail("lookup.embed", t + 0.002, t + 0.012)
    clock.stage("lookup", t + 0.015)
    # 40 ms from the call to the first chunk: the replica said 3 ms queue + 30 ms prefill.
    clock.stage_parts([("engine_queue", 3.0), ("prefill", 30.0)], "hop", t + 0.055)
    stages = clock.stage_ms()
    assert list(stages) == ["parse", "lookup", "hop", "engine_queue", "prefill"]
    assert round(stages["hop"], 6) == 7.0 and round(stages["prefill"], 6) == 30.0
    assert round(sum(stages.values()), 6) == 55.0
    parsed = server_timing(clock.server_timing())
    assert parsed["lookup.embed"] == 10.0 and parsed["parse"] == 2.0
    assert "total" in parsed  # measured at rendering (the stage times here are synthetic)


def test_details_measured_inside_a_call_sit_in_its_middle():
    """The cache replica's exact check, embedding and search, inside the 20 ms lookup hop."""
    clock = StageClock()
    t = clock.start
    clock.details_within(t, t + 0.020, [("lookup.cache_exact", 0.0), ("lookup.embed", 8.0), ("lookup.cache_semantic", 2.0)])
    (_, s0, e0), (_, s1, e1), (_, s2, e2) = clock.details
    assert round((s0 - t) * 1000, 6) == 5.0 and s1 == e0 and s2 == e1
    assert round((e1 - s1) * 1000, 6) == 8.0 and round((t + 0.020 - e2) * 1000, 6) == 5.0
    parsed = server_timing(clock.server_timing())
    assert parsed["lookup.embed"] == 8.0 and parsed["lookup.cache_semantic"] == 2.0


def test_parts_reported_longer_than_the_interval_are_clamped():
    clock = StageClock()
    clock.stage_parts([("engine_queue", 5.0), ("prefill", 500.0)], "hop", clock.start + 0.1)
    stages = clock.stage_ms()
    assert round(stages["prefill"], 6) == 95.0 and stages["hop"] == 0.0
    assert round(sum(stages.values()), 6) == 100.0
    # The cut part's whole measurement rides along as a detail (not added to the total).
    assert round(clock.ms("prefill.whole"), 6) == 500.0 and clock.ms("engine_queue.whole") is None


def _tracer(ratio: float = 1.0) -> tuple[Tracer, MemoryExporter]:
    exporter = MemoryExporter()
    return Tracer(exporter, sample_ratio=ratio, interval_s=60), exporter


def test_request_trace_continues_the_clients_trace_with_real_times():
    tracer, exporter = _tracer()
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    clock = StageClock()
    headers = {"traceparent": f"00-{trace_id}-{parent}-01", "tracestate": "vendor=1"}
    trace = RequestTrace(tracer, "POST /v1/chat/completions", headers, clock)
    time.sleep(0.01)
    clock.stage("parse")
    carrier = trace.start_model_call("m")
    time.sleep(0.01)
    clock.stage_parts([("engine_queue", 1.0), ("prefill", 5.0)], "hop")
    trace.stream_from = time.perf_counter()
    trace.attributes["cache.result"] = "miss"
    trace.finish(200)
    trace.finish(500)  # idempotent: the first end wins
    tracer.flush()
    spans = {s.name: s for s in exporter.spans}
    assert len(exporter.spans) == 4
    assert set(spans) == {"POST /v1/chat/completions", "parse", "generate", "stream"}, "model stages live under generate"
    root = spans["POST /v1/chat/completions"]
    assert f"{root.trace_id:032x}" == trace_id and f"{root.parent_id:016x}" == parent and root.remote_parent
    assert root.kind == SERVER and root.error is None and root.trace_state == "vendor=1"
    assert root.attributes["cache.result"] == "miss" and root.attributes["http.response.status_code"] == 200
    assert carrier == {"traceparent": f"00-{trace_id}-{spans['generate'].span_id:016x}-01", "tracestate": "vendor=1"}
    assert trace.traceresponse() == f"00-{trace_id}-{root.span_id:016x}-01"
    parse = spans["parse"]
    assert parse.parent_id == root.span_id and spans["generate"].parent_id == root.span_id
    assert 9e6 <= parse.end_ns - parse.start_ns <= 5e8  # its real duration, ~10 ms
    assert root.start_ns <= parse.start_ns and parse.end_ns <= root.end_ns
    assert len({s.span_id for s in exporter.spans}) == 4 and {s.trace_id for s in exporter.spans} == {root.trace_id}


def test_a_failed_request_and_a_retried_model_call_show_in_its_spans():
    tracer, exporter = _tracer()
    trace = RequestTrace(tracer, "POST /v1/completions", {}, StageClock())
    first = trace.start_model_call("m")
    time.sleep(0.005)
    second = trace.start_model_call("m")  # the replica died; the call runs again
    trace.finish(503)
    tracer.flush()
    generate = [s for s in exporter.spans if s.name == "generate"]
    assert len(generate) == 2 and first != second
    assert generate[0].end_ns <= generate[1].start_ns + 1000
    root = next(s for s in exporter.spans if s.name == "POST /v1/completions")
    assert root.parent_id == 0 and not root.remote_parent and root.error == "503"


def test_an_unsampled_trace_exports_nothing_and_says_so_downstream():
    tracer, exporter = _tracer(ratio=0.0)
    trace = RequestTrace(tracer, "POST /v1/completions", {}, StageClock())
    trace.clock.stage("parse")
    trace.finish(200)
    tracer.flush()
    assert not trace.sampled and exporter.spans == [] and trace.traceresponse().endswith("-00")
    # A client's unsampled parent decides for its own trace even at ratio 1; the model replica
    # follows the flag it is handed.
    tracer, exporter = _tracer(ratio=1.0)
    headers = {"traceparent": f"00-{'ab' * 16}-{'cd' * 8}-00"}
    trace = RequestTrace(tracer, "POST /v1/completions", headers, StageClock())
    model = ModelCallTrace(tracer, trace.start_model_call("m"), "m")
    model.first_chunk({"engine_queue": 1.0, "prefill": 2.0})
    model.finish(3, {}, "stop")
    trace.finish(200)
    tracer.flush()
    assert not trace.sampled and exporter.spans == []


def test_the_model_replicas_spans_hang_under_the_ingress_model_call():
    tracer, exporter = _tracer()
    trace = RequestTrace(tracer, "POST /v1/chat/completions", {}, StageClock())
    carrier = trace.start_model_call("m")
    model = ModelCallTrace(tracer, carrier, "m")
    model.first_chunk({"engine_queue": 2.0, "prefill": 30.0, "engine_queue.steps": 1.5, "engine_queue_jobs": 2})
    model.last_chunk()
    model.finish(7, {"spec_proposed": 8, "spec_accepted": 5}, "stop")
    tracer.flush()
    spans = {s.name: s for s in exporter.spans}
    generate_id = int(carrier["traceparent"].split("-")[2], 16)
    assert set(spans) == {"engine.queue", "engine.prefill", "engine.decode"}
    for span in spans.values():
        assert span.parent_id == generate_id and span.trace_id == trace.trace_id and span.remote_parent
    assert spans["engine.queue"].attributes["engine.queue.steps_ms"] == 1.5
    assert spans["engine.queue"].attributes["engine.queue.jobs"] == 2
    assert spans["engine.decode"].attributes["speculative.accepted_tokens"] == 5
    assert round((spans["engine.prefill"].end_ns - spans["engine.prefill"].start_ns) / 1e6) == 30


def test_traceparent_parsing_follows_w3c():
    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    parsed = parse_traceparent({"traceparent": good})
    assert parsed == (0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True, "")
    assert parse_traceparent({"traceparent": "01" + good[2:] + "-later-fields"}) is not None  # a future version
    for bad in (good.upper(), good + "-x", "ff" + good[2:], good.replace("4bf9", "0x12"),
                f"00-{'0' * 32}-00f067aa0ba902b7-01", f"00-4bf92f3577b34da6a3ce929d0e0e4736-{'0' * 16}-01", "", "junk"):
        assert parse_traceparent({"traceparent": bad}) is None, bad
    assert parse_traceparent({}) is None and parse_traceparent(None) is None


def test_spans_encode_to_otlp_that_the_official_protobuf_reads_back():
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
    from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
    from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

    spans = [
        SpanData(7, 11, 0, "root", 1_000, 5_000, SERVER, {"a": "x", "n": 3, "f": 0.5, "b": True, "none": None}, "boom"),
        SpanData(7, 12, 11, "child", 2_000, 1_500, trace_state="k=v"),  # ends before it starts: clamped
    ]
    encoded = encode_otlp(spans, {"service.name": "s"}, ("scope", "1"))
    decoded = ExportTraceServiceRequest.FromString(encoded)
    (resource_spans,) = decoded.resource_spans
    assert resource_spans.resource.attributes[0].value.string_value == "s"
    (scope_spans,) = resource_spans.scope_spans
    assert scope_spans.scope.name == "scope"
    root, child = scope_spans.spans
    assert root.trace_id == (7).to_bytes(16, "big") and root.span_id == (11).to_bytes(8, "big")
    assert root.parent_span_id == b"" and root.kind == SERVER and root.status.code == 2 and root.status.message == "boom"
    attrs = {a.key: a.value for a in root.attributes}
    assert set(attrs) == {"a", "n", "f", "b"}
    assert (attrs["a"].string_value, attrs["n"].int_value, attrs["f"].double_value, attrs["b"].bool_value) == ("x", 3, 0.5, True)
    assert child.parent_span_id == (11).to_bytes(8, "big") and child.end_time_unix_nano == 2_000
    assert child.trace_state == "k=v" and child.status.code == 0
    # Field for field what the official classes make of the same spans.
    official = Span(
        trace_id=(7).to_bytes(16, "big"), span_id=(11).to_bytes(8, "big"), name="root", kind=SERVER,
        start_time_unix_nano=1_000, end_time_unix_nano=5_000, flags=0x101,
        attributes=[KeyValue(key="a", value=AnyValue(string_value="x")), KeyValue(key="n", value=AnyValue(int_value=3)),
                    KeyValue(key="f", value=AnyValue(double_value=0.5)), KeyValue(key="b", value=AnyValue(bool_value=True))],
        status=Status(code=Status.STATUS_CODE_ERROR, message="boom"),
    )
    assert root == official
    negative = encode_otlp([SpanData(1, 2, 0, "n", 0, 0, attributes={"x": -5})], {}, ("s", ""))
    value = ExportTraceServiceRequest.FromString(negative).resource_spans[0].scope_spans[0].spans[0].attributes[0].value
    assert value.int_value == -5


def test_the_otlp_exporter_posts_through_the_official_client_and_a_full_queue_drops():
    from bench.otlp_sink import OTLPSink

    sink = OTLPSink()
    try:
        tracer = Tracer(OtlpHttpExporter(sink.endpoint, "svc", "Ingress"), interval_s=0.05)
        trace = RequestTrace(tracer, "POST /v1/chat/completions", {}, StageClock())
        trace.clock.stage("parse")
        trace.finish(200)
        deadline = time.monotonic() + 10
        while len(sink.spans) < 2 and time.monotonic() < deadline:  # the background thread sends it
            time.sleep(0.05)
        assert {s.name for s in sink.spans} == {"POST /v1/chat/completions", "parse"}
        assert {s.service for s in sink.spans} == {"Ingress"} and {s.trace_id for s in sink.spans} == {f"{trace.trace_id:032x}"}
        tracer.shutdown()
    finally:
        sink.close()
    full, exporter = _tracer()
    full._wake.set = lambda: None  # hold the export thread: the queue fills as under a stalled collector
    for i in range(MAX_QUEUE + 3):
        full.emit([SpanData(1, i + 1, 0, "x", 0, 1)])
    full.emit(lambda: 1 / 0)  # dropped too; queued, it would have failed alone
    full.flush()
    assert full.dropped == 4 and len(exporter.spans) == MAX_QUEUE


def test_grafana_dashboard_queries_only_exported_metrics_and_shows_each():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    used = set()
    for expr in exprs:
        for name in re.findall(r"ray_latency_serve_\w+", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", name)
            assert base in exported_names(), f"dashboard queries {name}, which nothing exports"
            used.add(base)
    shown = set(exported_names()) - used
    assert not shown, f"exported but on no panel: {sorted(shown)}"
    assert len(REQUEST_METRICS) + len(ENGINE_METRICS) + len(CONTROLLER_METRICS) == len(exported_names())


def test_a_client_cannot_force_sampling_with_its_choice_of_trace_id():
    """Sampling keeps a trace at the ratio by a keyed hash of its id: ids whose low 64 bits are
    zero (which a ratio test on the id's own bits always keeps) are kept at the ratio too."""
    import secrets

    tracer, _ = _tracer(ratio=0.05)
    kept = 0
    for _ in range(400):
        trace_id = secrets.token_hex(8) + "0" * 16
        headers = {"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"}
        _, _, sampled = tracer.start_trace(headers)
        kept += sampled
    assert kept < 60, f"{kept} of 400 kept at a 5% ratio"
