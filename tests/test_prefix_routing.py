"""Prefix-aware routing across two TargetModel replicas: each conversation's turns land on the
replica that holds its history, and reuse its prefix KV there."""

from __future__ import annotations

import httpx
import pytest

from telemetry.clock import server_timing, server_timing_count
from tests.test_serving import NO_CACHE, TARGET

# Each longer than the largest KV block an engine shares (vLLM's CPU build: 128 tokens), so a
# later turn reuses its history on every engine.
OPENERS = [
    "I am planning a long hiking trip through the mountains of northern Spain next summer with two friends. "
    "We want to walk for about three weeks, mostly on marked trails, staying in small mountain huts and village "
    "guesthouses rather than camping. None of us has done a multi-week trek before, although we all go on day "
    "hikes most weekends and one of us has walked parts of the Camino. We are not sure how much food and water "
    "to carry between villages, whether we need to book the huts in advance, what the weather is like in the "
    "high passes in July, and how heavy our packs should be. We also wonder whether to bring trekking poles, "
    "how to handle blisters, and what to do if one of us gets injured far from a road.",
    "My small bakery wants to start selling sourdough bread online, and I need to think about shipping and "
    "packaging. We bake about two hundred loaves a day in a wood-fired oven, mostly country loaves, rye and a "
    "seeded spelt, and we sell them at the counter and at two farmers markets. Customers who moved away keep "
    "asking whether we could post bread to them. I am worried that the loaves will go stale or get crushed in "
    "transit, that the postage will cost more than the bread, and that we cannot bake enough extra loaves without "
    "hiring another baker. I also do not know which packaging keeps the crust crisp, how to label allergens, or "
    "whether we need a different food licence to sell across the country.",
    "I am learning to play the cello as an adult and practice for about thirty minutes every evening after work. "
    "I rented an instrument six months ago, found a teacher who gives me a lesson every other week, and I am "
    "working through the first book of a well known method, mostly simple pieces in first position. My bow "
    "arm gets tired quickly, my intonation drifts when I shift, and I find it hard to practice scales without "
    "getting bored. I would like to play in a community orchestra one day, but I do not know how long that "
    "usually takes, whether I should buy my own cello soon, or how to structure a short practice session so "
    "that I improve steadily instead of repeating the pieces I already know.",
]
FOLLOW_UPS = ["What should I think about first?", "Give me one more tip."]


@pytest.fixture(scope="module")
def two_replicas(service):
    from bench.local import another_app

    args = service.config.args.model_copy(deep=True)
    args.cache.enabled = False  # every turn must reach a model replica
    args.router.kind = "rules"
    args.ingress.direct_port = None  # this app is reached through Ray Serve's proxy, at its route prefix
    args.ingress.debug_timings = True  # Server-Timing carries prefix_reused_tokens for every caller
    options = {name: dict(opts) for name, opts in service.config.deployment_options.items()}
    options["TargetModel"]["num_replicas"] = 2
    assert "PrefixAffinityRouter" in options["TargetModel"]["request_router_config"]["request_router_class"]
    with another_app(service.config, args, "affinity", service.proxy_url, options, startup_timeout_s=240) as base:
        yield base


def test_each_conversation_stays_on_the_replica_holding_its_prefix(two_replicas):
    conversations = [[{"role": "user", "content": opener}] for opener in OPENERS]
    replicas: list[list[str]] = [[] for _ in OPENERS]
    reused: list[list[float]] = [[] for _ in OPENERS]
    with httpx.Client(base_url=two_replicas, timeout=120) as http:
        for turn in range(1 + len(FOLLOW_UPS)):
            for i, messages in enumerate(conversations):  # interleaved, as real traffic is
                resp = http.post(
                    "/v1/chat/completions",
                    json={"model": TARGET, "messages": messages, "temperature": 0, "max_tokens": 12},
                    headers=NO_CACHE,
                )
                assert resp.status_code == 200, resp.text
                replicas[i].append(resp.headers["x-model-replica"])
                timing = resp.headers["server-timing"]
                reused[i].append(server_timing_count(timing, "prefix_reused_tokens"))
                assert "prefill" in server_timing(timing)
                messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
                if turn < len(FOLLOW_UPS):
                    messages.append({"role": "user", "content": FOLLOW_UPS[turn]})
    for i, seen in enumerate(replicas):
        assert len(set(seen)) == 1, f"conversation {i} moved between replicas: {seen}"
        # Each later turn reuses at least the earlier turns' prompt (in whole KV blocks).
        assert all(r >= 16 for r in reused[i][1:]), f"conversation {i}: prefix tokens reused per turn {reused[i]}"
