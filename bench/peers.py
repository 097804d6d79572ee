"""Suite `peers`: this service against what users would run instead, driven by guidellm.

Systems (bench/peer_systems.py): our graph as shipped (`ours`), our graph on its vLLM profile
(`ours-vllm`), `vllm serve`, Ray Serve LLM on the same vLLM, and llama.cpp's server, each in
its own environment from `bash scripts/peers.sh`, each serving our target's weights at its
precision (the shipped SmolLM2-135M GGUF dequantized to float32), on loopback,
started and stopped here one at a time so none competes with another for the cores.

Load: guidellm 0.8.1 (a public OpenAI-API load generator; chosen over aiperf because it runs
on a CPU-only box without NVIDIA's perf_analyzer binaries and computes goodput against latency
objectives itself), streaming chat completions through each system's own front door, the same
rows (bench/peer_workloads.py) at the same Poisson arrival times for every system (guidellm's
`replay` profile; its `poisson` profile repeats gaps across its worker processes).
Rates are multiples of a capacity measured first on `ours` (guidellm's throughput profile on
the chat rows): chat, shared_prefix and repeats at 0.5x and 1x, burst at 2x and 4x. Each
(workload, rate) point gets rows of its own seed, so no point replays another's prompts.

Goodput is guidellm's own: requests per second meeting TTFT <= `SLO["ttft_ms"]` and
inter-token latency <= `SLO["tpot_ms"]`; an errored (refused) request counts against
attainment. `conforming_of_sent` also counts the requests still running `DRAIN_S` after the
last arrival as missing. guidellm's reports are kept in bench/results/peers/ beside ours.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.peer_systems import PEERS, SYSTEMS, PeerSystem, SystemUnavailable, safetensors_dir
from bench.peer_workloads import OUTPUT_TOKENS
from bench.peer_workloads import write as write_workload

GUIDELLM = PEERS / "guidellm" / "bin" / "guidellm"
RESULTS = Path(__file__).resolve().parent / "results"
REPORTS = RESULTS / "peers"
SLO = {"ttft_ms": 1000.0, "tpot_ms": 200.0}
RATES = {"chat": (0.5, 1.0), "shared_prefix": (0.5, 1.0), "repeats": (0.5, 1.0), "burst": (2.0, 4.0)}
BURST_HEADERS = {"x-slo-tier": "interactive"}  # a TTFT objective, said the way this service takes it
DEFAULT_SYSTEMS = ("ours", "ours-vllm", "vllm", "ray-serve-llm", "llama.cpp")
DRAIN_S = 30.0  # after the last arrival, how long answers in flight may finish


def _scenario(base: str, model: str, data: Path, max_tokens: int, profile: dict, seconds: float,
              headers: dict | None) -> dict:
    body = {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}
    backend = {"kind": "openai_http", "target": base, "model": model, "request_format": "/v1/chat/completions",
               "timeout": 120.0, "validate_backend": False,  # readiness is checked by /v1/models
               "extras": {"body": body}}
    if headers:
        backend["extras"]["headers"] = headers
    return {
        "metadata": {"name": "latency-serve-peers", "description": data.stem},
        "spec": {
            "backend": backend,
            "profile": profile,
            "tokenizer": {"kind": "huggingface_auto", "model": str(safetensors_dir())},
            "data": [{"kind": "json_file", "path": str(data)}],
            "constraints": [{"kind": "max_duration", "seconds": seconds}],
            "metrics": {"kind": "generative", "sample_size": 0, "slo": SLO},
        },
    }


def _guidellm(scenario: dict, report: Path, timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "scenario.json"
        path.write_text(json.dumps(scenario))
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": tmp}
        # Its own process group: guidellm's worker processes go with it on a timeout or Ctrl-C.
        proc = subprocess.Popen(
            [str(GUIDELLM), "run", "--scenario", str(path), "--output", f"kind=json,path={report}",
             "--disable-console-interactive"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if proc.returncode != 0 or not report.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{(out or '')[-3000:]}")
    return json.loads(report.read_text())


def _dist(metric: dict | None, scale: float = 1.0) -> dict:
    ok = (metric or {}).get("successful") or {}
    pct = ok.get("percentiles") or {}
    def v(x):
        return None if x is None else round(x * scale, 2)
    return {"p50": v(ok.get("median")), "p99": v(pct.get("p99")), "mean": v(ok.get("mean"))}


def summarize(report: dict) -> dict:
    """One point from guidellm's report: the figures the issue asks for, as guidellm measured them."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m.get("request_totals") or {}
    goodput = (m.get("request_goodput") or {}).get("successful") or {}
    rps = (m.get("requests_per_second") or {}).get("successful") or {}
    tps = (m.get("output_tokens_per_second") or {}).get("successful") or {}
    attainment, determined = m.get("slo_attainment"), m.get("slo_determined_requests") or 0
    conforming = round((attainment or 0.0) * determined)
    sent = sum(totals.get(k) or 0 for k in ("successful", "errored", "incomplete"))
    return {
        "answered": totals.get("successful"), "errored": totals.get("errored"), "incomplete": totals.get("incomplete"),
        "requests_per_s": round(rps.get("mean") or 0.0, 3),
        "goodput_rps": round(goodput.get("mean") or 0.0, 3),
        "slo_attainment": attainment,
        # guidellm leaves requests still running at the end out of its attainment; here they count
        # as missing the objective, so a system that queues without end is not flattered by it
        "conforming": conforming, "conforming_of_sent": round(conforming / sent, 3) if sent else None,
        "ttft_ms": _dist(m.get("time_to_first_token_ms")),
        "itl_ms": _dist(m.get("inter_token_latency_ms")),
        "e2e_ms": _dist(m.get("request_latency"), 1000.0),
        "output_tokens_per_s": round(tps.get("mean") or 0.0, 2),
        "duration_s": round(bench.get("duration") or 0.0, 1),
    }


