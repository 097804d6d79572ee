"""Suite `cluster`: the graph on a 4-node Ray cluster on this machine (bench/local_cluster.py,
configs/cluster.yaml) against the same graph on one node, on the same trace.

- **Cache across nodes and replicas.** A trace of 12 tenants, each asking a question, repeating
  it and asking a paraphrase, through whichever ingress the kernel hands each new connection:
  the hit rate (exact repeats served `hit`, paraphrases served `verified` or `hit`) on one node,
  on the cluster with one SemanticCache replica and with three; the ingress nodes that served.
- **Node loss.** Four clients send uncached requests; the model node running TargetModel is
  killed: requests sent, answered, clear errors, lost (none may be), and the time from the kill
  to the first answer to a request sent after it.
- **Fleet admission.** A burst of 16 concurrent requests against a service admitting 4 at a time
  with 4 queued (2x what it holds): admitted and shed on one node (one ingress) and on the
  cluster (two ingress replicas on two nodes, sharing one view through the AdmissionController).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from configs.serve_config import load_serve_config
from bench.local import running_service, without_rate_limits
from bench.local_cluster import CLUSTER_PROFILE, lose_a_node_under_load, running_cluster

TENANTS = 12
QUESTIONS = [
    ("What is the capital of France?", "Which city is the capital of France?"),
    ("How do I reverse a list in Python?", "What's the way to reverse a Python list?"),
    ("What does HTTP stand for?", "What is HTTP short for?"),
    ("How do I install numpy?", "What's the command to install numpy?"),
]
MAX_INFLIGHT, MAX_QUEUED, BURST = 4, 4, 16


def _tweak(args) -> None:
    without_rate_limits(args)
    args.cache.near_entries = 0  # every exact hit from a cache replica: the thing measured
    args.admission.max_inflight, args.admission.max_queued = MAX_INFLIGHT, MAX_QUEUED
    for name, tier in list(args.admission.tiers.items()):
        args.admission.tiers[name] = tier.model_copy(update={"ttft_ms": None, "e2e_ms": 600_000, "max_queue_ms": None})


def _ask(base: str, model: str, text: str, key: str, max_tokens: int = 16, cache: bool = True) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if not cache:
        headers["cache-control"] = "no-cache, no-store"
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens}
    return httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=300)


def _trace(base: str, model: str) -> dict:
    repeats = paraphrases = 0
    nodes: dict[str, int] = {}
    for t in range(TENANTS):
        key = f"sk-trace-{t}-{time.time_ns()}"
        question, paraphrase = QUESTIONS[t % len(QUESTIONS)]
        for text in (question, question, paraphrase):
            resp = _ask(base, model, text, key)
            resp.raise_for_status()
            node = resp.headers.get("x-ingress-replica", "@").rsplit("@", 1)[1]
            nodes[node] = nodes.get(node, 0) + 1
            if text is question and resp.headers["x-cache"] == "hit":
                repeats += 1
            elif text is paraphrase and resp.headers["x-cache"] in ("hit", "verified"):
                paraphrases += 1
            time.sleep(0.1)  # writes are fire-and-forget
    return {"repeat_hit_rate": round(repeats / TENANTS, 3), "paraphrase_hit_rate": round(paraphrases / TENANTS, 3),
            "requests_by_ingress_node": nodes}


def _burst(base: str, model: str) -> dict:
    def one(i: int) -> int:
        return _ask(base, model, f"Burst request {i}: write two sentences about the sea.", f"sk-burst-{i}",
                    max_tokens=48, cache=False).status_code

    with ThreadPoolExecutor(BURST) as pool:
        codes = list(pool.map(one, range(BURST)))
    return {"sent": BURST, "admitted": codes.count(200), "shed": sum(c in (429, 503) for c in codes),
            "capacity": MAX_INFLIGHT + MAX_QUEUED}


def _node_loss(cluster, model: str) -> dict:
    def ask(i: int, n: int) -> int | str:
        try:
            resp = _ask(cluster.urls.best, model, f"Client {i} request {n}: say a word.", f"sk-load-{i}", cache=False)
        except httpx.HTTPError as exc:
            return type(exc).__name__
        return resp.status_code if resp.status_code == 200 or "error" in resp.json() else f"{resp.status_code} bare"

    victim = cluster.node_of("llm", "TargetModel")[0]
    result = lose_a_node_under_load(cluster, ask, victim, settle_s=10)
    result["target_moved_off_the_lost_node"] = victim not in cluster.node_of("llm", "TargetModel")
    return result


def run(quick: bool = False) -> dict:
    single_file = load_serve_config()
    model = single_file.args.target.engine.model_id
    with running_service(single_file, tweak=_tweak) as base:
        single = {"trace": _trace(base, model), "burst": _burst(base, model)}

    def cache_replicas(n: int):
        def options(opts: dict) -> None:
            opts["SemanticCache"].pop("autoscaling_config", None)
            opts["SemanticCache"]["num_replicas"] = n
        return options

    cluster_file = load_serve_config(CLUSTER_PROFILE)
    one_cache = None
    if not quick:
        with running_cluster(cluster_file, tweak=_tweak, options=cache_replicas(1)) as cluster:
            one_cache = {"trace": _trace(cluster.urls.best, model)}
    with running_cluster(cluster_file, tweak=_tweak, options=cache_replicas(3)) as cluster:
        three = {"trace": _trace(cluster.urls.best, model), "burst": _burst(cluster.urls.best, model)}
        three["node_loss"] = _node_loss(cluster, model)
    return {
        "nodes": {"head": {"front": 4}, "workers": [{"front": 2}, {"model": 2}, {"model": 2}]},
        "single_node": single,
        "cluster_1_cache_replica": one_cache,
        "cluster_3_cache_replicas": three,
        "summary": {
            "repeat_hit_rate": {"single_node": single["trace"]["repeat_hit_rate"],
                                "cluster_1_cache": one_cache["trace"]["repeat_hit_rate"] if one_cache else None,
                                "cluster_3_caches": three["trace"]["repeat_hit_rate"]},
            "ingress_nodes_serving": len(three["trace"]["requests_by_ingress_node"]),
            "node_loss_lost": three["node_loss"]["lost"],
            "node_loss_recovery_s": three["node_loss"]["recovery_s"],
            "burst_admitted": {"single_ingress": single["burst"]["admitted"], "two_ingresses": three["burst"]["admitted"],
                               "capacity": MAX_INFLIGHT + MAX_QUEUED},
        },
    }
