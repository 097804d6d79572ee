"""Suite `chaos`: load on loopback while one replica of each stage is killed in turn.

Every request the load sends ends in exactly one bucket:
- succeeded: a complete answer (JSON with choices, or a stream that ends in finish_reason + [DONE]);
- failed_cleanly: an OpenAI-style error: an HTTP error status with the JSON error body, or a
  stream that ends with an SSE error event and [DONE];
- failed_abruptly: the client is told it failed, but not in OpenAI shape: Serve's proxy
  answers a bare-text 5xx, or the connection breaks mid-stream. This is what happens to the
  requests an Ingress replica holds when that process dies: nothing inside it can answer them;
- lost: no outcome the client could trust: a hang past the client timeout, a stream that
  closes without finish_reason or error, a 200 without choices, a 4xx without an error body.
  The bar is 0.

Four closed-loop clients; each honors a 429/503's Retry-After (up to 5 s) before its next
request, as the openai SDK does, and waits 0.5 s after a broken or refused connection (the
SDK's first retry backoff) instead of hammering a port nothing listens on.

A fault is `ray.kill` on one replica actor (what a crashed process or a lost node looks like to
Serve). The suite waits until Serve has a healthy replacement, then settles before the next.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import httpx

from bench.local import kill_replica, replicas, running_service, wait_replaced
from bench.stats import summary
from configs.serve_config import load_serve_config

CONNECTION_BACKOFF_S = 0.5

STAGES = ["SemanticCache", "AdmissionController", "Router", "DraftModel", "TargetModel", "Ingress"]
QUESTIONS = [
    "What is the capital of France?",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "Implement a function that checks whether a string is a palindrome.",
    "Give me three tips for staying focused while studying.",
]
CLIENT_TIMEOUT_S = 90.0
# Clients honor a shed's Retry-After, up to this. Clients that retry at once instead can hold a
# 2-core box in overload: the 503s themselves then cost the CPU the (nice 19) models need.
MAX_BACKOFF_S = 5.0
KINDS = ("succeeded", "failed_cleanly", "failed_abruptly", "lost")


@dataclass
class Outcome:
    start: float
    end: float
    kind: str  # one of KINDS
    detail: str  # e.g. "200", "503:backend_error", "sse_error:backend_error", "lost:RemoteProtocolError"


@dataclass
class Fault:
    stage: str
    replica: str
    killed_at_s: float
    recovered_at_s: float | None = None
    outcomes: dict[str, int] = field(default_factory=dict)
    admission_after: dict | None = None  # an ingress's gate once settled: leaked slots would show here


async def _one(client: httpx.AsyncClient, body: dict, headers: dict) -> tuple[str, str, float]:
    """Send one request: how it ended, and how long to wait before the next (a shed's Retry-After)."""
    try:
        if not body.get("stream"):
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            if resp.status_code == 200:
                data = resp.json()
                return ("succeeded", "200", 0.0) if data.get("choices") else ("lost", "200:no_choices", 0.0)
            return (*_classify_error(resp.status_code, resp.text), _retry_after(resp))
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return (*_classify_error(resp.status_code, text), _retry_after(resp))
            finished = error = None
            done = False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    error = (event["error"] or {}).get("code") or "error"
                for choice in event.get("choices") or []:
                    finished = choice.get("finish_reason") or finished
            if done and error:
                return "failed_cleanly", f"sse_error:{error}", 0.0
            if done and finished:
                return "succeeded", "200:stream", 0.0
            return "lost", "stream_closed_without_finish", 0.0
    except httpx.TimeoutException as exc:  # a hang: the worst outcome
        return "lost", f"client_timeout:{type(exc).__name__}", 0.0
    except (httpx.TransportError, httpx.StreamError) as exc:  # the connection broke: the client knows
        return "failed_abruptly", f"connection:{type(exc).__name__}", CONNECTION_BACKOFF_S
    except json.JSONDecodeError:
        return "lost", "unparseable_body", 0.0


def _retry_after(resp: httpx.Response) -> float:
    """What a well-behaved client waits before its next request (the openai SDK honors it too)."""
    if resp.status_code not in (429, 503):
        return 0.0
    try:
        return min(MAX_BACKOFF_S, float(resp.headers.get("retry-after", 0)))
    except ValueError:
        return 0.0


def _classify_error(status: int, text: str) -> tuple[str, str]:
    try:
        error = json.loads(text)["error"]
        if error.get("message"):
            return "failed_cleanly", f"{status}:{error.get('code')}"
    except (ValueError, KeyError, TypeError, AttributeError):
        pass
    if status >= 500:
        return "failed_abruptly", f"{status}:bare_text"
    return "lost", f"{status}:no_error_body"


async def _load(base: str, models: list[str], workers: int, max_tokens: int, stop: threading.Event, t0: float,
                out: list[Outcome]) -> None:
    async def worker(w: int) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=CLIENT_TIMEOUT_S) as client:
            i = 0
            while not stop.is_set():
                cacheable = i % 4 == 3  # a few repeats keep the cache on the path
                body = {
                    "model": models[(w + i) % len(models)],
                    "messages": [{"role": "user", "content": QUESTIONS[(w * 7 + i) % len(QUESTIONS)]}],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "stream": (w + i) % 2 == 0,
                }
                headers = {} if cacheable else {"Cache-Control": "no-cache, no-store"}
                start = time.monotonic() - t0
                kind, detail, backoff = await _one(client, body, headers)
                out.append(Outcome(start, time.monotonic() - t0, kind, detail))
                i += 1
                if backoff:
                    await asyncio.sleep(backoff)

    await asyncio.gather(*(worker(w) for w in range(workers)))


