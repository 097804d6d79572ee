"""Suite `load`: goodput under open-loop Poisson load, admission on vs off, in one run.

One service (serve_config.yaml, with `admission.allow_mode_header` so each request can pick the
mode), streamed requests over loopback, a realistic mix: chat, RAG and code prompts (20-400
tokens), max_tokens 16-128, 80% interactive (deadline 15 s, TTFT SLO 1 s, TPOT 200 ms) and 20%
batch (deadline 30 s). Every request carries `x-request-deadline-ms`.

1. capacity: closed loops of 2, 4, 8, ... clients with admission off, doubling until goodput
   stops growing (looked for from 8 clients on) or the clients pass the models' seats; the
   best goodput is the capacity (requests/s finishing within their deadline, in the window).
2. warm-up: a short predictive run, so admission has measured the models.
3. for load 0.5x, 1x, 2x, 4x capacity: Poisson arrivals for `duration_s`, admission on
   (predictive) and off (fifo: the deadline is not used, as in plain Ray Serve / vLLM).
   A point's numbers count the requests sent after its first `WARM_IN_S` (one interactive
   deadline): an empty queue's first seconds are a transient that any scheduler serves well,
   and with 40 s points and no warm-in FIFO got 1.1-1.2 rps "within deadline" out of a box
   whose capacity probe read 0.8. `lost` counts every request sent.

False sheds: both modes replay the same arrival trace (same seed, same prompts, same times), so
each request shed with admission on has a FIFO twin. A shed whose twin met its deadlines
(`in_slo`: within the deadline, and an interactive one's first token within 1 s and a token
every 200 ms after it, the tier's targets) is counted as false, at a load where FIFO met at
least `FALSE_SHED_FIFO_FLOOR` of its requests' deadlines; past that, FIFO's fate of one request
depends on everything before it and the estimate means little.

A request is one of: ok (200, streamed to [DONE]), shed (429/503 before any token, the time to
that answer recorded), error (an explicit error: a JSON error or an SSE error event), abandoned
(admission off only: the client gave up 5 s past its deadline) or lost (admission on: no answer
and no explicit error; must be 0).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.stack import CONTEXT, QUESTIONS
from bench.stats import percentile
from telemetry.clock import server_timing, server_timing_count
from bench.workloads import CODE, DOCS, RAG_QUESTIONS
from engines.types import ENGINE_QUEUE_COUNTS

INTERACTIVE_DEADLINE_MS = 15_000
BATCH_DEADLINE_MS = 30_000
TTFT_SLO_MS = 1_000
TPOT_SLO_MS = 200  # the interactive tier's per-token target (tpot_ms), as in `bench peers`
CLIENT_GRACE_S = 5.0
MAX_TOKENS = [(16, 0.3), (32, 0.3), (64, 0.3), (128, 0.1)]
WARM_IN_S = INTERACTIVE_DEADLINE_MS / 1000
LOAD_FACTORS = [0.5, 1.0, 2.0, 4.0]
FALSE_SHED_FIFO_FLOOR = 0.95
PROBE_FIRST_CLIENTS = 2
PROBE_MIN_CLIENTS = 8  # the knee is looked for from here on
PROBE_MIN_GAIN = 1.05  # a doubling of clients that adds less goodput than this has passed the knee
# 503s that waited in the admission queue first: past the latest useful start, or the tier's wait limit
QUEUE_DROPS = {"deadline_in_queue", "queue_timeout"}


@dataclass
class Outcome:
    kind: str  # ok | shed | error | abandoned | lost
    tier: str
    deadline_ms: float
    status: int = 0
    ttft_ms: float | None = None
    e2e_ms: float = 0.0
    code: str | None = None
    route: str | None = None
    predicted_ttft_ms: float | None = None  # x-admission-predicted, when admission admitted it
    predicted_e2e_ms: float | None = None  # ... and its predicted last token
    prompt: str = ""  # chat | rag | code
    shed_predicted: dict | None = None  # a 503's body: the prediction it was shed on
    shed_not_started: str | None = None  # ... and why it could not start at once
    sent_at_s: float = 0.0  # since the point started
    server_timing: str = ""  # where the server spent the time: to shed, or to the first token
    tokens: int = 0  # completion tokens (the stream's usage)

    @property
    def good(self) -> bool:
        return self.kind == "ok" and self.e2e_ms <= self.deadline_ms

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft_ms is None or self.tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.tokens - 1)

    @property
    def in_slo(self) -> bool:
        """Within its deadline and, for an interactive request, its tier's targets: the first
        token within 1 s and a token every 200 ms after it."""
        if self.tier != "interactive":
            return self.good
        tpot = self.tpot_ms
        return (self.good and self.ttft_ms is not None and self.ttft_ms <= TTFT_SLO_MS
                and (tpot is None or tpot <= TPOT_SLO_MS))


def _request(rng: random.Random, n: int) -> tuple[dict, dict, str, float, str]:
    """(body, headers, tier, deadline_ms, prompt kind): a fresh prompt each time (no cache hits)."""
    kind = rng.random()
    prompt = "chat" if kind < 0.5 else "rag" if kind < 0.8 else "code"
    tag = f" (request {n})"
    if kind < 0.5:
        q = rng.choice(QUESTIONS) + tag
        messages = [{"role": "system", "content": CONTEXT}, {"role": "user", "content": q}] if rng.random() < 0.5 else [
            {"role": "user", "content": q}
        ]
    elif kind < 0.8:
        i = rng.randrange(len(DOCS))
        messages = [
            {"role": "system", "content": "Answer only from the context."},
            {"role": "user", "content": f"Context:\n{DOCS[i]}\n\nQuestion: {RAG_QUESTIONS[i]}{tag}"},
        ]
    else:
        task, src = rng.choice(CODE)
        messages = [{"role": "user", "content": f"{task}{tag}\n\n```python\n{src}```"}]
    max_tokens = rng.choices([m for m, _ in MAX_TOKENS], [w for _, w in MAX_TOKENS])[0]
    body = {"model": "auto", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    batch = rng.random() < 0.2
    tier, deadline = ("batch", BATCH_DEADLINE_MS) if batch else ("interactive", INTERACTIVE_DEADLINE_MS)
    headers = {"Cache-Control": "no-cache, no-store", "x-request-deadline-ms": str(deadline), "x-slo-tier": tier}
    return body, headers, tier, deadline, prompt


async def _one(http: httpx.AsyncClient, body: dict, headers: dict, tier: str, deadline_ms: float, mode: str,
               sent_at_s: float = 0.0, prompt: str = "") -> Outcome:
    out = Outcome("lost", tier, deadline_ms, sent_at_s=sent_at_s, prompt=prompt)
    start = time.perf_counter()

    async def send() -> None:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={**headers, "x-admission-mode": mode}) as resp:
            out.status = resp.status_code
            out.route = resp.headers.get("x-route")
            predicted = _predicted(resp.headers.get("x-admission-predicted"))
            out.predicted_ttft_ms, out.predicted_e2e_ms = predicted.get("ttft_ms"), predicted.get("e2e_ms")
            out.server_timing = resp.headers.get("server-timing", "")  # a stream's: up to its first token
            if resp.status_code != 200:
                raw = await resp.aread()
                out.e2e_ms = (time.perf_counter() - start) * 1000
                try:
                    error = json.loads(raw)["error"]
                    out.code, out.shed_predicted = error["code"], error.get("predicted")
                    out.shed_not_started = error.get("not_started")
                    out.route = error.get("model")
                except Exception:
                    out.code = "non_json"
                out.kind = "shed" if resp.status_code in (429, 503) and out.code != "backend_error" else "error"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.e2e_ms = (time.perf_counter() - start) * 1000
                    if out.kind == "lost":
                        out.kind = "ok"
                    return
                event = json.loads(data)
                if event.get("usage"):
                    out.tokens = event["usage"].get("completion_tokens") or 0
                if "error" in event:
                    out.kind, out.code = "error", event["error"].get("code")
                elif out.ttft_ms is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    out.ttft_ms = (time.perf_counter() - start) * 1000

    try:
        await asyncio.wait_for(send(), deadline_ms / 1000 + CLIENT_GRACE_S)
    except asyncio.TimeoutError:
        out.kind = "abandoned" if mode == "fifo" else "lost"
    except httpx.HTTPError as exc:
        out.kind, out.code = "lost", type(exc).__name__
    if not out.e2e_ms:
        out.e2e_ms = (time.perf_counter() - start) * 1000
    return out


async def _open_loop(base: str, rate: float, duration_s: float, mode: str, seed: int, cap: int) -> list[Outcome]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as http:
        tasks = []
        t0 = time.perf_counter()
        at = 0.0
        n = 0
        while n < cap:
            at += rng.expovariate(rate)
            if at > duration_s:
                break
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body, headers, tier, deadline, prompt = _request(rng, seed * 100_000 + n)
            tasks.append(asyncio.create_task(_one(http, body, headers, tier, deadline, mode, sent_at_s=at, prompt=prompt)))
            n += 1
        return list(await asyncio.gather(*tasks))


async def _closed_loop(base: str, clients: int, duration_s: float, mode: str, seed: int) -> list[Outcome]:
    """`clients` back-to-back senders for `duration_s`; the requests still in flight then are
    cancelled (the client disconnects) and not counted. Waiting for them instead stretched the
    window by their whole tail at falling concurrency, and read the capacity low: 0.79 rps,
    where FIFO then served 1.2 rps inside the deadlines at the "2x" point."""
    rng = random.Random(seed)
    counter = [0]
    outcomes: list[Outcome] = []
    end = time.perf_counter() + duration_s
    async with httpx.AsyncClient(base_url=base, timeout=None) as http:

        async def worker() -> None:
            # Bounded by the clock as well as by cancel: on Python 3.11, `wait_for` can swallow a
            # cancel that lands as the request completes, and a worker looping on would keep
            # the probe waiting on it for ever.
            while time.perf_counter() < end:
                counter[0] += 1
                body, headers, tier, deadline, prompt = _request(rng, seed * 100_000 + counter[0])
                outcomes.append(await _one(http, body, headers, tier, deadline, mode, prompt=prompt))

        workers = [asyncio.create_task(worker()) for _ in range(clients)]
        await asyncio.sleep(duration_s)
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return outcomes


def _predicted(header: str | None) -> dict[str, float]:
    """`ttft_ms=T; e2e_ms=E` -> {"ttft_ms": T, "e2e_ms": E}."""
    out = {}
    for part in (header or "").split(";"):
        key, _, value = part.strip().partition("=")
        if key in ("ttft_ms", "e2e_ms") and value:
            out[key] = float(value)
    return out


def _decode_ratio(o: Outcome) -> float | None:
    """Measured / predicted time from the first token to the last (> 1: admission was optimistic)."""
    if o.ttft_ms is None or not o.predicted_e2e_ms or not o.predicted_ttft_ms:
        return None
    predicted = o.predicted_e2e_ms - o.predicted_ttft_ms
    return (o.e2e_ms - o.ttft_ms) / predicted if predicted > 0 else None


def _calibration(admitted: list[Outcome]) -> dict:
    """Measured TTFT / predicted TTFT of the admitted interactive requests (> 1: admission was
    optimistic), and the prediction of every one that missed its TTFT SLO."""
    judged = [o for o in admitted if o.tier == "interactive" and o.ttft_ms is not None and o.predicted_ttft_ms]
    ratios = [o.ttft_ms / o.predicted_ttft_ms for o in judged]
    by_model: dict[str, list[Outcome]] = {}
    for o in judged:
        by_model.setdefault((o.route or "?").split(";")[0], []).append(o)
    decode = [r for r in map(_decode_ratio, admitted) if r is not None]
    return {
        "ttft_measured_over_predicted_p50": round(percentile(ratios, 0.5), 2) if ratios else None,
        "ttft_measured_over_predicted_p95": round(percentile(ratios, 0.95), 2) if ratios else None,
        # The decode after the first token (its length a guess): measured / predicted.
        "decode_measured_over_predicted_p50": round(percentile(decode, 0.5), 2) if decode else None,
        "decode_measured_over_predicted_p90": round(percentile(decode, 0.9), 2) if decode else None,
        # Which model's predictions are off, and by how much of the wait in its replica's queue.
        "ttft_by_model": {
            model: {
                "requests": len(os),
                "measured_over_predicted_p50": round(percentile([o.ttft_ms / o.predicted_ttft_ms for o in os], 0.5), 2),
                "measured_ms_p50": round(percentile([o.ttft_ms for o in os], 0.5)),
                "predicted_ms_p50": round(percentile([o.predicted_ttft_ms for o in os], 0.5)),
                "decode_measured_over_predicted_p50": _p([r for r in map(_decode_ratio, os) if r is not None], 0.5, 2),
                "engine_queue_ms_p50": round(percentile(
                    [server_timing(o.server_timing).get("engine_queue", 0.0) for o in os], 0.5), 1),
                "prefill_ms_p50": round(percentile(
                    [server_timing(o.server_timing).get("prefill", 0.0) for o in os], 0.5), 1),
            }
            for model, os in sorted(by_model.items())
        },
        "ttft_slo_misses": [
            {"measured_ms": round(o.ttft_ms), "predicted_ms": round(o.predicted_ttft_ms), "route": o.route,
             "server": server_timing(o.server_timing),
             "jobs_ahead": {key.removeprefix("engine_queue_"): server_timing_count(o.server_timing, key)
                            for key in ENGINE_QUEUE_COUNTS}}
            for o in judged if o.ttft_ms > TTFT_SLO_MS
        ],
    }


def _point(sent: list[Outcome], duration_s: float, warm_in_s: float, load_factor: float, admission: bool,
           rate: float) -> dict:
    outcomes = [o for o in sent if o.sent_at_s >= warm_in_s]
    window_s = duration_s - warm_in_s
    admitted = [o for o in outcomes if o.kind != "shed"]
    completed = [o for o in outcomes if o.kind == "ok"]
    shed = [o for o in outcomes if o.kind == "shed"]
    interactive_ttft = [o.ttft_ms for o in admitted if o.tier == "interactive" and o.ttft_ms is not None]
    good = sum(o.good for o in outcomes)
    routes: dict[str, int] = {}
    for o in completed:
        key = (o.route or "?").split(";reason=")[-1].split(";")[0]
        routes[key] = routes.get(key, 0) + 1
    return {
        "load_factor": load_factor,
        "admission": admission,
        "offered_rps": round(rate, 3),
        "sent": len(sent),
        "measured": len(outcomes),
        "goodput_rps": round(good / window_s, 3),
        # The same, counting an interactive request only within its first-token and per-token targets.
        "goodput_in_slo_rps": round(sum(o.in_slo for o in outcomes) / window_s, 3),
        "goodput_rps_whole_point": round(sum(o.good for o in sent) / duration_s, 3),  # warm-in included
        "slo_attainment": round(sum(o.in_slo for o in admitted) / len(admitted), 3) if admitted else None,
        "ttft_p50_ms": _p(interactive_ttft, 0.5),
        "ttft_p95_ms": _p(interactive_ttft, 0.95),
        "ttft_p99_ms": _p(interactive_ttft, 0.99),
        "tpot_p50_ms": _p([o.tpot_ms for o in completed if o.tpot_ms is not None], 0.5),
        "tpot_p95_ms": _p([o.tpot_ms for o in completed if o.tpot_ms is not None], 0.95),
        "e2e_p50_ms": _p([o.e2e_ms for o in completed], 0.5),
        "e2e_p95_ms": _p([o.e2e_ms for o in completed], 0.95),
        "e2e_p99_ms": _p([o.e2e_ms for o in completed], 0.99),
        "shed_rate": round(len(shed) / len(outcomes), 3) if outcomes else 0.0,
        "shed_p99_ms": _p([o.e2e_ms for o in shed], 0.99),  # every 429/503, queue drops included
        "shed_at_arrival_p99_ms": _p([o.e2e_ms for o in shed if o.code not in QUEUE_DROPS], 0.99),
        "dropped_in_queue": sum(o.code in QUEUE_DROPS for o in shed),
        "shed_codes": _count(o.code for o in shed),
        "shed_not_started": _count(o.shed_not_started or "-" for o in shed),
        "dropped_held_by": _count(o.shed_not_started or "-" for o in shed if o.code in QUEUE_DROPS),
        # Which prompts were turned away, against all sent, and what the gate predicted for them:
        # a lead when admission sheds what FIFO would have served in time.
        "sent_by_prompt": _count(o.prompt for o in outcomes),
        "shed_by_prompt": _count(o.prompt for o in shed),
        "shed_by_tier": _count(o.tier for o in shed),
        "shed_predicted_ttft_ms_p50": _p([o.shed_predicted["ttft_ms"] for o in shed
                                          if o.shed_predicted and o.shed_predicted.get("ttft_ms") is not None], 0.5),
        **_shed_profile(shed),
        "errors": _count(o.code for o in outcomes if o.kind == "error"),
        "abandoned": sum(o.kind == "abandoned" for o in outcomes),
        "lost": sum(o.kind == "lost" for o in sent),
        "routes": routes,
        **(_calibration(admitted) if admission else {}),
    }


def _false_sheds(on: list[Outcome], off: list[Outcome], warm_in_s: float) -> dict:
    """Sheds with admission on whose FIFO twin (same index in the same trace) met its deadlines."""
    pairs = [(a, b) for a, b in zip(on, off) if a.sent_at_s >= warm_in_s]
    fifo_met = sum(b.in_slo for _, b in pairs) / len(pairs) if pairs else 0.0
    false = [a for a, b in pairs if a.kind == "shed" and b.in_slo]
    return {
        "fifo_deadlines_met": round(fifo_met, 3),
        "false_shed_counted": fifo_met >= FALSE_SHED_FIFO_FLOOR,
        "false_sheds": len(false),
        "false_shed_rate": round(len(false) / len(pairs), 4) if pairs else 0.0,
        "false_shed_codes": _count(a.code for a in false),
        "false_shed_not_started": _count(a.shed_not_started or "-" for a in false),
        # what each was shed on, beside what its FIFO twin measured: where the estimate erred
        "false_shed_detail": [
            {"prompt": a.prompt, "tier": a.tier, "code": a.code, "predicted": a.shed_predicted,
             "not_started": a.shed_not_started, "model": a.route, "fifo_ttft_ms": None if b.ttft_ms is None else round(b.ttft_ms), "fifo_e2e_ms": round(b.e2e_ms),
             "fifo_tpot_ms": None if b.tpot_ms is None else round(b.tpot_ms),
             "sent_at_s": round(a.sent_at_s, 1)}
            for a, b in pairs if a.kind == "shed" and b.in_slo
        ],
    }


def _shed_profile(shed: list[Outcome]) -> dict:
    """Where the slowest sheds at arrival spent their time: the server's own total against
    the client's, and how many were decided only after the cache lookup and routing."""
    at_arrival = [o for o in shed if o.code not in QUEUE_DROPS]
    timings = [server_timing(o.server_timing) for o in at_arrival]
    totals = [t["total"] for t in timings if "total" in t]
    slowest = sorted(zip(at_arrival, timings), key=lambda x: -x[0].e2e_ms)[:3]
    return {
        "shed_at_arrival_server_p99_ms": _p(totals, 0.99),
        "shed_after_routing": sum(1 for t in timings if "route" in t or "lookup" in t),
        "shed_slowest": [{"client_ms": round(o.e2e_ms, 1), "code": o.code, "server": t} for o, t in slowest],
    }


