"""Where a `model: auto` request runs: one decision, from the router's verdict and observed state.

The router judges difficulty (router/). Admission knows what the router can't: each model's
predicted wait, first token and finish from live state and its own observed speeds (the gate's
`predicted`), the request's tier and deadlines, and which tenants crowd a model. `ModelChoice`
takes the router's model and the other one and keeps it or moves it, for one reason; the rules,
in the order they apply:

    load_downgrade      a borderline request (its difficulty near the router's threshold) that
    load_upgrade        the threshold moved by each model's live load sends to the other model
                        (`by_load`; before admission, in FIFO mode too); never up on a box
                        whose models share the cores
    busy_box_downgrade  on a small box whose models share the cores (host tuning on): with
                        `busy_from` requests running or about to (arrived with it, waiting for
                        their verdicts), the small model has a free seat and is predicted to
                        finish the request no later than the large one, which would wait for
                        the small model's running streams' steps; both priced at the concurrency
                        the running and arriving requests make
    deadline_downgrade  the large model would shed it, or miss or cut close its deadlines, and
                        the small one would take it in time (tiers with `downgrade` only)
    deadline_upgrade    the small model can't start it in time and the large one can
    tenant_crowded      other tenants hold half or more of the chosen model's seats and the other
                        model is idle (fair share: admission/fair_share.py)

A move down never makes a request slower than staying where the large model still makes its
deadlines: the busy-box move needs the small model's predicted finish at or before the large
one's, and a deadline move happens only where staying would miss.
"""

from __future__ import annotations

from dataclasses import dataclass

from admission.gate import AdmissionGate, Ticket

# The large model keeps a request (in a tier that allows downgrade) when its first token is
# predicted with this much to spare, else the small model takes it if it has as much. An
# upgrade to the large model needs as much: observed first tokens come late against their
# predictions at the tail (docs/admission.md), and a move made on a close call is often wrong.
DOWNGRADE_TTFT_HEADROOM = 1.5

# Why a request left the model the router chose: the reason in `x-route`, and the note in
# `x-admission`.
MOVES = {
    "deadline_downgrade": "downgraded; the large model was predicted to miss the deadline or cut it close",
    "deadline_upgrade": "upgraded; the small model could not take the request at this load",
    "tenant_crowded": "moved; other tenants' requests fill the chosen model and this one is idle",
    "busy_box_downgrade": "downgraded; the box is busy, its models share the cores, and the small model is "
    "predicted to finish sooner",
}


@dataclass(frozen=True)
class Choice:
    ticket: Ticket  # the model it runs on, with its deadlines
    reason: str | None  # a key of MOVES, or None: it stays where the router sent it


