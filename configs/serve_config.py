"""Read serve_config.yaml the way `serve run` does, for tests and benchmarks.

Validates the file with Ray Serve's own schema and our AppArgs, checks its concurrency limits
against each other (configs/limits.py), and returns what a Python caller needs to start exactly the same graph: app args, per-deployment options, HTTP options
and runtime_env variables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from configs.limits import check_file
from configs.schemas import AppArgs

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SERVE_CONFIG = REPO_ROOT / "serve_config.yaml"
# The float32 `transformers` target drafted by llama.cpp: what the engine-level suites and tests measure.
CPU_EXACT_CONFIG = REPO_ROOT / "configs" / "cpu-exact.yaml"


@dataclass
class ServeFile:
    app_name: str
    route_prefix: str
    args: AppArgs
    deployment_options: dict[str, dict[str, Any]]
    http_host: str
    http_port: int
    env_vars: dict[str, str]
    logging_config: dict[str, Any]
    controller_options: dict[str, Any] = field(default_factory=dict)  # Serve's controller actor (its env vars)


def load_serve_config(path: str | Path = DEFAULT_SERVE_CONFIG, app_index: int = 0) -> ServeFile:
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load(Path(path).read_text())
    schema = ServeDeploySchema.model_validate(raw) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(raw)
    app = schema.applications[app_index]
    args = AppArgs.model_validate(app.args)
    options: dict[str, dict[str, Any]] = {}
    for dep in raw["applications"][app_index].get("deployments", []):
        dep = dict(dep)
        options[dep.pop("name")] = dep
    check_file(args, options)
    http = raw.get("http_options", {})
    return ServeFile(
        app_name=app.name,
        route_prefix=app.route_prefix or "/",
        args=args,
        deployment_options=options,
        http_host=http.get("host", "127.0.0.1"),
        http_port=int(http.get("port", 8000)),
        env_vars=dict((app.runtime_env or {}).get("env_vars", {})),
        logging_config=dict(raw.get("logging_config", {})),
        controller_options=dict(raw.get("controller_options") or {}),
    )
