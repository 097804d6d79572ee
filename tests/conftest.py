"""Shared fixtures. The `service` fixture starts the real graph from serve_config.yaml on a
real Ray Serve (loopback, a free port), once per test session."""

from __future__ import annotations

import os

import httpx
import pytest

from bench.local import OFFLINE_ENV, running_service_urls
from configs.schemas import EngineConfig, TenantLimits, TierConfig, TracingConfig
from configs.serve_config import DEFAULT_SERVE_CONFIG, load_serve_config
from ingress.context import tenant_from_headers

os.environ.update(OFFLINE_ENV)  # tests never reach a model hub


def pytest_collection_modifyitems(config, items):
    """The multi-node cluster tests run first: they start (and stop) a Ray cluster of their own,
    which they can only do before this process joins the session's Ray for the shared service.
    `slow` tests (optional extras, long runs) run only with RUN_SLOW=1."""
    items.sort(key=lambda item: item.module.__name__ != "tests.test_cluster")  # stable: the rest keep their order
    if os.environ.get("RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set RUN_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)

# The test service keeps the production config but tight admission limits, so overload
# behaviour can be provoked with a handful of requests.
TEST_MAX_INFLIGHT = 2
TEST_MAX_QUEUED = 1
TEST_BODY_TIMEOUT_S = 2.0
# A tenant with tight limits, for the 429/403 tests: 2 requests at once, then 1 every 20 s; batch tier only.
LIMITED_KEY = "sk-limited-tenant"
# One request, then 429s: test_observability's way to make one shed without loading the box.
ONE_SHOT_KEY = "sk-one-request-tenant"
# The same limits, for tests/test_hostile.py's client that retries its 429s without pausing.
RETRYING_KEY = "sk-retrying-tenant"
DOWNGRADE_TIER = "downgradable"
# Admin keys: DELETE /v1/cache, and the engine's inner counts (prefix tokens reused) in Server-Timing.
ADMIN_KEY = "sk-admin-test"
# A tier that trims conversations to a small input budget (tests/test_hostile.py).
TRIMMED_TIER = "trimmed"


class Service:
    def __init__(self, base_url: str, serve_file, proxy_url: str | None = None) -> None:
        self.base_url = base_url  # the ingress's direct listener when on (what clients here should use)
        self.proxy_url = proxy_url or base_url  # Ray Serve's proxy: the same API one hop further
        self.config = serve_file
        self.http = httpx.Client(base_url=base_url, timeout=120)

    def openai(self, api_key: str = "sk-test", **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, **kwargs)

    def async_openai(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url + "/v1", api_key="sk-test", max_retries=0)

    def model_stats(self, deployment: str = "TargetModel") -> dict[str, int]:
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app_name=self.config.app_name)
        return handle.stats.remote().result(timeout_s=30)


def profile_under_test():
    """serve_config.yaml, or the profile SERVE_CONFIG names (e.g. configs/cpu-vllm.yaml or
    configs/gpu.yaml: the API tests against the vLLM engine)."""
    return load_serve_config(os.environ.get("SERVE_CONFIG") or DEFAULT_SERVE_CONFIG)


def assert_greedy_agrees(a: str, b: str) -> None:
    """Two greedy answers to one prompt by different paths (streamed or not, drafted or not,
    retried). Exact where the engine's greedy output doesn't depend on what else is in the pass.
    llama.cpp sums a run of tokens in another order than one token (GEMM against GEMV), and vLLM's
    kernels change with the batch's shape, so with either target a near-tie can flip late in an
    answer: there the openings must agree (configs/cpu-exact.yaml gives batch-independent answers)."""
    if profile_under_test().args.target.engine.kind != "transformers":
        n = min(len(a), len(b), 20)
        assert n > 0 and a[:n] == b[:n], (a, b)
    else:
        assert a == b, (a, b)


def prompt_ids(engine, text: str = "What is the capital of France?") -> list[int]:
    """A one-turn chat prompt, as the engine's chat template tokenizes it."""
    return engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )


