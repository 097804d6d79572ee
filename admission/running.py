"""When the requests already running are expected to be done with the cores: the prompts still
in prefill ahead of a new one, and each request's last token. The gate asks these of its
running tickets for every prediction."""

from __future__ import annotations

from collections.abc import Iterable

from admission.estimates import ModelEstimates
from admission.ticket import Ticket


def prefills_ahead_ms(running: Iterable[Ticket], now: float, model_id: str | None) -> float:
    """How long until the prompts admitted to `model_id` (to any model, where `model_id` is None:
    the models share the cores) but not yet through prefill are done: they run before a new one.
    Each one's predicted first token already counts the prefills that were ahead of it, so the
    latest of them is the wait (a sum counted every earlier prefill again for each later one,
    predicting first tokens many times later than they came). One past its predicted first token
    is still in the engine: expect it to run as late again as it already is (at most its own
    predicted time again), not to end now. Counted as ending now, a long RAG prefill running late
    lets newcomers in that then wait behind it in the engine queue and miss their TTFT."""
    ahead = 0.0
    for r in running:
        if r.prefilled or (model_id is not None and r.model_id != model_id):
            continue
        if r.first_at >= now:
            ahead = max(ahead, r.first_at - now)
        else:
            ahead = max(ahead, min(now - r.first_at, max(0.0, r.first_at - r.started_at)))
    return ahead * 1000


def finish_estimate(r: Ticket, now: float, est: ModelEstimates) -> float:
    """When a running request should end. One past its predicted finish is writing a longer
    answer than expected (output length is a guess): expect it to overrun as long again as it
    already has, though no longer than its max_tokens allow. Expecting it to end `now` queued
    TTFT-tier requests behind it that then passed their latest start and were dropped after a
    long wait, where a shed at arrival takes milliseconds."""
    return expected_end(r.finish_at, longest_end(r, est), now)


def longest_end(r: Ticket, est: ModelEstimates) -> float:
    """The latest a running request can end: its max_tokens at the time between tokens predicted
    at its start."""
    return r.first_at + r.max_tokens * est.itl_ms(r.concurrency_at_start) / 1000


def expected_end(finish_at: float, longest: float, now: float) -> float:
    """`finish_estimate` from a predicted finish and the latest end (another ingress replica's
    request, as its board row says)."""
    if finish_at >= now:
        return finish_at
    return max(now, min(now + (now - finish_at), longest))
