"""Remote draft placement: the target drafts through the DraftModel deployment (one hop per
round) and still produces exactly the co-located service's greedy output."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.test_serving import NO_CACHE, TARGET

PROMPTS = [
    "Fix the bug and return the full code:\n\ndef mul(a, b):\n    return a + b\n",
    "What is the capital of France?",
]


@pytest.fixture(scope="module")
def remote_app(service):
    from bench.local import another_app, free_port

    from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config

    args = service.config.args.model_copy(deep=True)
    # The float32 target of cpu-exact.yaml: a draft model pays against it (the shipped target
    # runs the same GGUF on llama.cpp itself).
    args.target = load_serve_config(CPU_EXACT_CONFIG).args.target.model_copy(deep=True)
    args.target.speculative.method = "draft_model"
    args.target.speculative.placement = "remote"
    args.target.speculative.draft_engine = None
    # Always draft (k=4): whether adaptive k *should* use a remote draft is tested elsewhere;
    # here every request must go through the remote path.
    args.target.speculative.fixed_k = 4
    # This app also takes the other hot-path modes: routing through the Router deployment, and
    # the model started while the cache lookup is in flight (a near miss follows it as a hint).
    args.router.placement = "remote"
    args.ingress.overlap_cache_lookup = True
    args.ingress.direct_port = free_port()  # its own front door (the proxy has it at /remote too)
    with another_app(service.config, args, "remote", service.proxy_url, startup_timeout_s=180) as base:
        yield base


def _until_idle(base: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        admission = httpx.get(base + "/health", timeout=5).json()["admission"]
        if admission["inflight"] == 0 and not any(admission["others_inflight"].values()):
            return
        time.sleep(0.1)
    raise AssertionError(f"the remote app still counts requests in flight: {admission}")


def test_remote_draft_matches_colocated_greedy_output(service, remote_app):
    from openai import OpenAI
    from ray import serve

    local = service.openai()
    remote = OpenAI(base_url=remote_app + "/v1", api_key="sk-test", max_retries=0)
    for prompt in PROMPTS:
        kwargs = dict(
            model=TARGET,
            messages=[{"role": "user", "content": prompt}],
            temperature=0,
            max_tokens=40,
            extra_headers=NO_CACHE,
        )
        expected = local.chat.completions.create(**kwargs).choices[0].message.content
        streamed = "".join(
            c.choices[0].delta.content or "" for c in remote.chat.completions.create(stream=True, **kwargs) if c.choices
        )
        assert streamed == expected, f"remote {streamed!r} != colocated {expected!r}"
    # Remote routing: `auto` is decided by the Router deployment, the embedding sent along. On a
    # busy box a request stops waiting for a late verdict ("router_late", placement.py), so it
    # is sent once the requests above have left every ingress's count (as last synced).
    _until_idle(remote_app)
    routed = remote.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "What is the capital of Japan?"}], max_tokens=4,
        extra_headers=NO_CACHE,
    )
    small = service.config.args.draft.engine.model_id
    model, reason, rest = routed.headers["x-route"].split(";", 2)
    assert rest.startswith("p_hard="), f"the Router deployment's classifier did not judge it: {routed.headers['x-route']}"
    # Easy, so the small model; a request still releasing its seat may make it admission's move.
    assert (model, reason) in ((small, "reason=classifier_easy"), (small, "reason=busy_box_downgrade")), reason
    # With overlap, a repeat is still a cache hit (the model call is cancelled).
    cached = dict(model=TARGET, messages=[{"role": "user", "content": "Name a color."}], temperature=0, max_tokens=6)
    remote.chat.completions.create(**cached)
    assert remote.chat.completions.with_raw_response.create(**cached).headers["x-cache"] == "hit"
    target_stats = serve.get_deployment_handle("TargetModel", app_name="remote").stats.remote().result(timeout_s=30)
    draft_stats = serve.get_deployment_handle("DraftModel", app_name="remote").stats.remote().result(timeout_s=30)
    assert target_stats["draft_tokens_proposed"] > 0, f"the remote draft was never used: {target_stats}"
    assert target_stats["draft_tokens_accepted"] > 0, target_stats
    assert draft_stats["draft_sessions_recomputed"] >= len(PROMPTS), draft_stats  # one session per request


def test_a_near_miss_follows_a_request_that_started_before_the_lookup_returned(remote_app):
    """overlap_cache_lookup: the model starts beside the lookup; the near miss the lookup finds
    reaches the target replica after the request (`late_hint`), is drafted from, and changes
    nothing in the answer."""
    from openai import OpenAI
    from ray import serve

    client = OpenAI(base_url=remote_app + "/v1", api_key="sk-late-hint", max_retries=0)

    def ask(text: str, headers: dict | None = None):
        return client.chat.completions.with_raw_response.create(
            model=TARGET, messages=[{"role": "user", "content": text}], temperature=0, max_tokens=40,
            extra_headers=headers or {},
        )

    def stats() -> dict:
        return serve.get_deployment_handle("TargetModel", app_name="remote").stats.remote().result(timeout_s=30)

    ask("What is 15% of 200?")
    before = stats()
    hinted = ask("What is 15% of 300?")
    assert hinted.headers["x-cache"] == "hint", hinted.headers
    stages = [part.split(";")[0].strip() for part in hinted.headers["server-timing"].split(",")]
    assert stages.index("queue") < stages.index("lookup"), "the model was to start before the lookup returned"
    after = stats()
    assert after["hint_tokens_accepted"] > before["hint_tokens_accepted"], after
    # Its prefill left a core to the lookup's embedding (host tuning's lookup window).
    assert after["prefills_beside_lookup"] > before["prefills_beside_lookup"], after
    assert "prefill.one_core" in stages, "how long it left the core is in Server-Timing"
    assert "hop.in" in stages, "the way to the replica is timed"
    plain = ask("What is 15% of 300?", NO_CACHE)
    assert hinted.parse().choices[0].message.content == plain.parse().choices[0].message.content


def test_disconnect_stops_the_remote_draft_too(remote_app):
    from ray import serve

    def stats(name: str) -> dict:
        return serve.get_deployment_handle(name, app_name="remote").stats.remote().result(timeout_s=30)

    before = stats("TargetModel")
    body = {
        "model": TARGET,
        "messages": [{"role": "user", "content": "Write a very long story about the sea."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", remote_app + "/v1/chat/completions", json=body, headers=NO_CACHE) as resp:
            seen = 0
            for line in resp.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break  # the client leaves mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        target, draft = stats("TargetModel"), stats("DraftModel")
        if target["active"] == 0 and draft["draft_sessions_open"] == 0:
            break
        time.sleep(0.2)
    assert target["requests_cancelled"] > before["requests_cancelled"], target
    assert target["active"] == 0 and draft["draft_sessions_open"] == 0, (target, draft)
    assert target["last_cancel_rounds_after"] <= 1, target  # stopped within one round
    proposals = draft["draft_proposals"]
    time.sleep(1.0)
    assert stats("DraftModel")["draft_proposals"] == proposals, "the remote draft kept drafting after the client left"
