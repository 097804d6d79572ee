"""Start the graph from a serve config in this Python process (tests and benchmarks), and
find or kill its replicas (the fault tests, `bench chaos`).

Same graph, options and runtime env as `serve run serve_config.yaml`, but on a Ray started
here with logical CPUs to spare and on a free loopback port.
"""

from __future__ import annotations

import contextlib
import copy
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx

from configs.schemas import AppArgs
from configs.serve_config import ServeFile, load_serve_config

OFFLINE_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def without_rate_limits(args: AppArgs) -> None:
    """Lift the `default` tenant's rate limits: a benchmark that sends hundreds of cache hits a
    second from one unlisted key measures the service, not the limiter."""
    from configs.schemas import TenantLimits

    args.admission.tenants["default"] = TenantLimits(
        requests_per_s=1e6, request_burst=1e6, tokens_per_s=1e9, token_burst=1e9
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def quiet_logging(serve_file: ServeFile) -> dict:
    """The file's logging config at WARNING, without per-request access logs (they cost latency)."""
    return {**serve_file.logging_config, "log_level": "WARNING", "enable_access_log": False}


@dataclass(frozen=True)
class ServiceURLs:
    proxy: str  # Ray Serve's proxy (http_options.port)
    direct: str | None  # the ingress replicas' own listener (ingress.direct_port), if on

    @property
    def best(self) -> str:
        """What a client on this box should use: the direct listener when there is one."""
        return self.direct or self.proxy


@contextlib.contextmanager
def running_service(
    serve_file: ServeFile | None = None,
    tweak: Callable[[AppArgs], None] | None = None,
    startup_timeout_s: float = 300,
) -> Iterator[str]:
    """Yield the base URL clients should use (the direct listener when the config has one)."""
    with running_service_urls(serve_file, tweak, startup_timeout_s) as urls:
        yield urls.best


@contextlib.contextmanager
def running_service_urls(
    serve_file: ServeFile | None = None,
    tweak: Callable[[AppArgs], None] | None = None,
    startup_timeout_s: float = 300,
    options: Callable[[dict[str, dict]], None] | None = None,
) -> Iterator[ServiceURLs]:
    """Start the graph; yield its URLs once healthy on each; shut Serve and Ray down afterwards.
    `options` may change a copy of the deployments' Serve options first.

    Both ports are free ones picked here, so a run never collides with a service on 8000/8100."""
    import ray
    from ray import serve

    from deployments.app import build_graph

    os.environ.update(OFFLINE_ENV)
    serve_file = serve_file or load_serve_config()
    args = serve_file.args.model_copy(deep=True)
    if tweak:
        tweak(args)
    ray.init(
        num_cpus=8,  # logical CPUs: with the 2 real ones Ray can't place every replica and hangs
        include_dashboard=False,
        runtime_env={"env_vars": {**serve_file.env_vars, **OFFLINE_ENV}},
        logging_level="WARNING",
    )
    try:
        # Picked once Ray is up: its processes bind ephemeral ports as they start, and one took
        # a port picked before ray.init (the proxy then failed to bind).
        if args.ingress.direct_port is not None:
            args.ingress.direct_host, args.ingress.direct_port = "127.0.0.1", free_port()
        port = free_port()
        logging_config = quiet_logging(serve_file)
        serve.start(
            http_options={"host": "127.0.0.1", "port": port}, logging_config=logging_config,
            controller_options=serve_file.controller_options or None,
        )
        deployment_options = copy.deepcopy(serve_file.deployment_options)
        if options:
            options(deployment_options)
        serve.run(
            build_graph(args, deployment_options, logging_config),
            name=serve_file.app_name,
            route_prefix=serve_file.route_prefix,
        )
        direct = f"http://127.0.0.1:{args.ingress.direct_port}" if args.ingress.direct_port is not None else None
        urls = ServiceURLs(f"http://127.0.0.1:{port}", direct)
        deadline = time.monotonic() + startup_timeout_s
        for base in filter(None, (urls.proxy, urls.direct)):
            _wait_healthy(base, deadline, "service")
        yield urls
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _wait_healthy(base: str, deadline: float, what: str) -> None:
    """Poll `base`/health until it answers 200, or raise at `deadline` (time.monotonic())."""
    while True:
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become healthy at {base}")
        time.sleep(0.5)


@contextlib.contextmanager
def another_app(
    serve_file: ServeFile, args: AppArgs, name: str, proxy_url: str,
    deployment_options: dict[str, dict] | None = None, startup_timeout_s: float = 300,
    logging_config: dict | None = None,
) -> Iterator[str]:
    """One more app of the graph on the Serve already running (tests): yield its base URL (its
    own direct listener if `args` has one, else the proxy at `/name`) once healthy; delete it
    afterwards. Its replicas log at WARNING unless `logging_config` says otherwise."""
    from ray import serve

    from deployments.app import build_graph

    options = deployment_options if deployment_options is not None else serve_file.deployment_options
    logging_config = logging_config if logging_config is not None else quiet_logging(serve_file)
    serve.run(build_graph(args, options, logging_config), name=name, route_prefix=f"/{name}")
    direct = args.ingress.direct_port
    base = f"http://127.0.0.1:{direct}" if direct is not None else f"{proxy_url}/{name}"
    _wait_healthy(base, time.monotonic() + startup_timeout_s, f"app {name}")
    try:
        yield base
    finally:
        serve.delete(name)


def replicas(app: str, deployment: str) -> list[str]:
    """Actor names of a deployment's live replicas (Serve names them SERVE_REPLICA::app#deployment#id)."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))


def kill_replica(name: str, exit_within_s: float = 10) -> None:
    """What a crash looks like to Serve: the actor is gone; the controller starts a replacement.
    Returns once the replica's process has exited (where it ran on this machine): `ray.kill`
    returns before, and a call sent in between could still be answered by the victim."""
    import ray

    actor = ray.get_actor(name, namespace="serve")
    try:
        pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=10)
    except Exception:  # dying already, or too busy to answer: kill it all the same
        pid = None
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + exit_within_s
    while pid and _running(pid) and time.monotonic() < deadline:
        time.sleep(0.02)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):  # gone (or another user's, which a test never starts)
        return False


def wait_replaced(app: str, deployment: str, victim: str, timeout_s: float = 180) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = replicas(app, deployment)
        if alive and victim not in alive and healthy(app, deployment):
            return True
        time.sleep(0.25)
    return False


def healthy(app: str, deployment: str) -> bool:
    from ray import serve
    from ray.serve.schema import DeploymentStatus

    return serve.status().applications[app].deployments[deployment].status == DeploymentStatus.HEALTHY
