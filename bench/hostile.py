"""Suite `hostile`: one attacker beside one ordinary tenant, for each attack class.

For each class the attacker sends its requests for a fixed window (bounded in count and time,
loopback only) while a bystander tenant sends small streamed chats one after another and a
prober asks `/health` every 20 ms. Reported per class: `/health` p50/p99/max, the bystander's
TTFT p50 against its TTFT on the idle service just before (and where each waited: Server-Timing
stages), every status code each side got, and what the
attacker paid: the usage its answers reported and the 429s its tenant's buckets gave it.

Classes: deep schema (a fresh title each time), huge regex, many tools, big tool text,
near-duplicate flood (long near-copies of one cached question), embeddings bulk, n-flood (n: 16,
max_tokens 512, ignore_eos, a 24-hour deadline), batch poison (a grammar that allows one short
answer with min_tokens and sampling). The goals (issue text): /health p99 <= 100 ms, no 5xx,
the bystander answered with TTFT <= 2x idle.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx

from configs.serve_config import load_serve_config
from bench.local import running_service

WINDOW_S = 12.0
ATTACKERS = 1  # one attacking client, requests back to back (the n-flood: N_FLOOD_ATTACKERS at once)
N_FLOOD_ATTACKERS = 6
ATTACK_TIMEOUT_S = WINDOW_S + 5  # an attack request still running then is dropped (its client leaves)
MAX_ATTACK_REQUESTS = 200  # per class, in all
BYSTANDER = {"authorization": "Bearer sk-bench-bystander", "content-type": "application/json",
             "cache-control": "no-cache"}
ATTACKER = {"authorization": "Bearer sk-bench-attacker", "content-type": "application/json"}
BYSTANDER_QUESTIONS = ["Name a color.", "Name a fruit.", "Name a planet.", "Name an ocean."]


def _deep_schema(depth: int, title: str) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return {**schema, "title": title}


def _chat(content: str, **fields) -> dict:
    return {"model": "auto", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}


def _attacks(model: str) -> dict[str, Callable[[int], tuple[str, dict, dict]]]:
    """class -> i -> (path, body, extra headers)."""
    near = "Explain how a hash table handles collisions, with an example. " * 6000  # ~370 KB

    def tools(n: int, text: int) -> list[dict]:
        return [{"type": "function", "function": {"name": f"f{k}", "description": "d" * text, "parameters": {
            "type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(8)}}}} for k in range(n)]

    return {
        "deep_schema": lambda i: ("/v1/chat/completions", _chat("hi", guided_json=_deep_schema(30, f"t{i}-{time.time_ns()}")), {}),
        "huge_regex": lambda i: ("/v1/chat/completions", _chat("hi", guided_regex="(" + "|".join(
            f"a{j}b{i}" for j in range(400)) + "){1,50}"), {}),
        "many_tools": lambda i: ("/v1/chat/completions", _chat(f"hi {i}", tools=tools(128, 50)), {}),
        "big_tool_text": lambda i: ("/v1/chat/completions", _chat(f"hi {i}", tools=tools(40, 2400)), {}),
        "near_duplicate_flood": lambda i: ("/v1/chat/completions", _chat(near + f" {i}", max_tokens=1), {}),
        "embeddings_bulk": lambda i: ("/v1/embeddings", {"model": "all-MiniLM-L6-v2",
                                                         "input": [f"text number {i} " * 12] * 64}, {}),
        "n_flood": lambda i: ("/v1/chat/completions", {**_chat(f"Write a long story {i}.", n=16, max_tokens=512,
                                                               ignore_eos=True, temperature=0.8, model=model)},
                              {"x-request-deadline-ms": str(86_400_000)}),
        "batch_poison": lambda i: ("/v1/chat/completions", _chat("Yes or no?", guided_choice=["y"], min_tokens=8,
                                                                 temperature=0.9, max_tokens=16), {}),
    }


STAGES = ("lookup", "route", "queue", "engine_queue", "prefill")  # where a bystander's first token waited


def _stages(header: str) -> dict[str, float]:
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        if name in STAGES and dur:
            out[name] = float(dur)
    return out


def _bystander_ttft(http: httpx.Client, question: str, stages: list[dict] | None = None) -> tuple[str, float | None]:
    """(status, or status:code for an error; TTFT ms of a streamed answer). Its Server-Timing
    stages and its x-route header are appended to `stages`."""
    body = {"model": "auto", "messages": [{"role": "user", "content": question}], "max_tokens": 16, "stream": True}
    start = time.perf_counter()
    ttft = None
    with http.stream("POST", "/v1/chat/completions", json=body, headers=BYSTANDER) as resp:
        if resp.status_code != 200:
            resp.read()
            return f"{resp.status_code}:{(resp.json().get('error') or {}).get('code')}", None
        if stages is not None:
            stages.append({**_stages(resp.headers.get("server-timing", "")), "x-route": resp.headers.get("x-route", "")})
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = (time.perf_counter() - start) * 1000
        return "200", ttft


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[int(q * (len(ordered) - 1))], 1)


def _idle_ttft(base: str, label: str, n: int = 8) -> tuple[float, dict[str, float | None]]:
    """The bystander's TTFT p50 (and its stages) on the service with nothing else running."""
    stages: list[dict] = []
    with httpx.Client(base_url=base, timeout=120) as http:
        ttfts = [t for k in range(n) if (t := _bystander_ttft(http, f"Name an animal ({label} {k}).", stages)[1])]
    return statistics.median(ttfts), {k: _pct([st[k] for st in stages if k in st], 0.5) for k in STAGES}


