"""The per-token target (a tier's `tpot_ms`): does the box keep every stream within its target
with one more sequence on it, and how many running requests must leave before it does?

Past a CPU box's knee another sequence adds no tokens a second, only time to every stream's
tokens: a request that would push a stream past its target waits for one to end instead. Both
models count (they share the cores), each priced at the box's concurrency by its own
estimates. The decode's `safety` is not applied: it pads a deadline, and on the target it held
streams the box ran within their targets until their first tokens were late.
"""

from __future__ import annotations

from collections.abc import Iterable

from admission.estimates import ServiceEstimates
from admission.ticket import Ticket


def targets(tickets: Iterable[Ticket]) -> dict[str, float]:
    """The tightest per-token target among `tickets`, per model (those without one set none)."""
    out: dict[str, float] = {}
    for r in tickets:
        if r.tpot_ms is not None:
            out[r.model_id] = min(r.tpot_ms, out.get(r.model_id, r.tpot_ms))
    return out


def paced(tpot: dict[str, float], estimates: ServiceEstimates, concurrency: float) -> bool:
    """With `concurrency` sequences on the box, is each model's predicted time between tokens
    within the tightest target (`targets`) of the requests on it?"""
    return all(estimates[m].itl_ms(concurrency) <= ms for m, ms in tpot.items())


def departures_needed(tpot: dict[str, float], estimates: ServiceEstimates, concurrency: int) -> int:
    """How many of the box's sequences must end before `concurrency` less that many is paced
    (0: it is now). The time between tokens is not assumed to fall with every departure (the
    levels are learned apart), so each count is tried from the fewest up."""
    levels = [float(concurrency - k) for k in range(concurrency)]
    over = [False] * concurrency
    for m, ms in tpot.items():
        for k, itl in enumerate(estimates[m].itl_ms_each(levels)):
            over[k] = over[k] or itl > ms
    return next((k for k, late in enumerate(over) if not late), concurrency)