class ModelChoice:
    def __init__(self, gate: AdmissionGate, large: str, small: str, busy_from: int | None = None) -> None:
        self.gate = gate
        self.large = large
        self.small = small
        self.busy_from = busy_from  # None: no busy-box moves (host tuning off, GPU profiles)

    def choose(self, routed: Ticket, other: Ticket, *, downgrade: bool) -> Choice:
        """Keep `routed` or move to `other` (the same request on the other model)."""
        reason = None
        if routed.model_id == self.large and downgrade and self._small_sooner_on_busy_box(routed, other):
            routed, other, reason = other, routed, "busy_box_downgrade"
        to_small = routed.model_id == self.large
        if self._deadline_move(routed, other, to_small=to_small, downgrade=downgrade):
            return Choice(other, "deadline_downgrade" if to_small else "deadline_upgrade")
        if self._leave_crowded(routed, other, to_small=to_small, downgrade=downgrade):
            return Choice(other, "tenant_crowded")
        return Choice(routed, reason)

    def by_load(self, model_id: str, p_hard: float, threshold: float, shift: float,
                bounds: tuple[float, float]) -> tuple[str, str, float] | None:
        """The router's difficulty verdict against its threshold moved by live load (router/load.py:
        a busy large model raises it, a busy small one lowers it, within `bounds`): (model,
        `load_downgrade` or `load_upgrade`, the moved threshold) where that flips the verdict, else
        None. Clear-cut requests never move. Where the models take turns for every core (busy-box
        moves on), a busy small model sends nothing up: the large model's free seats are no free
        cores there, and its steps would wait for the small model's streams' at every token, so
        the request would decode slower than where the router sent it. Profiles with the
        busy-box moves off (the small model on one thread beside an engine outside the pass
        lock) keep both directions."""
        low, high = bounds
        moved = min(high, max(low, threshold + shift))
        large_now = p_hard >= moved
        if large_now == (model_id == self.large) or (large_now and self.busy_from is not None):
            return None
        return (self.large, "load_upgrade", moved) if large_now else (self.small, "load_downgrade", moved)

    def only_small(self, feasible: list[bool], *, downgrade: bool) -> bool:
        """Only the small model of the two (large, small) can take the request now: with
        downgrade allowed it goes there whatever the router would say."""
        return feasible == [False, True] and downgrade

    # ------------------------------------------------------------------ rules

    def _small_sooner_on_busy_box(self, large: Ticket, small: Ticket) -> bool:
        gate = self.gate
        if self.busy_from is None or not gate.seat_free(small.model_id):
            return False
        # Requests that arrived with this one run beside it as surely as those running: on an
        # idle box a burst's first verdict would otherwise send a hard request to the large
        # model, and the rest of the burst, moved to the small one, would decode beside it.
        # Both models are priced at the concurrency the burst makes: alone, the speculating
        # large model can be the faster one, and a burst kept there one verdict at a time
        # decodes at the large model's batched speed, or split across both models.
        arriving = gate.arrivals.on_box(gate.board)
        if gate.concurrency() + arriving < self.busy_from:
            return False
        small_finish = gate.predicted(small, beside=arriving).e2e_ms
        return small_finish <= self._large_finish_beside_small(large, small.model_id, arriving)

    def _large_finish_beside_small(self, large: Ticket, small: str, arriving: int = 0) -> float:
        """The large model's predicted finish (ms), each of its steps waiting for a step of the
        streams running on the small model: the engines take turns for the shared cores
        (host_tuning/cores.py), and on a busy box the small model's streams last (new requests
        go there) while the large model's drain. The ITL learned by the box's concurrency holds
        that wait only in the mix of models it was observed at; a request sent to the large model
        beside them pays it at every step. `arriving`: requests about to start beside it."""
        gate = self.gate
        predicted = gate.predicted(large, beside=arriving).e2e_ms
        beside = gate.running_on(small)
        if beside == 0:
            return predicted
        rounds = gate.estimates[large.model_id].expected_rounds(large.max_tokens, gate.concurrency() + 1 + arriving)
        return predicted + rounds * gate.estimates[small].engine_step_ms(beside)

    def _deadline_move(self, routed: Ticket, other: Ticket, *, to_small: bool, downgrade: bool) -> bool:
        """Up to the large model when the small one can't start it now in time (it would queue
        for a seat, be late, or shed it) and the large one can, its first token clearly in time:
        waiting for the small model's seats while the large one has free ones is latency thrown
        away, and a better answer beats a 503. Down to the small model when the large one would
        shed it, or take it but miss its deadlines or cut its first token close: if the small
        one is clearly in time, or would take what the large one would shed."""
        gate = self.gate
        if not to_small:
            return not gate.in_time(routed) and gate.in_time(other, DOWNGRADE_TTFT_HEADROOM)
        if not downgrade or gate.in_time(routed, DOWNGRADE_TTFT_HEADROOM):
            return False
        return gate.in_time(other, DOWNGRADE_TTFT_HEADROOM) or (not gate.would_meet(routed) and gate.would_meet(other))

    def _leave_crowded(self, routed: Ticket, other: Ticket, *, to_small: bool, downgrade: bool) -> bool:
        """Fair share between tenants: a flood on one model does not make another tenant's chat
        wait on its steps while the other model stands idle. Down only for tiers with `downgrade`."""
        if to_small and not downgrade:
            return False
        gate = self.gate
        return gate.crowded_by_others(routed) and gate.model_idle(other.model_id) and gate.in_time(other)