def _one_class(base: str, name: str, make: Callable[[int], tuple[str, dict, dict]], attackers: int) -> dict:
    """One attack class, against the bystander's TTFT measured idle just before it (the box's
    speed drifts between classes; each class is compared with its own idle moment)."""
    idle_ttft, idle_stages = _idle_ttft(base, name)
    stop = threading.Event()
    attacker_codes: Counter = Counter()
    bystander_codes: Counter = Counter()
    charged = {"prompt_tokens": 0, "completion_tokens": 0}
    health_ms: list[float] = []
    ttfts: list[float] = []
    stage_ms: list[dict] = []  # each: Server-Timing stages (ms) and the x-route header
    sent = [0]
    lock = threading.Lock()

    def attack() -> None:
        with httpx.Client(base_url=base, timeout=ATTACK_TIMEOUT_S) as http:
            while not stop.is_set():
                with lock:
                    if sent[0] >= MAX_ATTACK_REQUESTS:
                        return
                    i = sent[0]
                    sent[0] += 1
                path, body, extra = make(i)
                try:
                    resp = http.post(path, content=json.dumps(body), headers={**ATTACKER, **extra})
                except httpx.HTTPError as exc:
                    attacker_codes[type(exc).__name__] += 1
                    continue
                attacker_codes[str(resp.status_code) if resp.status_code == 200 else
                               f"{resp.status_code}:{(resp.json().get('error') or {}).get('code')}"] += 1
                if resp.status_code == 200:
                    usage = resp.json().get("usage") or {}
                    charged["prompt_tokens"] += usage.get("prompt_tokens", 0)
                    charged["completion_tokens"] += usage.get("completion_tokens", 0)

    def probe() -> None:
        with httpx.Client(base_url=base, timeout=30) as http:
            while not stop.is_set():
                t = time.perf_counter()
                http.get("/health")
                health_ms.append((time.perf_counter() - t) * 1000)
                time.sleep(0.02)

    def bystand() -> None:
        with httpx.Client(base_url=base, timeout=120) as http:
            k = 0
            while not stop.is_set():
                status, ttft = _bystander_ttft(http, BYSTANDER_QUESTIONS[k % len(BYSTANDER_QUESTIONS)] + f" ({k})",
                                               stage_ms)
                bystander_codes[status] += 1
                if ttft is not None:
                    ttfts.append(ttft)
                else:
                    time.sleep(1.0)  # a refusal: back off as the openai SDK does
                k += 1

    threads = [threading.Thread(target=attack) for _ in range(attackers)]
    threads += [threading.Thread(target=probe), threading.Thread(target=bystand)]
    for t in threads:
        t.start()
    time.sleep(WINDOW_S)
    stop.set()
    for t in threads:
        t.join(timeout=180)
    ttft_p50 = _pct(ttfts, 0.5)
    fivexx = sum(v for k, v in (attacker_codes + bystander_codes).items() if k.startswith("5") and
                 not k.endswith(_SHEDS))
    return {
        "class": name,
        "attackers": attackers,
        "attack_requests": sent[0],
        "attacker_status": dict(attacker_codes),
        "attacker_charged_usage": charged,
        "attacker_rate_limited": sum(v for k, v in attacker_codes.items() if k.startswith("429")),
        "bystander_status": dict(bystander_codes),
        "bystander_ttft_ms_p50": ttft_p50,
        "bystander_idle_ttft_ms_p50": round(idle_ttft, 1),
        "bystander_idle_stage_ms_p50": idle_stages,
        "bystander_ttft_vs_idle": round(ttft_p50 / idle_ttft, 2) if ttft_p50 and idle_ttft else None,
        "bystander_stage_ms_p50": {k: _pct([st[k] for st in stage_ms if k in st], 0.5) for k in STAGES},
        "bystander_routes": dict(Counter(st["x-route"] for st in stage_ms)),  # model;reason=why
        "health_ms": {"p50": _pct(health_ms, 0.5), "p99": _pct(health_ms, 0.99), "max": _pct(health_ms, 1.0),
                      "probes": len(health_ms)},
        "server_errors": fivexx,
        "goals_met": {
            "health_p99_le_100ms": (_pct(health_ms, 0.99) or 0) <= 100.0,
            "no_5xx": fivexx == 0,  # sheds (503 with Retry-After) are counted apart
            "bystander_answered": bystander_codes.get("200", 0) > 0 and set(bystander_codes) == {"200"},
            "attacker_sheds_only": all(not k.startswith("5") or k.endswith(_SHEDS) for k in attacker_codes),
            "bystander_ttft_le_2x_idle": bool(ttft_p50 and idle_ttft and ttft_p50 <= 2 * idle_ttft),
        },
    }


