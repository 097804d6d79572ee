"""Suite `peers`: this service against what users would run instead, driven by guidellm, fairly.

Systems (bench/peer_systems.py), each in its own environment from `bash scripts/peers.sh`, each
started as its users start it, alone on a box verified idle, and stopped before the next starts.
Every system serves SmolLM2-135M's weights and is compared only within its precision row
(`precision`): `f32` (`llama-server` on the GGUF as F32, `vllm serve` on the same weights as
float32 safetensors, `ours-bare`: our graph pinned to its float32 target with the cache,
admission and speculation off), `q4_1` (`llama-server-q4` on the shipped file, `ours-q4`), and
`shipped` (`ours`: the default config answering `model: auto`, labelled with what it computes in).

Load: guidellm 0.8.1 streaming chat completions through each system's own front door, four
workloads (bench/peer_workloads.py) on one grid of absolute rates (`GRID`, requests/s) for every
system. Each (workload, rate, repetition) has rows and arrival times of its own seed, and every
system gets the very same file: its digest is recorded per system and compared (a mismatch
fails the run). A system is restarted for every workload, warmed by the same three requests, and
its points run from the lowest rate up; within a workload no point repeats another's text (held-
out reworded pairs are split between the points), so no answer cached at one point can serve the
next. Each system's capacity is measured once by the same probe (guidellm's throughput profile,
`PROBE_STREAMS` streams, chat rows) and reported beside the grid, which should pass every knee.

Goodput is over the rate offered, not over a system's own window: `attainment` is the share of
the requests sent that met TTFT <= `SLO["ttft_ms"]` and time per output token <= `SLO["tpot_ms"]`
(a refusal, or a request still running `DRAIN_S` after the last arrival, counts as missed), and
goodput is that share of the trace's rows over its arrival window, the same for every system. `repetitions` runs the whole set that many times, the systems' order rotating;
every figure is reported as the median and the spread (min-max). guidellm's reports are kept,
gzipped, in bench/results/peers/; a plot per workload.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from bench.peer_systems import PEERS, SYSTEMS, PeerSystem, SystemUnavailable, safetensors_dir, wait_idle
from bench.peer_workloads import OUTPUT_TOKENS, WORKLOADS
from bench.peer_workloads import write as write_workload

GUIDELLM = PEERS / "guidellm" / "bin" / "guidellm"
RESULTS = Path(__file__).resolve().parent / "results"
REPORTS = RESULTS / "peers"


def reports_beside(out: str | None) -> Path:
    """Where a run keeps the load tool's reports: beside its result file, so that a run written
    elsewhere leaves the reference's reports as they are."""
    return Path(out).resolve().parent / "peers" if out else REPORTS


def shown(path: Path) -> str:
    """`path` relative to the repository where it lies inside it."""
    try:
        return str(path.relative_to(RESULTS.parent.parent))
    except ValueError:
        return str(path)
SLO = {"ttft_ms": 1000.0, "tpot_ms": 200.0}
GRID = (1.0, 3.0)  # requests/s: one grid for every system and workload
BURST_HEADERS = {"x-slo-tier": "interactive"}  # a TTFT objective, said the way this service takes it
DEFAULT_SYSTEMS = ("ours", "ours-bare", "llama-server", "llama-server-q4", "vllm")
ROWS = ("f32", "q4_1", "bf16", "shipped")
SECONDS = 20.0  # arrivals per point
DRAIN_S = 20.0  # after the last arrival, how long answers in flight may finish
PROBE_S, PROBE_STREAMS = 20.0, 8


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


def keep(report: Path) -> None:
    """guidellm's report, kept beside the result, gzipped (per-request timings compress well)."""
    import gzip

    with open(report, "rb") as src, gzip.open(report.with_suffix(".json.gz"), "wb") as dst:
        shutil.copyfileobj(src, dst)
    report.unlink()


