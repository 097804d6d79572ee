"""How one deployment's handle reaches another's replicas.

Serve's default is a Ray actor call. With `_by_reference=False` the handle talks to the
replica's own gRPC server instead: a cheaper hop, alone and in flight with others, and a
streamed reply's first item comes sooner (`python -m bench hops` compares them side by side).
Results come back by value either way; nothing in this graph passes object refs between
deployments.
"""

from __future__ import annotations

from ray.serve.handle import DeploymentHandle


def over(handle: DeploymentHandle, transport: str) -> DeploymentHandle:
    """The handle, set to call its deployment over `transport`."""
    if transport == "grpc":
        return handle.options(_by_reference=False)
    return handle