def _admission_state(base: str) -> dict | None:
    """What one ingress's admission gate holds: running and queued requests, rejections so far."""
    try:
        gate = httpx.get(base + "/health", timeout=10).json()["admission"]
    except Exception as exc:
        return {"error": type(exc).__name__}
    state = {k: gate.get(k) for k in ("inflight", "queued", "running_by_model", "others_inflight", "rejected")}
    state["itl_ms_by_concurrency"] = {m: e["itl_ms_by_concurrency"] for m, e in (gate.get("estimates") or {}).items()}
    return state


def run(requests: int | None = None, max_tokens: int = 24, quick: bool = False) -> dict:
    from tqdm import tqdm

    serve_file = load_serve_config()
    app = serve_file.app_name
    models = [serve_file.args.target.engine.model_id, "auto", serve_file.args.draft.engine.model_id]
    workers = 4
    settle_s = 3.0 if quick else 6.0
    outcomes: list[Outcome] = []
    faults: list[Fault] = []
    with running_service(serve_file) as base:
        stop = threading.Event()
        t0 = time.monotonic()
        loader = threading.Thread(target=lambda: asyncio.run(_load(base, models, workers, max_tokens, stop, t0, outcomes)))
        loader.start()
        try:
            time.sleep(settle_s)  # steady state before the first fault
            for stage in tqdm(STAGES, desc="faults", unit="stage"):
                victims = replicas(app, stage)
                if not victims:
                    continue
                kill_replica(victims[0])
                fault = Fault(stage, victims[0].rsplit("#", 1)[-1], round(time.monotonic() - t0, 2))
                faults.append(fault)
                if wait_replaced(app, stage, victims[0]):
                    fault.recovered_at_s = round(time.monotonic() - t0, 2)
                time.sleep(settle_s)
                fault.admission_after = _admission_state(base)
        finally:
            stop.set()
            loader.join(timeout=CLIENT_TIMEOUT_S + 30)
        end_s = time.monotonic() - t0

    counts = {k: sum(o.kind == k for o in outcomes) for k in KINDS}
    details: dict[str, int] = {}
    for o in outcomes:
        details[f"{o.kind}/{o.detail}"] = details.get(f"{o.kind}/{o.detail}", 0) + 1
    # Each outcome belongs to the fault during whose period it ended (a kill until the next kill);
    # "during the fault" is any request in flight between a kill and 1 s after its recovery.
    during: dict[int, float] = {}
    for i, fault in enumerate(faults):
        until = faults[i + 1].killed_at_s if i + 1 < len(faults) else end_s + 1
        ended = [o for o in outcomes if fault.killed_at_s <= o.end < until]
        fault.outcomes = {k: sum(o.kind == k for o in ended) for k in KINDS}
        window_end = (fault.recovered_at_s or end_s) + 1.0
        for j, o in enumerate(outcomes):
            if o.start <= window_end and o.end >= fault.killed_at_s:
                during[j] = (o.end - o.start) * 1000
    ok_latency = [(o.end - o.start) * 1000 for o in outcomes if o.kind == "succeeded"]
    return {
        "sent": len(outcomes),
        **counts,
        "p99_ms_during_fault": summary(list(during.values()))["p99"],
        "p99_ms_overall_succeeded": summary(ok_latency)["p99"],
        "faults": [
            {
                "stage": f.stage,
                "replica": f.replica,
                "killed_at_s": f.killed_at_s,
                "recovered_at_s": f.recovered_at_s,
                "recovery_s": round(f.recovered_at_s - f.killed_at_s, 2) if f.recovered_at_s else None,
                "requests_ended_after_this_kill": f.outcomes,
                "admission_after": f.admission_after,
            }
            for f in faults
        ],
        "outcomes_by_detail": dict(sorted(details.items())),
        "not_succeeded": [
            {"start_s": round(o.start, 2), "end_s": round(o.end, 2), "kind": o.kind, "detail": o.detail}
            for o in outcomes
            if o.kind != "succeeded"
        ],
        "config": {"workers": workers, "max_tokens": max_tokens, "settle_s": settle_s, "duration_s": round(end_s, 1)},
    }
