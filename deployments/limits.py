"""A replica checks its own Serve options against its stage's settings at start
(configs/limits.py): `serve run` applies the YAML's `deployments:` entries after the app is
built, so only the running replica sees both."""

from __future__ import annotations

from ray import serve


def own_max_ongoing_requests() -> tuple[str, int] | None:
    """This replica's deployment name and `max_ongoing_requests`; None outside a replica (a test
    that builds the class itself)."""
    try:
        context = serve.get_replica_context()
        return context.deployment, context._deployment_config.max_ongoing_requests
    except Exception:
        return None
