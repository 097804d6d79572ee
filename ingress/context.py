"""A request's context from its headers: request id, tenant, SLO tier, deadline, cache control."""

from __future__ import annotations

import re
import time
import uuid
from typing import Mapping

from admission.request import RequestContext
from admission.tenant import ANONYMOUS, key_hash, owner_of_hash
from ingress.auth import Caller, bearer_key
from ingress.errors import bad_request

_TOKEN = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
DEFAULT_TIER = "standard"  # until the policy resolves the tenant's or the configured default


def tenant_from_headers(headers: Mapping[str, str], caller: Caller | None = None) -> str:
    """The key's tenant (a hash of the bearer key, never the key itself; else anonymous), or
    `caller`'s where the key ring already identified it; `x-tenant` names a namespace *inside*
    it, so a header can never reach another key's cached answers."""
    explicit = headers.get("x-tenant")
    if explicit and not _TOKEN.match(explicit):
        raise bad_request("x-tenant must be 1-64 characters of [A-Za-z0-9_.:-]", "x-tenant")
    if caller is not None:
        owner = caller.owner
    else:
        key = bearer_key(headers)
        owner = owner_of_hash(key_hash(key)) if key is not None else ANONYMOUS
    return f"{owner}/{explicit}" if explicit else owner


def context_from_headers(headers: Mapping[str, str], caller: Caller | None = None) -> RequestContext:
    client_id = headers.get("x-request-id")
    asked_tier = headers.get("x-slo-tier") or headers.get("x-priority")
    tier = asked_tier or DEFAULT_TIER
    if not _TOKEN.match(tier):
        raise bad_request("x-slo-tier must be 1-64 characters of [A-Za-z0-9_.:-]", "x-slo-tier")
    deadline = None
    raw = headers.get("x-request-deadline-ms")
    if raw is not None:
        try:
            budget_ms = float(raw)
        except ValueError:
            raise bad_request("x-request-deadline-ms must be a number of milliseconds", "x-request-deadline-ms")
        if not (0 < budget_ms <= 24 * 3600 * 1000):
            raise bad_request("x-request-deadline-ms must be > 0 and at most a day", "x-request-deadline-ms")
        deadline = time.monotonic() + budget_ms / 1000
    cache_control = headers.get("cache-control", "").lower()
    return RequestContext(
        request_id=uuid.uuid4().hex,
        client_request_id=client_id if client_id and _TOKEN.match(client_id) else None,
        tenant=tenant_from_headers(headers, caller),
        admin=caller is not None and caller.admin,
        tier=tier,
        tier_from_header=asked_tier is not None,
        deadline=deadline,
        no_cache="no-cache" in cache_control,
        no_store="no-store" in cache_control,
        cache_sampled=headers.get("x-cache-sampled", "").strip().lower() == "allow",
    )
