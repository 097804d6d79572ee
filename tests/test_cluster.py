"""The graph on a 4-node Ray cluster on this machine (bench/local_cluster.py), placed by
configs/cluster.yaml: an ingress replica on each of two `front` nodes, the model replicas on two
`model` nodes, three SemanticCache replicas splitting the scopes. Requests are served through
both ingress nodes; an answer cached through one is a hit through the other; every repeat hits
with three cache replicas and an invalidation reaches them all; losing a model node under load
loses no request, and the service answers again once Serve has replaced its replicas."""

from __future__ import annotations

import functools
import time
import uuid

import httpx
import pytest

from configs.serve_config import load_serve_config
from bench.local import without_rate_limits
from bench.local_cluster import CLUSTER_PROFILE, lose_a_node_under_load, running_cluster

ADMIN = "sk-cluster-admin"
RECOVERY_LIMIT_S = 240


@pytest.fixture(scope="module")
def cluster():
    serve_file = load_serve_config(CLUSTER_PROFILE)

    def tweak(args):
        without_rate_limits(args)
        args.auth.admin_keys = [ADMIN]
        args.cache.near_entries = 0  # every exact hit comes from a cache replica: what these tests check
        for name, tier in list(args.admission.tiers.items()):  # a slow shared box: no deadlines here
            args.admission.tiers[name] = tier.model_copy(update={"ttft_ms": None, "e2e_ms": 600_000, "max_queue_ms": None})

    def options(opts):
        cache = opts["SemanticCache"]
        cache.pop("autoscaling_config", None)
        cache["num_replicas"] = 3

    with running_cluster(serve_file, tweak=tweak, options=options) as handle:
        yield handle


@functools.cache
def _model() -> str:
    return load_serve_config(CLUSTER_PROFILE).args.target.engine.model_id


def _ask(base: str, text: str, key: str) -> httpx.Response:
    body = {"model": _model(), "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 12}
    # A new connection each time: the kernel spreads them over the ingress replicas' listeners.
    return httpx.post(base + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=180)


def _node(resp: httpx.Response) -> str:
    return resp.headers["x-ingress-replica"].rsplit("@", 1)[1]


def test_both_ingress_nodes_serve_and_an_answer_cached_through_one_hits_through_the_other(cluster):
    base = cluster.urls.best
    key = f"sk-{uuid.uuid4().hex[:8]}"
    first = _ask(base, "What is the capital of Japan?", key)
    assert first.status_code == 200 and first.headers["x-cache"] == "miss", first.text
    nodes, crossed = {_node(first)}, None
    for _ in range(40):
        resp = _ask(base, "What is the capital of Japan?", key)
        assert resp.status_code == 200 and resp.headers["x-cache"] == "hit", resp.headers
        nodes.add(_node(resp))
        if _node(resp) != _node(first):
            crossed = resp
            break
    assert crossed is not None, f"every request went through one ingress node: {nodes}"
    assert crossed.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]


def test_three_cache_replicas_split_the_scopes_every_repeat_hits_and_invalidation_reaches_all(cluster):
    """With Serve's default routing, a repeat would reach the replica holding its answer one time
    in three; each scope's calls go to its own replica instead."""
    base = cluster.urls.best
    keys = [f"sk-shard-{i}-{uuid.uuid4().hex[:6]}" for i in range(9)]
    for k in keys:
        assert _ask(base, "Name a primary color.", k).headers["x-cache"] == "miss"
    time.sleep(0.5)  # writes are fire-and-forget
    assert [_ask(base, "Name a primary color.", k).headers["x-cache"] for k in keys] == ["hit"] * len(keys)
    from ray import serve

    status = serve.status().applications["llm"].deployments["SemanticCache"]
    assert sum(status.replica_states.values()) == 3
    from ingress.context import tenant_from_headers

    tenant = tenant_from_headers({"authorization": f"Bearer {keys[0]}"})
    gone = httpx.delete(f"{base}/v1/cache", params={"tenant": tenant}, headers={"authorization": f"Bearer {ADMIN}"},
                        timeout=60)
    assert gone.status_code == 200, gone.text
    time.sleep(2.5)  # every replica follows the controller's invalidations within about a second
    assert _ask(base, "Name a primary color.", keys[0]).headers["x-cache"] == "miss"
    assert _ask(base, "Name a primary color.", keys[1]).headers["x-cache"] == "hit"


def test_losing_a_model_node_under_load_loses_no_request(cluster):
    """Four clients send uncached requests; the node running TargetModel is killed. Every
    request ends with a complete answer or a clear OpenAI-shaped error (none hangs, none is cut
    silently), and once Serve has placed the replicas on the other model node, requests are
    answered again."""
    from ray import serve

    base = cluster.urls.best

    def ask(i: int, n: int) -> int | str:
        try:
            resp = _ask(base, f"Client {i} request {n}: say a word.", f"sk-load-{i}")
        except httpx.HTTPError as exc:
            return type(exc).__name__
        body = resp.json()  # a 200 cut short or an error without its message counts as lost (a string)
        if resp.status_code == 200:
            return 200 if body["choices"][0]["finish_reason"] in ("stop", "length") else "200 unfinished"
        return resp.status_code if body.get("error", {}).get("message") else f"{resp.status_code} without a message"

    _model()  # loaded once, before the client threads (parsing a Serve config is not thread-safe)
    victim = cluster.node_of("llm", "TargetModel")[0]
    result = lose_a_node_under_load(cluster, ask, victim, recovery_limit_s=RECOVERY_LIMIT_S)
    assert result["lost"] == 0, result
    assert result["recovery_s"] is not None, f"no request answered within {RECOVERY_LIMIT_S} s of losing the node"
    assert all(e in (503, 504) for e in result["errors"]), result
    nodes = cluster.node_of("llm", "TargetModel")
    assert nodes and victim not in nodes
    assert serve.status().applications["llm"].deployments["TargetModel"].status == "HEALTHY"
    print(f"node loss: {result['requests']} requests, {result['clear_errors']} clear errors, answered again "
          f"{result['recovery_s']} s after the kill")