def _dist(metric: dict | None, scale: float = 1.0) -> dict:
    ok = (metric or {}).get("successful") or {}
    pct = ok.get("percentiles") or {}
    def v(x):
        return None if x is None else round(x * scale, 2)
    return {"p50": v(ok.get("median")), "p99": v(pct.get("p99")), "mean": v(ok.get("mean"))}


def summarize(report: dict, created: int | None = None, window_s: float | None = None) -> dict:
    """One point from guidellm's report. With `created` (rows in the trace) and `window_s` (the
    arrival window), goodput and attainment are over what was created, the same for every system."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m.get("request_totals") or {}
    rps = (m.get("requests_per_second") or {}).get("successful") or {}
    tps = (m.get("output_tokens_per_second") or {}).get("successful") or {}
    attainment, determined = m.get("slo_attainment"), m.get("slo_determined_requests") or 0
    conforming = round((attainment or 0.0) * determined)
    sent = sum(totals.get(k) or 0 for k in ("successful", "errored", "incomplete"))
    point = {
        "answered": totals.get("successful"), "errored": totals.get("errored"), "incomplete": totals.get("incomplete"),
        "requests_per_s": round(rps.get("mean") or 0.0, 3),
        # guidellm leaves requests still running at the end out of its attainment; here they count
        # as missing the objective, so a system that queues without end is not flattered by it
        "conforming": conforming, "conforming_of_sent": round(conforming / sent, 3) if sent else None,
        "ttft_ms": _dist(m.get("time_to_first_token_ms")),
        "itl_ms": _dist(m.get("inter_token_latency_ms")),
        "e2e_ms": _dist(m.get("request_latency"), 1000.0),
        "output_tokens_per_s": round(tps.get("mean") or 0.0, 2),
        "duration_s": round(bench.get("duration") or 0.0, 1),
    }
    if created is not None and window_s:
        point.update(created=created, dropped=max(0, created - sent), **goodput(conforming, sent, created, window_s))
    return point


def goodput(conforming: int, sent: int, created: int, window_s: float) -> dict:
    """Attainment is over the requests the load tool sent (answered, refused or still running);
    goodput is that share of the rate offered, the trace's rows over its window: the same
    denominator for every system, whichever request the tool failed to send (guidellm's replay
    can lose one that arrives at the window's very end)."""
    attainment = conforming / sent if sent else 0.0
    return {"attainment": round(attainment, 3), "goodput_rps": round(attainment * created / window_s, 3),
            "offered_rps": round(created / window_s, 3)}


def _warm(base: str, model: str) -> None:
    import urllib.request

    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                       "temperature": 0}).encode()
    for _ in range(3):
        req = urllib.request.Request(f"{base}/v1/chat/completions", body, {"content-type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=120).read()
        except Exception:
            pass


def trace(workload: str, slot: int, rate: float, rep: int, seconds: float, folder: Path) -> tuple[Path, int, str]:
    """The dataset of one point (the `slot`-th rate of the grid, in repetition `rep`): its file,
    its row count and its digest. Its seed depends on nothing else, so every system gets it."""
    point_seed = 1 + rep * 1000 + slot * 10 + WORKLOADS.index(workload)
    path = write_workload(workload, folder, seed=point_seed, name=f"{workload}_{rate}_{rep}",
                          rate=rate, seconds=seconds, slot=slot)
    data = path.read_bytes()
    return path, data.count(b"\n"), hashlib.sha256(data).hexdigest()[:16]


def _capacity(system: PeerSystem, base: str, folder: Path, reports: Path) -> dict:
    """Requests/s `system` sustains on chat rows with `PROBE_STREAMS` streams at once."""
    data = write_workload("chat", folder, seed=999_999, name="capacity")
    report = reports / f"{system.name}__capacity.json"
    scenario = _scenario(base, system.model, data, OUTPUT_TOKENS["chat"],
                         {"kind": "throughput", "max_concurrency": PROBE_STREAMS}, PROBE_S, None)
    point = summarize(_guidellm(scenario, report, PROBE_S * 3 + 300))
    keep(report)
    return {"requests_per_s": point["requests_per_s"], "streams": PROBE_STREAMS, "seconds": PROBE_S,
            "ttft_ms": point["ttft_ms"], "itl_ms": point["itl_ms"]}


def _workload(system: PeerSystem, workload: str, grid: tuple[float, ...], rep: int, seconds: float, folder: Path,
              probe: bool, progress, reports: Path) -> dict:
    """One start of `system`: (the capacity probe,) then `workload` at every rate of the grid."""
    out: dict = {"idle_cores_before": wait_idle(), "points": {}}
    base = system.start()
    try:
        _warm(base, system.model)
        if probe:
            out["capacity"] = _capacity(system, base, folder, reports)
            progress(f"{system.name}: capacity {out['capacity']['requests_per_s']} rps")
        for slot, rate in enumerate(sorted(grid)):
            data, created, digest = trace(workload, slot, rate, rep, seconds, folder)
            report = reports / f"{system.name}__{workload}__{rate}rps__{rep}.json"
            scenario = _scenario(base, system.model, data, OUTPUT_TOKENS[workload],
                                 {"kind": "replay", "schedule_turn": "timestamp"}, seconds + DRAIN_S,
                                 BURST_HEADERS if workload == "burst" else None)
            point = summarize(_guidellm(scenario, report, seconds * 4 + 300), created, seconds)
            keep(report)
            out["points"][rate] = {"trace_sha256": digest, **point}
            progress(f"{system.name} {workload} {rate} rps (run {rep + 1}): goodput {point['goodput_rps']} rps, "
                     f"attainment {point['attainment']}, TTFT p50 {point['ttft_ms']['p50']} ms")
    finally:
        system.stop()
    return out


def spread(values: list) -> dict:
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return {"median": None, "min": None, "max": None}
    mid = len(vals) // 2
    median = vals[mid] if len(vals) % 2 else round((vals[mid - 1] + vals[mid]) / 2, 3)
    return {"median": median, "min": vals[0], "max": vals[-1]}


FIGURES = {  # name -> how to read it from a point
    "goodput_rps": lambda p: p.get("goodput_rps"),
    "attainment": lambda p: p.get("attainment"),
    "ttft_p50_ms": lambda p: p["ttft_ms"]["p50"],
    "ttft_p99_ms": lambda p: p["ttft_ms"]["p99"],
    "itl_p50_ms": lambda p: p["itl_ms"]["p50"],
    "output_tokens_per_s": lambda p: p.get("output_tokens_per_s"),
}


def aggregate(runs: dict[str, dict[str, list[dict]]]) -> dict:
    """Per system, workload and rate: each figure's median and spread over the repetitions."""
    out: dict = {}
    for name, by_workload in runs.items():
        for workload, starts in by_workload.items():
            rates = sorted({r for s in starts for r in s["points"]})
            for rate in rates:
                pts = [s["points"][rate] for s in starts if rate in s["points"]]
                out.setdefault(name, {}).setdefault(workload, {})[str(rate)] = {
                    "repetitions": len(pts), **{k: spread([f(p) for p in pts]) for k, f in FIGURES.items()},
                    "dropped": sum(p.get("dropped") or 0 for p in pts),
                }
    return out


def check_same_traces(runs: dict[str, dict[str, list[dict]]]) -> int:
    """Every system got the very same file at every point; the number of points compared."""
    seen: dict[tuple, tuple[str, str]] = {}
    for name, by_workload in runs.items():
        for workload, starts in by_workload.items():
            for rep, start in enumerate(starts):
                for rate, point in start["points"].items():
                    key = (workload, rate, start.get("rep", rep))
                    first = seen.setdefault(key, (name, point["trace_sha256"]))
                    if first[1] != point["trace_sha256"]:
                        raise AssertionError(f"{name} and {first[0]} got different traces at {key}")
    return len(seen)


def comparisons(table: dict, systems: dict[str, str]) -> dict:
    """Each of ours against each peer it is compared with: the peers of its precision row (the
    shipped config against every peer), its median goodput over theirs per workload and rate."""
    ours = {n for n in systems if n.startswith("ours")}
    out: dict = {}
    for name in sorted(ours & set(table)):
        peers = [p for p in table if p not in ours and systems[name] in (systems[p], "shipped")]
        for workload, by_rate in table[name].items():
            for rate, figs in by_rate.items():
                mine = figs["goodput_rps"]["median"]
                for peer in peers:
                    theirs = table[peer].get(workload, {}).get(rate, {}).get("goodput_rps", {}).get("median")
                    ratio = round(mine / theirs, 3) if mine is not None and theirs else None
                    out.setdefault(name, {}).setdefault(peer, {}).setdefault(workload, {})[rate] = ratio
    return out


def _plots(table: dict, grid: tuple[float, ...], folder: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for workload in WORKLOADS:
        fig, (ax_g, ax_t) = plt.subplots(1, 2, figsize=(10, 3.6))
        for name, by_workload in table.items():
            rates = by_workload.get(workload)
            if not rates:
                continue
            xs = sorted(float(r) for r in rates)
            for ax, key in ((ax_g, "goodput_rps"), (ax_t, "ttft_p50_ms")):
                figs = [rates[str(x)][key] for x in xs]
                med = [f["median"] or 0 for f in figs]
                ax.errorbar(xs, med, yerr=[[m - (f["min"] or 0) for m, f in zip(med, figs)],
                                           [(f["max"] or 0) - m for m, f in zip(med, figs)]],
                            marker="o", capsize=3, label=name)
        ax_g.plot(sorted(grid), sorted(grid), ls=":", color="grey", label="offered")
        ax_g.set(title=f"{workload}: goodput under the SLO", xlabel="offered requests/s", ylabel="requests/s")
        ax_t.set(title=f"{workload}: TTFT p50", xlabel="offered requests/s", ylabel="ms", yscale="log")
        ax_g.legend(fontsize=7)
        fig.tight_layout()
        path = folder / f"peers_{workload}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(shown(path))
    return files


def _day(unix: float | None) -> str | None:
    return None if unix is None else time.strftime("%Y-%m-%d", time.gmtime(unix))


def _kept(update: str, remeasured: list[str], config: dict) -> dict:
    """What `run(update=...)` keeps of an earlier result: its other systems' runs, capacity and
    dates. It must have been run with the same grid, window, repetitions and workloads."""
    prev = json.loads(Path(update).read_text())
    every = {"workloads": list(WORKLOADS)}  # a result that names none ran them all
    for key in ("grid_rps", "seconds_per_point", "drain_s", "repetitions", "slo", "workloads"):
        theirs, ours = prev["config"].get(key, every.get(key)), config.get(key, every.get(key))
        if theirs != ours:
            raise SystemExit(f"{update} was run with {key}={theirs}, this run {ours}")
    others = [n for n in prev["systems"] if n not in remeasured]
    return {
        "names": others,
        "runs": {n: prev["runs"][n] for n in others if n in prev["runs"]},
        "capacity": {n: prev["systems"][n]["capacity"] for n in others if prev["systems"][n].get("capacity")},
        "unavailable": {n: why for n, why in prev.get("unavailable", {}).items() if n in others},
        "failures": [f for f in prev.get("failures", []) if f["system"] in others],
        "measured_at": {n: prev["config"].get("measured_at", {}).get(n) or _day(prev.get("started_unix"))
                        for n in others},
    }


def run(quick: bool = False, systems: str | None = None, rates: str | None = None, repetitions: int | None = None,
        out: str | None = None, update: str | None = None, workloads: str | None = None, **_: object) -> dict:
    """With `update` (a result of this suite): the systems named are measured again on the same
    traces and replace theirs there; every other system's runs are kept as they were."""
    if not GUIDELLM.exists():
        raise SystemExit("guidellm is not installed: run `bash scripts/peers.sh`")
    names = systems.split(",") if systems else list(DEFAULT_SYSTEMS)
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {sorted(SYSTEMS)}")
    grid = tuple(sorted(float(r) for r in rates.split(","))) if rates else GRID
    chosen = [w for w in WORKLOADS if w in workloads.split(",")] if workloads else list(WORKLOADS)
    if workloads and len(chosen) != len(set(workloads.split(","))):
        raise SystemExit(f"unknown workloads in {workloads!r}; known: {list(WORKLOADS)}")
    reps = repetitions or (1 if quick else 3)
    seconds = 12.0 if quick else SECONDS
    reports = reports_beside(out)
    reports.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[dict]]] = {n: {} for n in names}
    capacity: dict[str, dict] = {}
    unavailable: dict[str, str] = {}
    failures: list[dict] = []
    config = {"slo": SLO, "grid_rps": list(grid), "workloads": chosen, "seconds_per_point": seconds,
              "drain_s": DRAIN_S, "repetitions": reps, "probe": {"streams": PROBE_STREAMS, "seconds": PROBE_S},
              "load_tool": "guidellm 0.8.1, replay of seeded arrivals, streaming /v1/chat/completions, temperature 0"}
    measured = list(names)  # the systems this run starts
    kept = _kept(update, measured, config) if update else None
    if kept is not None:
        names = kept["names"] + measured
        runs.update(kept["runs"])
        capacity.update(kept["capacity"])
        unavailable.update(kept["unavailable"])
        failures += kept["failures"]
    config["measured_at"] = {**(kept["measured_at"] if kept else {}), **{n: time.strftime("%Y-%m-%d") for n in measured}}

    def result() -> dict:
        table = aggregate(runs)
        rows = {n: SYSTEMS[n].precision for n in names}
        return {
            "config": config,
            "systems": {n: {"engine": SYSTEMS[n].engine, "model": SYSTEMS[n].model, "precision": rows[n],
                            "capacity": capacity.get(n)} for n in names},
            "capacity_rps": {n: c["requests_per_s"] for n, c in capacity.items()},
            "grid_passes_every_knee": bool(capacity) and max(grid) > max(c["requests_per_s"] for c in capacity.values()),
            "traces_compared": check_same_traces(runs),
            "table": table,
            "comparisons": comparisons(table, rows),
            "unavailable": unavailable,
            "failures": failures,
            "runs": runs,
        }

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for rep in range(reps):
            order = names[rep % len(names):] + names[:rep % len(names)]  # who goes first rotates
            for workload in chosen:
                for name in order:
                    if name in unavailable:
                        continue
                    if name not in measured:
                        continue  # kept from the result being updated
                    system = SYSTEMS[name](folder)
                    try:
                        start = _workload(system, workload, grid, rep, seconds, folder, name not in capacity, print, reports)
                    except SystemUnavailable as exc:  # it did not come up: no further points for it
                        unavailable[name] = str(exc)[-1500:]
                        print(f"{name}: {unavailable[name]}", flush=True)
                        continue
                    except (RuntimeError, subprocess.TimeoutExpired) as exc:  # the load tool failed: this start only
                        failures.append({"system": name, "workload": workload, "rep": rep, "error": str(exc)[-1500:]})
                        print(f"{name} {workload}: {failures[-1]['error'][-300:]}", flush=True)
                        continue
                    if "capacity" in start:
                        capacity[name] = start.pop("capacity")
                    runs[name].setdefault(workload, []).append({"rep": rep, **start})
                    if out:  # a run cut short still leaves what it measured
                        Path(out).write_text(json.dumps(result(), indent=1, default=str))
    final = result()
    final["plots"] = _plots(final["table"], grid, reports.parent)
    return final
