"""What admission turns away, and why. The ingress maps each kind to its HTTP status."""

from __future__ import annotations

from typing import Any, Literal

Kind = Literal["invalid", "forbidden", "over_rate", "shed"]


class AdmissionError(Exception):
    """A request admission refuses: `invalid` (a bad tier or mode header), `forbidden` (a
    tier the key may not use), `over_rate` (the tenant's rate limit) or `shed` (it can't be
    served in time). `details` go to the client with the message. `tenant_limit`: refused for
    the tenant's own limit (its rate, its share of the queue), not for the service's load."""

    def __init__(
        self, kind: Kind, message: str, code: str, *, param: str | None = None,
        retry_after_s: int | None = None, details: dict[str, Any] | None = None, tenant_limit: bool = False,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s
        self.details = details or {}
        self.tenant_limit = tenant_limit
