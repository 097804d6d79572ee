"""What admission knows of one request (`Ticket`), what it predicts for it (`Prediction`),
and why it turned one away (`Rejection`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from admission.occupancy import Reading


@dataclass(eq=False)
class Ticket:
    model_id: str
    tier: str
    priority: int  # 0 first
    prompt_tokens: int
    max_tokens: int
    deadline: float | None = None  # time.monotonic() by which the last token must arrive
    ttft_deadline: float | None = None  # ... and the first one
    tpot_ms: float | None = None  # the most time between its tokens (its tier's per-token target)
    arrived: float = field(default_factory=time.monotonic)
    # Set when it starts:
    started_at: float = 0.0
    ttft_scale: float = 1.0  # the bias its TTFT prediction was scaled by
    concurrency_at_start: float = 1.0
    first_at: float = 0.0  # predicted first token
    finish_at: float = 0.0  # predicted last token
    # It started beside requests running on its model, no prefill ahead: its wait in the model
    # replica's queue was for the step in progress (ServiceEstimates.prompt_wait).
    behind_step: bool = False
    prefilled: bool = False  # its first token arrived: its prefill delays no one any more
    decode_from: Reading | None = None  # the box's occupancy when its first token arrived
    max_wait: float | None = None  # seconds it may wait in the queue (its tier's max_queue_ms)
    tenant: str = ""  # whose share it counts against (the API key's tenant)
    cached_tokens: int = 0  # leading prompt tokens its model's prefix cache is expected to hold
    prefix_keys: list[int] = field(default_factory=list)  # its prompt's blocks (admission/prefix_memory.py)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens its prefill is expected to compute."""
        return max(1, self.prompt_tokens - self.cached_tokens)

    @property
    def cost(self) -> int:
        """Tokens it is charged to its tenant's virtual counter when it starts."""
        return self.prompt_tokens + self.max_tokens


@dataclass
class Prediction:
    wait_ms: float
    ttft_ms: float
    e2e_ms: float

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in vars(self).items()}


@dataclass
class Rejection(Exception):
    """Why a request was not admitted. Rendered as 503 + Retry-After + JSON body."""

    reason: str  # "queue_full" | "deadline_unmeetable" | "queue_wait_limit" | "deadline_in_queue" | "queue_timeout"
    message: str
    retry_after_s: int
    queued_ahead: int
    waited_ms: float = 0.0
    predicted: Prediction | None = None
    tenant_limit: bool = False  # refused for its tenant's share, not for the service's load
    not_now: str | None = None  # why it could not start at once (docs/admission.md: `not_started`)
