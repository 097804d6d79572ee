"""Replica faults on the real graph: a replica is killed under live requests.

The test waits for Serve's replacement before it ends, so the shared service is whole again
for the tests after it.
"""

from __future__ import annotations

import json
import threading
import time

import httpx

from bench.local import kill_replica, replicas, wait_replaced
from tests.conftest import assert_greedy_agrees

TARGET = "smollm2-135m-instruct"
# Batch tier (120 s): a long stream and a request beside it are queued or run, not shed.
NO_CACHE = {"Cache-Control": "no-cache, no-store", "x-slo-tier": "batch"}


def test_target_killed_mid_request_retries_the_unsent_and_errors_the_streamed(service):
    app = service.config.app_name
    story = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    body = {"model": TARGET, "messages": story, "max_tokens": 120, "temperature": 0}
    reference = service.http.post("/v1/chat/completions", json=body, headers=NO_CACHE)
    assert reference.status_code == 200
    expected = reference.json()["choices"][0]["message"]["content"]

    # A stream that already sent tokens, and a non-streamed request the client has seen nothing of.
    client = httpx.Client(base_url=service.base_url, timeout=180)
    events: list[dict] = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True, "max_tokens": 400}, headers=NO_CACHE) as stream:
        lines = stream.iter_lines()
        events.append(json.loads(next(line for line in lines if line.startswith("data: "))[6:]))
        result: dict = {}
        waiter = threading.Thread(
            target=lambda: result.update(resp=httpx.post(service.base_url + "/v1/chat/completions", json=body, headers=NO_CACHE, timeout=180))
        )
        waiter.start()
        time.sleep(1.0)  # both are generating now
        victim = replicas(app, "TargetModel")[0]
        kill_replica(victim)
        done = False
        for line in lines:
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    client.close()
    # The stream had started: no retry (the client would see text twice); an OpenAI error event and [DONE].
    assert done, "the stream must end with [DONE], not a dropped connection"
    errors = [e["error"] for e in events if "error" in e]
    assert errors and errors[0]["code"] == "backend_error", events[-3:]

    # The non-streamed request had sent nothing: it is retried once on the replacement, losslessly.
    waiter.join(timeout=240)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    assert resp.headers.get("x-retried") == "1"
    assert_greedy_agrees(resp.json()["choices"][0]["message"]["content"], expected)
    assert wait_replaced(app, "TargetModel", victim)
    assert service.http.post("/v1/chat/completions", json=body, headers=NO_CACHE).status_code == 200


def test_cache_replica_killed_degrades_to_misses(service):
    app = service.config.app_name
    failures = service.http.get("/health").json()["cache"]["lookup_failures"]
    victim = replicas(app, "SemanticCache")[0]
    # At once: the victim's process is gone, and its replacement is still loading its embedder,
    # so this lookup meets the dead replica (a lookup that waited could meet the replacement).
    kill_replica(victim)
    question = [{"role": "user", "content": "What colour is a ripe banana, in one word?"}]
    start = time.monotonic()
    resp = service.http.post(
        "/v1/chat/completions", json={"model": TARGET, "messages": question, "max_tokens": 4, "temperature": 0}
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-cache"] == "miss"
    assert time.monotonic() - start < 30, "a dead cache costs at most the stage timeout, not the request"
    assert service.http.get("/health").json()["cache"]["lookup_failures"] > failures, "the lookup did fail"
    assert wait_replaced(app, "SemanticCache", victim)