# A 503 that sheds load (with Retry-After), not a server fault: what the attacker may get.
_SHEDS = (":deadline_unmeetable", ":queue_full", ":queue_wait_limit", ":deadline_in_queue", ":queue_timeout")


def _two_tenants(args) -> None:
    """The attacker and the bystander are two listed tenants with the default limits each: an
    unlisted key shares one rate bucket with every other unlisted caller (docs/security.md)."""
    from ingress.context import tenant_from_headers

    for headers in (ATTACKER, BYSTANDER):
        args.admission.tenants[tenant_from_headers(headers)] = args.admission.tenants["default"]


def plot(result: dict, path: Path) -> None:
    """Per class: the bystander's TTFT idle and under attack (bars, the 2x line), /health p99."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = result["classes"]
    names = [c["class"].replace("_", "\n") for c in classes]
    x = range(len(classes))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    idle = [c["bystander_idle_ttft_ms_p50"] for c in classes]
    attacked = [c["bystander_ttft_ms_p50"] or float("nan") for c in classes]
    ax1.bar([i - 0.2 for i in x], idle, 0.4, label="idle")
    ax1.bar([i + 0.2 for i in x], attacked, 0.4, label="beside the attacker")
    ax1.scatter(list(x), [2 * v for v in idle], marker="_", s=400, color="red", label="2x idle")
    ax1.set_xticks(list(x), names, fontsize=7)
    ax1.set_ylabel("bystander TTFT p50, ms")
    ax1.legend(fontsize=8)
    ax2.bar(list(x), [c["health_ms"]["p99"] for c in classes])
    ax2.axhline(100, color="red", lw=0.8, ls=":", label="100 ms")
    ax2.set_xticks(list(x), names, fontsize=7)
    ax2.set_ylabel("/health p99, ms")
    ax2.legend(fontsize=8)
    fig.suptitle("one attacker beside one tenant (bench hostile)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool = False, out: str | None = None) -> dict:
    serve_file = load_serve_config()
    model = serve_file.args.draft.engine.model_id
    attacks = _attacks(model)
    if quick:
        attacks = {k: attacks[k] for k in ("deep_schema", "n_flood", "batch_poison")}
    results = []
    with running_service(serve_file, tweak=_two_tenants) as base:
        with httpx.Client(base_url=base, timeout=120) as http:
            for k in range(3):  # warm-up
                _bystander_ttft(http, f"Say hello ({k}).")
        for name, make in attacks.items():
            attackers = N_FLOOD_ATTACKERS if name == "n_flood" else ATTACKERS
            results.append(_one_class(base, name, make, attackers))
            time.sleep(3.0)  # let the queue drain before the next class
    result = {
        "window_s": WINDOW_S,
        "attackers": ATTACKERS,
        "classes": results,
        "all_goals_met": all(all(r["goals_met"].values()) for r in results),
    }
    if out is not None:
        plot(result, Path(out).with_suffix(".png"))
    return result
