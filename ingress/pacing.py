"""A refusal for the tenant's own limit (over its rate: 429; over its share of the queue: 503
queue_full) is sent after a pause of up to `ingress.over_limit_hold_s`.

A client that retries such a refusal without pausing (a retry loop without backoff, an agent
that treats every error alike) otherwise costs the box a refusal per round trip, hundreds a
second from one connection: reading, tokenizing and refusing its requests then takes the cores
from the tenants within their limits. Held, its refusals come at most one a hold per
connection. The hold is taken out of the refusal's Retry-After, so a client that waits as told
retries no later than it would have. A shed for the service's load is not held: a request the
service can't serve in time is told so at once.
"""

from __future__ import annotations

import asyncio
import math

from admission.errors import AdmissionError


async def paced(err: AdmissionError, hold_s: float) -> AdmissionError:
    """`err` after the hold where it refuses a tenant for its own limit, its Retry-After
    shortened by as much; any other refusal at once, unchanged."""
    if not err.tenant_limit or hold_s <= 0 or not err.retry_after_s:
        return err
    held = min(hold_s, float(err.retry_after_s))
    await asyncio.sleep(held)
    left = max(0, math.ceil(err.retry_after_s - held))
    details = {**err.details, "retry_after_s": left} if "retry_after_s" in err.details else err.details
    return AdmissionError(err.kind, err.message, err.code, param=err.param, retry_after_s=left, details=details,
                          tenant_limit=True)
