"""Render a KubeRay RayService manifest from a serve config profile, so the cluster runs exactly
the graph `serve run` runs locally (same file, validated the same way):

    python -m configs.rayservice configs/gpu.yaml --image REGISTRY/latency-serve:TAG > rayservice.yaml
    kubectl apply -f rayservice.yaml

The image must hold this repo at /app with its environment installed (`scripts/setup.sh`, plus
`.[vllm]` for the GPU profile) and the models (the registry packages, or a volume behind the
profile's `source.path`). The head runs the proxy and the light stages; GPU workers take the
model replicas, as many as `ray_actor_options.num_gpus` lets each node hold.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from configs.serve_config import load_serve_config


def manifest(profile: Path, image: str, gpu_workers: int = 2, gpus_per_worker: int = 1) -> dict[str, Any]:
    load_serve_config(profile)  # validated here, before a cluster sees it
    serve = yaml.safe_load(profile.read_text())
    # In a pod the proxy must listen beyond loopback; the Service in front is the only way in.
    serve.setdefault("http_options", {})["host"] = "0.0.0.0"
    container = {"image": image, "workingDir": "/app", "resources": {"limits": {"cpu": "4", "memory": "16Gi"}}}
    worker = {
        **container,
        "resources": {"limits": {"cpu": "8", "memory": "32Gi", "nvidia.com/gpu": str(gpus_per_worker)}},
    }
    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": "latency-serve"},
        "spec": {
            "serveConfigV2": yaml.safe_dump(serve, sort_keys=False),
            "rayClusterConfig": {
                "headGroupSpec": {
                    "rayStartParams": {"dashboard-host": "0.0.0.0", "num-gpus": "0"},
                    "template": {"spec": {"containers": [{"name": "ray-head", **container}]}},
                },
                "workerGroupSpecs": [{
                    "groupName": "gpu",
                    "replicas": gpu_workers,
                    "minReplicas": 1,
                    "maxReplicas": max(gpu_workers, 1) * 2,
                    "rayStartParams": {"num-gpus": str(gpus_per_worker)},
                    "template": {"spec": {"containers": [{"name": "ray-worker", **worker}]}},
                }],
            },
        },
    }


DASHBOARD_PORT, SERVE_PORT = 8265, 8000


def network_policy() -> dict[str, Any]:
    """Who may reach the head pod. KubeRay's operator drives a RayService through the Ray
    dashboard's HTTP API, so the dashboard must listen beyond loopback; but that API submits
    jobs (code) without authentication, so only the operator's pods may reach it. Ray's own
    pods reach each other on every port; everyone else reaches Serve's HTTP port only."""
    ray_pods = {"podSelector": {"matchLabels": {"ray.io/is-ray-node": "yes"}}}
    operator = {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "latency-serve-head"},
        "spec": {
            "podSelector": {"matchLabels": {"ray.io/node-type": "head"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [ray_pods]},
                {"from": [operator], "ports": [{"protocol": "TCP", "port": DASHBOARD_PORT}]},
                {"ports": [{"protocol": "TCP", "port": SERVE_PORT}]},
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded serve config) as readable `|` blocks."""


_Dumper.add_representer(
    str, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None)
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m configs.rayservice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path, help="a serve config, e.g. configs/gpu.yaml")
    parser.add_argument("--image", required=True, help="container image with /app and its environment")
    parser.add_argument("--gpu-workers", type=int, default=2)
    parser.add_argument("--gpus-per-worker", type=int, default=1)
    args = parser.parse_args(argv)
    doc = manifest(args.profile, args.image, args.gpu_workers, args.gpus_per_worker)
    yaml.dump_all([doc, network_policy()], sys.stdout, Dumper=_Dumper, sort_keys=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
