"""Suite `scaleup`: a TargetModel replica added under load serves its first request warm.

The service starts with TargetModel autoscaling {min 1, max 2}. Closed-loop load (batch tier,
long outputs) makes Serve add the second replica; a prober sends a short streamed request every
0.5 s and reads `x-model-replica` to see which replica answered. A replica reports ready only
after its engine's warm-up (it runs in the constructor), so the first request the new replica
serves should cost what its later ones do.

Keys: `steady_ttft_ms` (median probe TTFT on the first replica before the load), `scale_up_s`
(load start -> first probe answered by the new replica), `new_replica_first_ttft_ms`,
`new_replica_steady_ttft_ms` (median of its next probes, under the same load), and
`first_vs_steady` (the bar: <= 1.5).
"""

from __future__ import annotations

import statistics
import threading
import time

import httpx

TARGET_TOKENS = 24
PROBE_BODY = {
    "model": "smollm2-135m-instruct",
    "messages": [{"role": "user", "content": "Name one planet of the solar system."}],
    "max_tokens": TARGET_TOKENS,
    "temperature": 0,
    "stream": True,
}
HEADERS = {"Cache-Control": "no-cache, no-store", "x-slo-tier": "batch"}


def _probe(http: httpx.Client, n: int) -> tuple[str, float]:
    body = {**PROBE_BODY, "messages": [{"role": "user", "content": f"Name one planet of the solar system. ({n})"}]}
    start = time.perf_counter()
    with http.stream("POST", "/v1/chat/completions", json=body, headers=HEADERS) as resp:
        resp.raise_for_status()
        replica = resp.headers.get("x-model-replica", "?")
        ttft = None
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data: {") and '"content"' in line:
                ttft = (time.perf_counter() - start) * 1000
    return replica, ttft or float("nan")


def run(quick: bool = False, **_: object) -> dict:
    from bench.local import running_service
    from configs.serve_config import load_serve_config

    serve_file = load_serve_config()
    target = serve_file.deployment_options.setdefault("TargetModel", {})
    target.pop("num_replicas", None)
    target["autoscaling_config"] = {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
        "upscale_delay_s": 1, "downscale_delay_s": 600, "metrics_interval_s": 0.5, "look_back_period_s": 2,
    }
    with running_service(serve_file) as base, httpx.Client(base_url=base, timeout=120) as http:
        steady = [_probe(http, i) for i in range(4 if quick else 8)]
        first_replica = steady[0][0]
        steady_ttft = statistics.median(t for _, t in steady[1:])

        stop = threading.Event()

        def load() -> None:
            with httpx.Client(base_url=base, timeout=300) as client:
                while not stop.is_set():
                    body = {**PROBE_BODY, "max_tokens": 200, "stream": False,
                            "messages": [{"role": "user", "content": f"Write a long story about the sea. {time.time()}"}]}
                    try:
                        client.post("/v1/chat/completions", json=body, headers=HEADERS)
                    except httpx.HTTPError:
                        pass

        workers = [threading.Thread(target=load, daemon=True) for _ in range(3)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        new: list[float] = []
        scale_up_s = None
        probes = 0
        try:
            while time.perf_counter() - t0 < 240 and len(new) < (4 if quick else 6):
                replica, ttft = _probe(http, 1000 + probes)
                probes += 1
                if replica != first_replica:
                    if scale_up_s is None:
                        scale_up_s = time.perf_counter() - t0
                    new.append(ttft)
                time.sleep(0.5)
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=300)
    if not new:
        return {"steady_ttft_ms": round(steady_ttft, 1), "scale_up_s": None, "error": "no second replica within 240 s"}
    later = statistics.median(new[1:]) if len(new) > 1 else float("nan")
    return {
        "steady_ttft_ms": round(steady_ttft, 1),
        "scale_up_s": round(scale_up_s, 1),
        "probes_sent": probes,
        "new_replica_first_ttft_ms": round(new[0], 1),
        "new_replica_steady_ttft_ms": round(later, 1),
        "new_replica_ttfts_ms": [round(x, 1) for x in new],
        "first_vs_steady": round(new[0] / later, 2) if later == later else None,
    }
