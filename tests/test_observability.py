"""Observability end to end: Server-Timing adds up, every metric reaches Prometheus, one trace per
request across the ingress and the model replica (real OTLP export, real Ray metrics agent)."""

from __future__ import annotations

import re
import secrets
import time
import uuid

import httpx
import openai
import pytest

from telemetry.clock import server_timing
from telemetry.metrics import exported_names
from tests.conftest import ONE_SHOT_KEY

TARGET = "smollm2-135m-instruct"
STAGES = {"parse", "tokenize", "admit", "lookup", "route", "queue", "hop", "engine_queue", "prefill"}


def _unique_question() -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Name a color of the sky ({uuid.uuid4().hex[:8]})."}]


def test_streamed_server_timing_stages_add_up_to_the_server_time(service):
    client = service.openai()
    start = time.perf_counter()
    raw = client.chat.completions.with_raw_response.create(
        model=TARGET, messages=_unique_question(), temperature=0, max_tokens=8, stream=True,
        extra_headers={"cache-control": "no-store"},  # looked up (a miss), not written
    )
    headers_ms = (time.perf_counter() - start) * 1000
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    timing = server_timing(raw.headers["server-timing"])
    stages = {name: ms for name, ms in timing.items() if "." not in name and name != "total"}
    assert STAGES <= set(stages), f"missing stages: {STAGES - set(stages)} in {raw.headers['server-timing']}"
    total = timing["total"]
    assert abs(sum(stages.values()) - total) <= 0.10 * total, (stages, total)
    # The server's time is inside what the client waited for the headers (the rest is the
    # client, HTTP and the proxy's hop); details explain stages and are not part of the sum.
    assert 0 < total <= headers_ms
    assert timing["lookup.cache"] >= timing["lookup.cache_exact"]


def _metrics_text() -> tuple[str, str]:
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return url, httpx.get(url, timeout=10).text


