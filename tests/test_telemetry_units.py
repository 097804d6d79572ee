"""telemetry/ without Ray: the stage clock's arithmetic, spans from a request's intervals
(real OpenTelemetry SDK, in-memory exporter), and the Grafana dashboard's queries."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from bench.stats import server_timing
from telemetry.clock import StageClock
from telemetry.metrics import CONTROLLER_METRICS, ENGINE_METRICS, REQUEST_METRICS, exported_names
from telemetry.tracing import RequestTrace

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


def _tracer(ratio: float = 1.0):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_request_trace_continues_the_clients_trace_with_real_times():
    tracer, exporter = _tracer()
    trace_id, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    clock = StageClock()
    trace = RequestTrace(tracer, "POST /v1/chat/completions", {"traceparent": f"00-{trace_id}-{parent}-01"}, clock)
    time.sleep(0.01)
    clock.stage("parse")
    carrier = trace.start_model_call("m")
    time.sleep(0.01)
    clock.stage_parts([("engine_queue", 1.0), ("prefill", 5.0)], "hop")
    trace.stream_from = time.perf_counter()
    trace.attributes["cache.result"] = "miss"
    trace.finish(200)
    trace.finish(500)  # idempotent: the first end wins
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "parse", "generate", "stream"}, "model stages live under generate"
    root = spans["POST /v1/chat/completions"]
    assert f"{root.context.trace_id:032x}" == trace_id and f"{root.parent.span_id:016x}" == parent
    assert root.attributes["cache.result"] == "miss" and root.attributes["http.response.status_code"] == 200
    assert carrier["traceparent"].split("-")[2] == f"{spans['generate'].context.span_id:016x}"
    parse = spans["parse"]
    assert parse.parent.span_id == root.context.span_id
    assert 9e6 <= parse.end_time - parse.start_time <= 5e8  # its real duration, ~10 ms
    assert root.start_time <= parse.start_time and parse.end_time <= root.end_time


def test_an_unsampled_trace_exports_nothing():
    tracer, exporter = _tracer(ratio=0.0)
    trace = RequestTrace(tracer, "POST /v1/completions", {}, StageClock())
    trace.clock.stage("parse")
    trace.finish(200)
    assert not trace.sampled and exporter.get_finished_spans() == ()


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