def _p(values: list[float], q: float, digits: int = 1) -> float | None:
    return round(percentile(values, q), digits) if values else None


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[str(item)] = out.get(str(item), 0) + 1
    return out


def _plot(points: list[dict], capacity: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for admission, style in ((True, "o-"), (False, "s--")):
        pts = sorted((p for p in points if p["admission"] == admission), key=lambda p: p["load_factor"])
        label = "admission on (predictive)" if admission else "admission off (FIFO)"
        ax1.plot([p["offered_rps"] for p in pts], [p["goodput_rps"] for p in pts], style, label=label)
        ax2.plot([p["offered_rps"] for p in pts], [p["ttft_p99_ms"] or float("nan") for p in pts], style, label=label)
    ax1.axhline(capacity, color="grey", lw=0.8, ls=":", label="measured capacity")
    ax1.set(xlabel="offered load (req/s)", ylabel="goodput (req/s within deadline)", title="Goodput")
    ax2.axhline(TTFT_SLO_MS, color="red", lw=0.8, ls=":", label="interactive TTFT SLO")
    ax2.set(xlabel="offered load (req/s)", ylabel="p99 TTFT, interactive (ms)", title="Tail TTFT", yscale="log")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _capacity_probe(base: str, window: float) -> list[dict]:
    """Closed loops of doubling client counts, admission off, until goodput stops growing (the
    knee) or the clients outnumber the sequences both models can run at once. A probe that
    stops below the knee reads the capacity low, and every load point above it is lighter
    than its name: FIFO then meets its deadlines at "2x"."""
    from tqdm import tqdm

    health = httpx.get(base + "/health", timeout=10).json().get("admission", {})
    seats = sum((health.get("seats") or {}).values()) or 16
    runs: list[dict] = []
    clients = PROBE_FIRST_CLIENTS
    with tqdm(desc="capacity (closed loop, admission off)", unit="run") as bar:
        while True:
            outcomes = asyncio.run(_closed_loop(base, clients, window, "fifo", seed=clients))
            runs.append({"clients": clients, "goodput_rps": round(sum(o.good for o in outcomes) / window, 3),
                         "completed": sum(o.kind == "ok" for o in outcomes)})
            bar.update()
            if _probe_done(runs, seats):
                return runs
            clients *= 2


def _probe_done(runs: list[dict], seats: int) -> bool:
    """Past the knee (from `PROBE_MIN_CLIENTS` on, the last doubling added under
    `PROBE_MIN_GAIN` over the best before it), or as many clients as the models have seats.
    The first levels run on a freshly started graph, whose noise alone can read as a knee."""
    clients = runs[-1]["clients"]
    best_before = max((r["goodput_rps"] for r in runs[:-1]), default=0.0)
    past_knee = clients >= PROBE_MIN_CLIENTS and len(runs) > 1 and runs[-1]["goodput_rps"] < best_before * PROBE_MIN_GAIN
    return past_knee or clients >= seats


def run(quick: bool = False, out: str | None = None, requests: int | None = None, **_: object) -> dict:
    from tqdm import tqdm

    from bench.local import running_service

    duration, warm_in = (30.0, 10.0) if quick else (60.0, WARM_IN_S)
    cap = requests or 2000

    def tweak(args) -> None:
        args.admission.allow_mode_header = True

    with running_service(tweak=tweak) as base:
        capacity_runs = _capacity_probe(base, window=duration * 0.5)
        capacity = max(r["goodput_rps"] for r in capacity_runs)
        time.sleep(3)  # the cancelled requests' aborts settle before admission starts measuring
        asyncio.run(_closed_loop(base, 4, duration * 0.3, "predictive", seed=99))  # admission measures the models

        points = []
        bar = tqdm(total=2 * len(LOAD_FACTORS), desc="load points", unit="point")
        for i, factor in enumerate(LOAD_FACTORS):
            rate = factor * capacity
            trace: dict[str, list[Outcome]] = {}
            for mode in ("predictive", "fifo"):
                trace[mode] = asyncio.run(_open_loop(base, rate, duration, mode, seed=1000 + i, cap=cap))
                points.append(_point(trace[mode], duration, warm_in, factor, mode == "predictive", rate))
                bar.set_postfix(load=factor, mode=mode, goodput=points[-1]["goodput_rps"])
                bar.update()
            points[-2].update(_false_sheds(trace["predictive"], trace["fifo"], warm_in))
        bar.close()
        health = httpx.get(base + "/health", timeout=10).json()["admission"]

    result = {
        "capacity_rps": capacity,
        "capacity_runs": capacity_runs,
        "duration_s_per_point": duration,
        "warm_in_s_per_point": warm_in,
        "points": points,
        "admission_view": {"max_view_age_ms": health.get("max_view_age_ms"), "ttft_bias": health.get("ttft_bias"),
                           "ttft_tail_ms": health.get("ttft_tail_ms"),
                           "estimates": health.get("estimates")},
    }
    at2 = {p["admission"]: p for p in points if p["load_factor"] == 2.0}
    if at2.get(True) and at2.get(False):
        on, off = at2[True]["goodput_rps"], at2[False]["goodput_rps"]
        result["at_2x"] = {
            "goodput_vs_capacity": round(on / capacity, 3) if capacity else None,
            "goodput_on_vs_off": round(on / off, 2) if off else None,
        }
    result["summary"] = [
        {key: p.get(key) for key in ("load_factor", "shed_rate", "false_shed_rate", "false_shed_counted",
                                     "fifo_deadlines_met", "slo_attainment", "ttft_measured_over_predicted_p50",
                                     "ttft_p99_ms", "shed_p99_ms", "goodput_rps", "lost")}
        for p in points if p["admission"]
    ]
    if out:
        png = Path(out).with_suffix(".png")
        _plot(points, capacity, png)
        result["plot"] = str(png)
    return result
