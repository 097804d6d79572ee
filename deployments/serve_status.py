"""The app's deployments as Serve's controller sees them: status and replicas by state.

`serve.status()` rebuilds every deployment's whole config as pydantic models in the caller,
pickling each request router class again; the controller's raw details carry the same fields
as plain dicts for a small fraction of that CPU. A replica that asks every few seconds for the
life of the service takes the raw path, and `serve.status()` only where the controller's
client is not reachable that way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ray import serve


@dataclass(frozen=True, slots=True)
class DeploymentState:
    healthy: bool
    replicas: dict[str, int] = field(default_factory=dict)  # replica state name -> count


def _name(value) -> str:
    return str(getattr(value, "value", value))


def _from_details(app: str) -> dict[str, DeploymentState]:
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    states: dict[str, DeploymentState] = {}
    for name, d in details["applications"][app]["deployments"].items():
        counts: dict[str, int] = {}
        for replica in d.get("replicas", ()):
            state = _name(replica["state"])
            counts[state] = counts.get(state, 0) + 1
        states[name] = DeploymentState(_name(d["status"]) == "HEALTHY", counts)
    return states


def _from_status(app: str) -> dict[str, DeploymentState]:
    deployments = serve.status().applications[app].deployments
    return {
        name: DeploymentState(_name(d.status) == "HEALTHY", {_name(k): int(v) for k, v in d.replica_states.items()})
        for name, d in deployments.items()
    }


def deployment_states(app: str) -> dict[str, DeploymentState]:
    """Blocking (a controller call): run it in an executor from an event loop."""
    try:
        return _from_details(app)
    except (ImportError, AttributeError, KeyError, TypeError):
        return _from_status(app)


async def deployment_states_async(app: str, timeout_s: float = 10.0) -> dict[str, DeploymentState]:
    loop = asyncio.get_running_loop()
    return await asyncio.wait_for(loop.run_in_executor(None, deployment_states, app), timeout=timeout_s)
