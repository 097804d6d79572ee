"""Suite `floor`: the graph against the engine it wraps, at 1, 4 and 8 streams, same file, same precision.

Pairs (bench/peer_systems.py), each system started alone on an idle box, stopped before the
next starts:
- `ours-f32` (the whole graph as shipped, every request naming the float32 target, which its
  Q4_1 copy drafts) against `llama-server` on the GGUF as F32;
- `ours-q4` (the whole graph, its small model pinned to the file's Q4_1 kernels and named by
  every request, its prompts prefilled in F32) against `llama-server-q4` on the shipped Q4_1 file;
- `ours-bare` (the graph with cache, admission and speculation off) against `llama-server`:
  what the graph costs apart from what it adds.

Load: guidellm 0.8.1's concurrent profile, 128-token synthetic prompts, 64 output tokens
(`ignore_eos`), at 1, 4 and 8 streams, `seconds` per level, the same tokenizer and data for
every system; each system is warmed with the same three requests. `repetitions` runs the whole
set that many times, in order; the result keeps each run and the spread (min-max) of every
figure. `ratios` divide ours by llama-server per pair and level: ITL and TTFT (lower is better)
and output tokens/s (higher is better).
"""

from __future__ import annotations

from pathlib import Path

from bench.peer_systems import SYSTEMS, SystemUnavailable, safetensors_dir, wait_idle
from bench.peers import GUIDELLM, _dist, _guidellm, _warm, reports_beside, spread

PAIRS = (("ours-f32", "llama-server"), ("ours-q4", "llama-server-q4"), ("ours-bare", "llama-server"))
STREAMS = (1, 4, 8)
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64
def _scenario(base: str, model: str, seconds: float) -> dict:
    body = {"temperature": 0, "max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
    return {
        "metadata": {"name": "latency-serve-floor", "description": "graph vs engine"},
        "spec": {
            "backend": {"kind": "openai_http", "target": base, "model": model, "request_format": "/v1/chat/completions",
                        "timeout": 120.0, "validate_backend": False, "extras": {"body": body}},
            "profile": {"kind": "concurrent"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(safetensors_dir())},
            "data": [{"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS}],
            "constraints": [{"kind": "max_duration", "seconds": seconds}],
        },
        "benchmarks": [{"profile.streams": n} for n in STREAMS],
    }


def _levels(report: dict) -> dict[int, dict]:
    out = {}
    for streams, bench in zip(STREAMS, report.get("benchmarks", [])):
        m = bench["metrics"]
        tps = (m.get("output_tokens_per_second") or {}).get("successful") or {}
        rps = (m.get("requests_per_second") or {}).get("successful") or {}
        totals = m.get("request_totals") or {}
        out[streams] = {
            "answered": totals.get("successful"), "errored": totals.get("errored"),
            "requests_per_s": round(rps.get("mean") or 0.0, 3),
            "output_tokens_per_s": round(tps.get("mean") or 0.0, 2),
            "ttft_ms": _dist(m.get("time_to_first_token_ms")),
            "itl_ms": _dist(m.get("inter_token_latency_ms")),
        }
    return out


def _measure(name: str, workdir: Path, seconds: float, rep: int, reports: Path) -> dict:
    system = SYSTEMS[name](workdir)
    idle_before = wait_idle()
    base = system.start()
    try:
        _warm(base, system.model)
        report = _guidellm(_scenario(base, system.model, seconds), reports / f"floor__{name}__{rep}.json",
                           seconds * len(STREAMS) * 3 + 300)
    finally:
        system.stop()
    return {"idle_cores_before": idle_before, "levels": _levels(report)}


def _plot(systems: dict, out: Path) -> str:
    """Per pair: ITL p50 and output tokens/s by streams, ours beside llama-server, with the
    spread of the repetitions as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(PAIRS), figsize=(5 * len(PAIRS), 7), squeeze=False)
    for col, pair in enumerate(PAIRS):
        for row, key in enumerate(("itl_ms_p50", "output_tokens_per_s")):
            ax = axes[row][col]
            for offset, name in zip((-0.15, 0.15), pair):
                levels = systems.get(name, {}).get("levels", {})
                xs, ys, lo, hi = [], [], [], []
                for i, streams in enumerate(STREAMS):
                    fig_ = levels.get(streams, {}).get(key, {})
                    if fig_.get("median") is None:
                        continue
                    xs.append(i + offset)
                    ys.append(fig_["median"])
                    lo.append(fig_["median"] - fig_["min"])
                    hi.append(fig_["max"] - fig_["median"])
                ax.bar(xs, ys, width=0.3, yerr=[lo, hi], label=name, capsize=3)
            ax.set_xticks(range(len(STREAMS)), [f"{n} streams" for n in STREAMS])
            ax.set_title(f"{pair[0]} vs {pair[1]}: {key}", fontsize=9)
            ax.legend(fontsize=8)
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return str(path)


def run(quick: bool = False, repetitions: int | None = None, out: str | None = None, **_: object) -> dict:
    import tempfile

    if not GUIDELLM.exists():
        raise SystemExit("guidellm is not installed: run `bash scripts/peers.sh guidellm llamaserver`")
    reps = repetitions or (1 if quick else 3)
    seconds = 15.0 if quick else 20.0
    reports = reports_beside(out)
    reports.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(n for pair in PAIRS for n in pair))
    runs: dict[str, list[dict]] = {n: [] for n in names}
    unavailable: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            for name in names:
                if name in unavailable:
                    continue
                try:
                    runs[name].append(_measure(name, Path(tmp), seconds, rep, reports))
                except SystemUnavailable as exc:
                    unavailable[name] = str(exc)[:500]
                print(f"floor: {name} run {rep + 1}/{reps} done", flush=True)

    def figure(name: str, streams: int, key: str, stat: str = "p50") -> list[float | None]:
        out = []
        for r in runs[name]:
            level = r["levels"].get(streams) or {}
            value = level.get(key)
            out.append(value.get(stat) if isinstance(value, dict) else value)
        return out

    systems = {
        name: {
            "engine": SYSTEMS[name].engine,
            "levels": {
                streams: {
                    "itl_ms_p50": spread(figure(name, streams, "itl_ms")),
                    "ttft_ms_p50": spread(figure(name, streams, "ttft_ms")),
                    "output_tokens_per_s": spread(figure(name, streams, "output_tokens_per_s")),
                    "errored": sum(v or 0 for v in figure(name, streams, "errored")),
                }
                for streams in STREAMS
            },
            "runs": runs[name],
        }
        for name in names if runs[name]
    }

    def ratio(ours: str, peer: str, streams: int, key: str) -> float | None:
        a = systems.get(ours, {}).get("levels", {}).get(streams, {}).get(key, {}).get("median")
        b = systems.get(peer, {}).get("levels", {}).get(streams, {}).get(key, {}).get("median")
        return round(a / b, 3) if a and b else None

    ratios = {
        f"{ours} / {peer}": {
            streams: {k: ratio(ours, peer, streams, k) for k in ("itl_ms_p50", "ttft_ms_p50", "output_tokens_per_s")}
            for streams in STREAMS
        }
        for ours, peer in PAIRS
    }
    plot = _plot(systems, Path(out)) if out else None
    return {
        "plot": plot,
        "config": {"tool": "guidellm 0.8.1", "profile": "concurrent", "streams": list(STREAMS),
                   "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS, "seconds_per_level": seconds,
                   "repetitions": reps, "pairs": [list(p) for p in PAIRS]},
        "ratios": ratios,
        "systems": systems,
        "unavailable": unavailable,
    }
