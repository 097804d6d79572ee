"""Shared fixtures. The `service` fixture starts the real graph from serve_config.yaml on a
real Ray Serve (loopback, a free port), once per test session."""

from __future__ import annotations

import os
import socket
import time

import httpx
import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from configs.serve_config import load_serve_config  # noqa: E402
from configs.schemas import EngineConfig  # noqa: E402

# The test service keeps the production config but tight admission limits, so overload
# behaviour can be provoked with a handful of requests.
TEST_MAX_INFLIGHT = 2
TEST_MAX_QUEUED = 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    def __init__(self, base_url: str, serve_file) -> None:
        self.base_url = base_url
        self.config = serve_file
        self.http = httpx.Client(base_url=base_url, timeout=120)

    def openai(self, **kwargs):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key="sk-test", max_retries=0, **kwargs)

    def async_openai(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(base_url=self.base_url + "/v1", api_key="sk-test", max_retries=0)

    def model_stats(self, deployment: str = "TargetModel") -> dict[str, int]:
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app_name=self.config.app_name)
        return handle.stats.remote().result(timeout_s=30)


@pytest.fixture(scope="session")
def serve_file():
    return load_serve_config()


@pytest.fixture(scope="session")
def tokenizer(serve_file):
    from transformers import AutoTokenizer

    from engines.model_store import resolve_model_dir

    engine: EngineConfig = serve_file.args.target.engine
    return AutoTokenizer.from_pretrained(resolve_model_dir(engine.source, engine.cache_dir))


@pytest.fixture(scope="session")
def service(serve_file):
    import ray
    from ray import serve

    from deployments.app import build_graph

    args = serve_file.args.model_copy(deep=True)
    args.admission.max_inflight = TEST_MAX_INFLIGHT
    args.admission.max_queued = TEST_MAX_QUEUED
    port = _free_port()
    ray.init(
        num_cpus=8,
        include_dashboard=False,
        runtime_env={"env_vars": serve_file.env_vars},
        logging_level="WARNING",
    )
    try:
        logging_config = {**serve_file.logging_config, "log_level": "WARNING"}
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=logging_config)
        serve.run(
            build_graph(args, serve_file.deployment_options),
            name=serve_file.app_name,
            route_prefix=serve_file.route_prefix,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        else:
            raise RuntimeError("service did not become healthy in 300 s")
        svc = Service(base, serve_file)
        yield svc
        svc.http.close()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