@pytest.fixture(scope="session")
def exact_serve_file():
    """configs/cpu-exact.yaml: the `transformers` target (float32, drafted by llama.cpp) the
    engine-level unit tests exercise."""
    from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config

    return load_serve_config(CPU_EXACT_CONFIG)


@pytest.fixture(scope="session")
def engine(exact_serve_file):
    """That target's engine, as shipped (the engine and host-tuning unit tests)."""
    from engines.transformers_engine import TransformersEngine

    return TransformersEngine(exact_serve_file.args.target.engine, exact_serve_file.args.host_tuning.cores_shared)


@pytest.fixture(scope="session")
def serve_file():
    return profile_under_test()


@pytest.fixture(scope="session")
def tokenizer(serve_file):
    from transformers import AutoTokenizer

    from engines.model_store import resolve_model_dir

    engine: EngineConfig = serve_file.args.target.engine
    return AutoTokenizer.from_pretrained(resolve_model_dir(engine.source, engine.cache_dir))


@pytest.fixture(scope="session")
def embedder():
    """The real MiniLM (shared by the cache and router tests)."""
    from semantic_cache.embedder import Embedder

    return Embedder()


@pytest.fixture(scope="session")
def otlp_sink():
    """A real OTLP/HTTP endpoint on loopback: the shared service exports every span to it."""
    from bench.otlp_sink import OTLPSink

    sink = OTLPSink()
    yield sink
    sink.close()


@pytest.fixture(scope="session")
def service(serve_file, otlp_sink):
    def tighten(args):
        # Every test request is traced (100%, OTLP through the official exporter), so tracing
        # runs under the whole suite; test_observability reads the spans back.
        args.telemetry.tracing = TracingConfig(exporter="otlp", endpoint=otlp_sink.endpoint, export_interval_ms=200)
        args.admission.max_inflight = TEST_MAX_INFLIGHT
        args.admission.max_queued = TEST_MAX_QUEUED
        args.ingress.body_timeout_s = TEST_BODY_TIMEOUT_S
        # The shared test service keeps the tiers' budgets but not their deadlines: a slow CI box
        # must not shed ordinary tests' requests, nor a busy moment turn them away unqueued.
        # Admission tests send their own deadlines.
        for name, tier in list(args.admission.tiers.items()):
            args.admission.tiers[name] = tier.model_copy(update={"ttft_ms": None, "e2e_ms": 600_000, "max_queue_ms": None})
        # Downgrades without a TTFT target: whether the small model takes the request then depends
        # only on it being idle, not on how fast the shared cores happen to be right now.
        args.admission.tiers[DOWNGRADE_TIER] = TierConfig(priority=0, e2e_ms=600_000, downgrade=True)
        args.admission.tiers[TRIMMED_TIER] = TierConfig(priority=1, e2e_ms=600_000, max_input_tokens=200)
        args.auth.admin_keys = [ADMIN_KEY]
        args.auth.required = False  # a profile that requires keys: the tests' many keys are unlisted (test_auth covers 401s)
        args.admission.tenants[tenant_from_headers({"authorization": f"Bearer {LIMITED_KEY}"})] = TenantLimits(
            tier="batch", allowed_tiers=["batch"], requests_per_s=0.05, request_burst=2
        )
        for key in (ONE_SHOT_KEY, RETRYING_KEY):
            args.admission.tenants[tenant_from_headers({"authorization": f"Bearer {key}"})] = TenantLimits(
                requests_per_s=0.001, request_burst=1
            )

    def one_ingress(options):
        # The tight admission limits above are one gate's: two ingress replicas would split
        # them. The shipped two replicas are tested as shipped (test_defaults).
        options["Ingress"].pop("autoscaling_config", None)
        options["Ingress"]["num_replicas"] = 1

    with running_service_urls(serve_file, tweak=tighten, options=one_ingress) as urls:
        svc = Service(urls.best, serve_file, urls.proxy)
        yield svc
        svc.http.close()