def _warm(base: str, model: str) -> None:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                       "temperature": 0}).encode()
    for _ in range(3):
        req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except Exception:
            pass


def _capacity(system: PeerSystem, base: str, data_dir: Path, seconds: float) -> dict:
    """Requests/s `system` sustains on the chat rows, 4 streams at once (guidellm's throughput profile)."""
    data = write_workload("chat", data_dir, seed=1000, name="capacity")
    report = REPORTS / f"{system.name}__capacity.json"
    scenario = _scenario(base, system.model, data, OUTPUT_TOKENS["chat"], {"kind": "throughput", "max_concurrency": 4},
                         seconds, None)
    point = summarize(_guidellm(scenario, report, seconds * 3 + 300))
    return {"requests_per_s": point["requests_per_s"], "measured_on": system.name, "streams": 4, **point}


def _run_system(system: PeerSystem, data_dir: Path, rates: dict, seconds: float, capacity: dict | None,
                progress) -> tuple[dict, dict | None]:
    points: dict = {}
    base = system.start()
    try:
        _warm(base, system.model)
        if capacity is None:
            capacity = _capacity(system, base, data_dir, seconds)
            progress(f"capacity {capacity['requests_per_s']} rps on {system.name}")
        for workload, multiples in rates.items():
            for multiple in multiples:
                rate = round(capacity["requests_per_s"] * multiple, 3)
                data = write_workload(workload, data_dir, seed=int(multiple * 10), name=f"{workload}_{multiple}x",
                                      rate=rate, seconds=seconds)
                report = REPORTS / f"{system.name}__{workload}__{multiple}x.json"
                headers = BURST_HEADERS if workload == "burst" else None
                # Arrivals at the rows' own times; DRAIN_S more for the answers in flight.
                scenario = _scenario(base, system.model, data, OUTPUT_TOKENS[workload],
                                     {"kind": "replay", "schedule_turn": "timestamp"}, seconds + DRAIN_S, headers)
                started = time.monotonic()
                point = summarize(_guidellm(scenario, report, seconds * 4 + 300))
                points[f"{workload}@{multiple}x"] = {"workload": workload, "multiple": multiple, "rate_rps": rate,
                                                     **point}
                progress(f"{system.name} {workload} {multiple}x: goodput {point['goodput_rps']} rps, "
                         f"TTFT p50 {point['ttft_ms']['p50']} ms ({time.monotonic() - started:.0f} s)")
    finally:
        system.stop()
    return points, capacity


def _plots(result: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for workload in RATES:
        fig, (ax_g, ax_t) = plt.subplots(1, 2, figsize=(10, 3.6))
        for name, sys_result in result["systems"].items():
            pts = [p for p in sys_result.get("points", {}).values() if p["workload"] == workload]
            if not pts:
                continue
            xs = [p["multiple"] for p in pts]
            ax_g.plot(xs, [p["goodput_rps"] for p in pts], marker="o", label=name)
            ax_t.plot(xs, [p["ttft_ms"]["p50"] or 0 for p in pts], marker="o", label=name)
        ax_g.set(title=f"{workload}: goodput under SLO", xlabel="rate (x capacity)", ylabel="requests/s")
        ax_t.set(title=f"{workload}: TTFT p50", xlabel="rate (x capacity)", ylabel="ms", yscale="log")
        ax_g.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"peers_{workload}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(str(path.relative_to(RESULTS.parent.parent)))
    return files


def run(quick: bool = False, systems: str | None = None, **_: object) -> dict:
    if not GUIDELLM.exists():
        raise SystemExit("guidellm is not installed: run `bash scripts/peers.sh`")
    names = systems.split(",") if systems else list(DEFAULT_SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {sorted(SYSTEMS)}")
    seconds = 20.0 if quick else 50.0
    REPORTS.mkdir(parents=True, exist_ok=True)
    result: dict = {"slo": SLO, "rates": {w: list(m) for w, m in RATES.items()}, "seconds_per_point": seconds,
                    "load_tool": "guidellm 0.8.1, replay of seeded Poisson arrivals, streaming /v1/chat/completions, temperature 0",
                    "systems": {}}
    capacity = None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in names:
            system = SYSTEMS[name](work)
            entry: dict = {**system.describe()}
            try:
                entry["points"], capacity = _run_system(system, work, RATES, seconds, capacity, print)
            except (SystemUnavailable, RuntimeError, subprocess.TimeoutExpired) as exc:
                entry["error"] = str(exc)[-1500:]
                print(f"{name}: {entry['error']}")
            log = work / f"{name}.log"
            if "error" in entry and log.exists():  # the system's own output, to see why
                shutil.copy(log, REPORTS / f"{name}.log")
            result["systems"][name] = entry
    result["capacity"] = capacity
    result["plots"] = _plots(result, RESULTS)
    return result