def test_every_metric_is_on_the_prometheus_endpoint_after_one_request(service):
    client = service.openai(api_key=ONE_SHOT_KEY)
    # An answer that quotes its prompt: prompt lookup drafts it, so the speculation counters move.
    quote = f"Repeat this sentence exactly: the quick brown fox {uuid.uuid4().hex[:6]} jumps over the lazy dog."
    stream = client.chat.completions.create(
        model=TARGET, messages=[{"role": "user", "content": quote}], temperature=0, max_tokens=24, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    with pytest.raises(openai.RateLimitError):  # this tenant's second request is shed: 429
        client.chat.completions.create(model=TARGET, messages=_unique_question(), max_tokens=2)
    wanted = set(exported_names())
    if service.config.args.target.speculative.method == "none":  # a counter Ray exports once it first moves
        wanted = {name for name in wanted if "spec_decode" not in name}
    # This request's own samples, not just the names (earlier tests export the same series):
    # Ray's agent collects every ~10 s and the replica gauge is read every 5 s from the Serve controller.
    expected = [
        r'^ray_latency_serve_requests_shed_total\{[^}]*reason="rate_limit_requests"',
        r'^ray_latency_serve_requests_total\{[^}]*status="429"',
        r'^ray_latency_serve_time_to_first_token_seconds_count\{[^}]*model_name="%s"' % TARGET,
        r'^ray_latency_serve_replicas\{[^}]*deployment="TargetModel"[^}]*\} 1',
    ]
    deadline = time.monotonic() + 90
    while True:
        url, text = _metrics_text()
        present = set(re.findall(r"^(ray_latency_serve_\w+?)(?:_bucket|_count|_sum)?\{", text, re.M))
        missing = wanted - present
        absent = [e for e in expected if not re.search(e, text, re.M)]
        if not missing and not absent:
            break
        assert time.monotonic() < deadline, f"not on {url} after one request: {sorted(missing)}, {absent}"
        time.sleep(2)
    for pattern in expected:
        assert re.search(pattern, text, re.M), pattern


def _wait_for_spans(sink, trace_id: str, names: set[str], timeout_s: float = 30) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        spans = sink.trace(trace_id)
        if names <= {s.name for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.2)


def test_one_trace_per_request_across_ingress_and_model_replica(service, otlp_sink):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    client = service.openai()
    raw = client.chat.completions.with_raw_response.create(
        model=TARGET, messages=_unique_question(), temperature=0, max_tokens=12, stream=True,
        extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01", "x-tenant": "tracing"},
    )
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    assert raw.headers["traceresponse"].split("-")[1] == trace_id, "the client's trace continues here"

    ingress_stages = {"parse", "tokenize", "admit", "lookup", "route", "queue", "generate", "stream", "cache_exact", "embed"}
    engine = {"engine.queue", "engine.prefill", "engine.decode"}
    root_name = "POST /v1/chat/completions"
    spans = _wait_for_spans(otlp_sink, trace_id, ingress_stages | engine | {root_name})
    by_name = {s.name: s for s in spans}
    assert ingress_stages | engine | {root_name} <= set(by_name), sorted(by_name)
    root = by_name[root_name]
    assert root.parent_span_id == client_span and root.service == "Ingress"
    for name in ingress_stages:
        assert by_name[name].parent_span_id == root.span_id and by_name[name].service == "Ingress", name
    generate = by_name["generate"]
    for name in engine:
        span = by_name[name]
        assert span.parent_span_id == generate.span_id, f"{name} must hang under the ingress's model call"
        assert span.service == "TargetModel"
    slack = 5_000_000  # ns: spans are made from two processes' clocks on one machine
    for span in spans:
        assert root.start_ns - slack <= span.start_ns <= span.end_ns <= root.end_ns + slack, span.name
    attrs = root.attributes
    assert attrs["tenant.id"].endswith("/tracing") and attrs["slo.tier"] == "standard"
    assert attrs["route.reason"] == "explicit" and attrs["gen_ai.response.model"] == TARGET
    assert attrs["cache.result"] in ("miss", "hint") and attrs["http.response.status_code"] == 200
    assert attrs["gen_ai.usage.output_tokens"] > 0 and "speculative.accepted_tokens" in attrs
    assert by_name["engine.decode"].attributes["gen_ai.usage.output_tokens"] == attrs["gen_ai.usage.output_tokens"]


def test_a_rejected_request_is_traced_with_its_error(service, otlp_sink):
    trace_id = secrets.token_hex(16)
    resp = service.http.post(
        "/v1/chat/completions",
        json={"model": TARGET, "messages": _unique_question(), "max_tokens": 2},
        headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01", "x-slo-tier": "no-such-tier"},
    )
    assert resp.status_code == 400
    spans = _wait_for_spans(otlp_sink, trace_id, {"POST /v1/chat/completions"})
    root = next(s for s in spans if s.name == "POST /v1/chat/completions")
    assert root.attributes["http.response.status_code"] == 400
    assert root.attributes["error.type"] == "invalid_request"


def test_the_replica_counts_read_off_the_raw_details_agree_with_serve_status(service):
    """The controller's and the ingresses' periodic reads skip `serve.status()`'s pydantic
    rebuild: the raw details they read must say what `serve.status()` says, deployment by
    deployment, or seats and side channels follow a wrong count."""
    from ray import serve

    from deployments.serve_status import _from_details, _from_status

    app = service.config.app_name
    raw, full = _from_details(app), _from_status(app)
    assert set(raw) == set(full) >= {"Ingress", "TargetModel", "DraftModel", "AdmissionController"}
    for name in full:
        assert raw[name] == full[name], name
    assert raw["TargetModel"].healthy and raw["TargetModel"].replicas == {"RUNNING": 1}
    assert serve.status().applications[app].deployments["TargetModel"].replica_states == {"RUNNING": 1}


def test_the_serve_controller_runs_with_the_profiles_loop_interval(service):
    """serve_config.yaml slows Serve's reconcile loop on a small box (controller_options); the
    test graph starts the controller with the same options, so what it measures is what ships."""
    import ray

    want = service.config.controller_options.get("runtime_env", {}).get("env_vars", {})
    if "RAY_SERVE_CONTROL_LOOP_INTERVAL_S" not in want:
        pytest.skip("this profile keeps Serve's own loop interval")
    controller = ray.get_actor("SERVE_CONTROLLER_ACTOR", namespace="serve")
    got = ray.get(controller.__ray_call__.remote(lambda self: __import__("os").environ.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S")))
    assert got == want["RAY_SERVE_CONTROL_LOOP_INTERVAL_S"]
