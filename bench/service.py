"""Start the graph from a serve config in this Python process (tests and benchmarks).

Same graph, options and runtime env as `serve run serve_config.yaml`, but on a Ray started
here with logical CPUs to spare and on a free loopback port.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Iterator

import httpx

from configs.schemas import AppArgs
from configs.serve_config import ServeFile, load_serve_config

OFFLINE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_logging(serve_file: ServeFile) -> dict:
    """The file's logging config at WARNING, without per-request access logs (they cost latency)."""
    return {**serve_file.logging_config, "log_level": "WARNING", "enable_access_log": False}


@contextlib.contextmanager
def running_service(
    serve_file: ServeFile | None = None,
    tweak: Callable[[AppArgs], None] | None = None,
    startup_timeout_s: float = 300,
) -> Iterator[str]:
    """Yield the base URL of a healthy service; shut Serve and Ray down afterwards."""
    import ray
    from ray import serve

    from deployments.app import build_graph

    os.environ.update(OFFLINE_ENV)
    serve_file = serve_file or load_serve_config()
    args = serve_file.args.model_copy(deep=True)
    if tweak:
        tweak(args)
    port = free_port()
    ray.init(
        num_cpus=8,  # logical CPUs: with the 2 real ones Ray can't place every replica and hangs
        include_dashboard=False,
        runtime_env={"env_vars": {**serve_file.env_vars, **OFFLINE_ENV}},
        logging_level="WARNING",
    )
    try:
        logging_config = quiet_logging(serve_file)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, logging_config=logging_config)
        serve.run(
            build_graph(args, serve_file.deployment_options, logging_config),
            name=serve_file.app_name,
            route_prefix=serve_file.route_prefix,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + startup_timeout_s
        while True:
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"service did not become healthy in {startup_timeout_s:.0f} s")
            time.sleep(0.5)
        yield base
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
