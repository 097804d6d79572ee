"""A multi-node Ray cluster on one machine (tests, `bench cluster`): a head and worker raylets,
each its own Ray node with its own resources, started and stopped here, and the graph deployed on
it the way `configs/cluster.yaml` places it on a real cluster.

Nodes carry the labels the cluster profile places by: `front` (ingress, admission, cache,
router) and `model` (the model replicas, as GPU nodes would be). The default layout is a head
and one more `front` node (an ingress replica on each) and two `model` nodes, so a model node
can be lost while its replicas have somewhere to go. A worker can be killed (its raylet and every process on it), which is what losing a
machine looks like to Ray and Serve.

All nodes share the host's loopback, so Serve's proxy runs on the head only here (on a cluster:
one per node), and the ingress replicas' direct listeners share one port (SO_REUSEPORT: the
kernel spreads connections over them, whichever node they are on).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from configs.schemas import AppArgs
from configs.serve_config import ServeFile, load_serve_config
from bench.local import OFFLINE_ENV, ServiceURLs, _wait_healthy, free_port, quiet_logging

CLUSTER_PROFILE = "configs/cluster.yaml"


@dataclass
class LocalCluster:
    cluster: Any  # ray.cluster_utils.Cluster
    workers: list[Any] = field(default_factory=list)
    urls: ServiceURLs | None = None

    def node_of(self, app: str, deployment: str) -> list[str]:
        """Node ids of a deployment's live replicas."""
        from ray._private import state  # the GCS's actor table: no dashboard needed

        prefix = f"SERVE_REPLICA::{app}#{deployment}#"
        return [a["Address"]["NodeID"] for a in state.actors().values()
                if a["State"] == "ALIVE" and (a["Name"] or "").startswith(prefix)]

    def kill_worker(self, node_id: str) -> None:
        """Lose a machine: its raylet and every worker process on it die at once."""
        node = next(w for w in self.workers if w.node_id == node_id)
        self.cluster.remove_node(node, allow_graceful=False)
        self.workers.remove(node)


@contextlib.contextmanager
def running_cluster(
    serve_file: ServeFile | None = None,
    tweak: Callable[[AppArgs], None] | None = None,
    workers: tuple[dict[str, float], ...] = ({"front": 2}, {"model": 2}, {"model": 2}),
    options: Callable[[dict[str, dict]], None] | None = None,
    startup_timeout_s: float = 600,
) -> Iterator[LocalCluster]:
    """Start a head and one worker node per `workers` entry (its custom resources), deploy the graph from `serve_file` (default: the
    cluster profile), yield once healthy; shut everything down afterwards."""
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import build_graph

    if ray.is_initialized():
        raise RuntimeError("running_cluster starts its own Ray cluster: this process is already connected to one")
    os.environ.update(OFFLINE_ENV)
    serve_file = serve_file or load_serve_config(CLUSTER_PROFILE)
    args = serve_file.args.model_copy(deep=True)
    if tweak:
        tweak(args)
    deployment_options = {k: dict(v) for k, v in serve_file.deployment_options.items()}
    if options:
        options(deployment_options)
    env = {"env_vars": {**serve_file.env_vars, **OFFLINE_ENV}}
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"front": 4}, "include_dashboard": False,
    })
    handle = LocalCluster(cluster)
    try:
        for resources in workers:
            handle.workers.append(cluster.add_node(num_cpus=2, resources=dict(resources)))
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env=env, logging_level="WARNING")
        if args.ingress.direct_port is not None:
            args.ingress.direct_host, args.ingress.direct_port = "127.0.0.1", free_port()
        port = free_port()
        logging_config = quiet_logging(serve_file)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port},
                    logging_config=logging_config)
        serve.run(build_graph(args, deployment_options, logging_config), name=serve_file.app_name,
                  route_prefix=serve_file.route_prefix)
        direct = f"http://127.0.0.1:{args.ingress.direct_port}" if args.ingress.direct_port is not None else None
        handle.urls = ServiceURLs(f"http://127.0.0.1:{port}", direct)
        deadline = time.monotonic() + startup_timeout_s
        for base in filter(None, (handle.urls.proxy, handle.urls.direct)):
            _wait_healthy(base, deadline, "cluster service")
        yield handle
    finally:
        try:
            serve.shutdown()
        except Exception:
            pass
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()


def lose_a_node_under_load(
    cluster: LocalCluster, ask: Callable[[int, int], int | str], node_id: str, clients: int = 4,
    settle_s: float = 8.0, recovery_limit_s: float = 300.0,
) -> dict[str, Any]:
    """`clients` threads call `ask(client, n)` in a loop (it returns the HTTP status, or the name of
    the error that ended the request); after `settle_s` the node `node_id` is killed; the loop
    goes on until a request sent after the kill is answered (200), or `recovery_limit_s`."""
    outcomes: list[tuple[float, float, int | str]] = []  # (sent, ended, status or error)
    stop = threading.Event()

    def client(i: int) -> None:
        n = 0
        while not stop.is_set():
            sent = time.monotonic()
            try:
                status = ask(i, n)
            except Exception as exc:  # a client that breaks counts as a lost request, not a quiet thread
                status = f"client raised {type(exc).__name__}"
            outcomes.append((sent, time.monotonic(), status))
            n += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    time.sleep(settle_s)
    killed = time.monotonic()
    cluster.kill_worker(node_id)
    recovered = None
    while time.monotonic() < killed + recovery_limit_s and recovered is None:
        time.sleep(1)
        after = [o[1] for o in list(outcomes) if o[0] > killed + 1 and o[2] == 200]
        recovered = min(after) if after else None
    stop.set()
    for t in threads:
        t.join(timeout=recovery_limit_s + 20)
    errors = [o[2] for o in outcomes if o[2] != 200]
    return {
        "clients": clients, "requests": len(outcomes), "answered": sum(o[2] == 200 for o in outcomes),
        "clear_errors": sum(isinstance(e, int) for e in errors),
        "lost": sum(t.is_alive() for t in threads) + sum(not isinstance(e, int) for e in errors),
        "errors": errors,
        "in_flight_at_kill": sum(o[0] <= killed <= o[1] for o in outcomes),
        "recovery_s": round(recovered - killed, 1) if recovered else None,
    }
