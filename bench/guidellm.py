"""Suite `guidellm`: a public OpenAI-API load tool against the shipped config, no headers.

guidellm 0.8.1 (installed by `bash scripts/peers.sh` into `.venv-peers/guidellm/`, never into `.venv/`),
concurrent profile at 1, 2, 4 and 8 streams, 128-token synthetic prompts and 32 output tokens,
against the service started here with `serve_config.yaml` untouched: what a user's first
benchmark of this service with a standard tool sees. guidellm's own report is kept beside the
result (`bench/results/guidellm_report.json`); the result file has, per level, requests
answered and refused, TTFT and throughput as guidellm measured them.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

STREAMS = (1, 2, 4, 8)
GUIDELLM = Path(__file__).resolve().parent.parent / ".venv-peers" / "guidellm" / "bin" / "guidellm"
REPORT = Path(__file__).resolve().parent / "results" / "guidellm_report.json"


def _scenario(target: str, tokenizer: str, seconds: float) -> dict:
    return {
        "metadata": {"name": "latency-serve-defaults", "description": "no headers, model auto, 1-8 streams"},
        "spec": {
            "backend": {"kind": "openai_http", "target": target, "model": "auto",
                        "request_format": "/v1/chat/completions"},
            "profile": {"kind": "concurrent"},
            "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 128, "output_tokens": 32}],
            "constraints": [{"kind": "max_duration", "seconds": seconds}],
        },
        "benchmarks": [{"profile.streams": n} for n in STREAMS],
    }


def _levels(report: dict) -> list[dict]:
    """Per level: answered, refused (errored), TTFT and output tokens/s, from guidellm's report."""
    out = []
    for bench in report.get("benchmarks", []):
        metrics = bench.get("metrics", {})
        totals = metrics.get("request_totals") or {}
        ttft = (metrics.get("time_to_first_token_ms") or {}).get("successful") or {}
        tps = (metrics.get("output_tokens_per_second") or {}).get("successful") or {}
        strategy = bench.get("config", {}).get("strategy", {}) or bench.get("scheduler", {}).get("strategy", {})
        out.append({
            "streams": strategy.get("streams"),
            "answered": totals.get("successful"),
            "refused_or_failed": totals.get("errored"),
            "incomplete": totals.get("incomplete"),
            "ttft_ms_p50": ttft.get("median"),
            "ttft_ms_p99": (ttft.get("percentiles") or {}).get("p99"),
            "output_tokens_per_s": tps.get("mean"),
        })
    return out


def run(quick: bool = False, **_: object) -> dict:
    from configs.serve_config import load_serve_config
    from bench.local import running_service
    from engines.model_store import resolve_model_dir

    if not GUIDELLM.exists():
        raise SystemExit("guidellm is not installed: run `bash scripts/peers.sh` (it makes .venv-peers/)")
    serve_file = load_serve_config()
    tokenizer = str(resolve_model_dir(serve_file.args.target.engine.source))
    seconds = 15.0 if quick else 30.0
    with running_service(serve_file) as base, tempfile.TemporaryDirectory() as tmp:
        scenario = Path(tmp) / "scenario.json"
        scenario.write_text(json.dumps(_scenario(base, tokenizer, seconds)))
        report_path = Path(tmp) / "report.json"
        env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
        proc = subprocess.run(
            [str(GUIDELLM), "run", "--scenario", str(scenario), "--output", f"kind=json,path={report_path}",
             "--disable-console-interactive"],
            env=env, capture_output=True, text=True, timeout=seconds * len(STREAMS) * 3 + 300,
        )
        if proc.returncode != 0 or not report_path.exists():
            raise SystemExit(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        report = json.loads(report_path.read_text())
    for bench in report.get("benchmarks", []):  # per-request records (prompts included): counts only
        bench["requests"] = {k: len(v) if isinstance(v, list) else v for k, v in (bench.get("requests") or {}).items()}
    REPORT.write_text(json.dumps(report, indent=1))
    levels = _levels(report)
    return {
        "config": {"tool": "guidellm 0.8.1", "profile": "concurrent", "streams": list(STREAMS),
                   "prompt_tokens": 128, "output_tokens": 32, "seconds_per_level": seconds,
                   "headers": "none", "model": "auto", "service": "serve_config.yaml"},
        "refused_at_1_to_4_streams": sum((l["refused_or_failed"] or 0) for l in levels if (l["streams"] or 0) <= 4),
        "levels": levels,
        "report": str(REPORT.relative_to(Path(__file__).resolve().parent.parent)),
    }
