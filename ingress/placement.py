"""Where a request runs and when: the router's verdict (difficulty), the model choice's moves
(admission/model_choice.py: load, deadline, crowding), and admission's slot (start, queue or
shed). Every decision here is in-process against state synced off the request path; the only
wait is the router's embedding, bounded by `admission.verdict_wait_ms` on a busy box."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from admission.arrivals import Arrival
from admission.gate import AdmissionGate, Ticket
from admission.model_choice import MOVES, ModelChoice
from admission.policy import AdmissionPolicy
from configs.schemas import AppArgs
from ingress.cache_client import CacheClient, CacheState
from ingress.errors import describe
from ingress.prepare import Prepared
from router.base import RouteDecision
from router.factory import make_router
from router.load import LoadTracker
from router.rules import fixed_route

log = logging.getLogger(__name__)

# How often a request waiting for the router on an idle box checks that it still is.
RECHECK_S = 0.01


class Permit:
    """An admission slot, released exactly once whoever gets there first. `model_load` is the
    router's in-flight count of the model the request runs on, released with the slot."""

    def __init__(self, gate: AdmissionGate | None, ticket: Ticket | None = None) -> None:
        self._gate = gate
        self._ticket = ticket
        self._released = False
        self._loads: list[tuple[LoadTracker, str]] = []

    def count_on(self, load: LoadTracker, model_id: str) -> None:
        """Count the request on `load` (router/load.py's LoadTracker) until the slot is released."""
        load.started(model_id)
        self._loads.append((load, model_id))

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._gate is not None and self._ticket is not None:
                self._gate.release(self._ticket)
            for load, model_id in self._loads:
                load.finished(model_id)


@dataclass(frozen=True)
class Admitted:
    """Where a request runs, and its slot there: admission's answer."""

    permit: Permit
    decision: RouteDecision  # the model that answers, and why
    ticket: Ticket | None  # its admission slot (predictive mode)
    at: float  # perf_counter() when admitted; model-side times count from here

    def notes(self) -> dict[str, str]:
        """Response headers: a move off the model the router chose (admission/model_choice.py),
        and the gate's promise, so a client (and bench load) can hold it to it."""
        notes = {}
        if self.decision.reason in MOVES:
            notes["x-admission"] = MOVES[self.decision.reason]
        if self.ticket is not None:
            t = self.ticket
            notes["x-admission-predicted"] = (
                f"ttft_ms={(t.first_at - t.arrived) * 1000:.0f}; e2e_ms={(t.finish_at - t.arrived) * 1000:.0f}"
            )
        return notes


class Placement:
    def __init__(self, args: AppArgs, admission: AdmissionPolicy, backends, cache: CacheClient) -> None:
        self.args = args
        self.admission = admission
        self.gate = admission.gate
        self.backends = backends
        self.cache = cache  # the request's embedding, for a router that wants one
        self.large, self.small = args.target.engine.model_id, args.draft.engine.model_id
        # Built here even with placement: remote, to know which requests need the embedding.
        self.router = make_router(args.router, self.large, self.small)
        self.load = LoadTracker(args.router.load_aware, self.large, self.small)
        # Where an auto request runs, once the router has judged it.
        self.choice = ModelChoice(self.gate, self.large, self.small, args.host_tuning.small_from)
        self.gate.shared_cores = args.host_tuning.enabled
        self.route_counts: dict[str, int] = {}  # "model/reason" -> requests

    def _auto(self, p: Prepared) -> bool:
        return p.requested_model == self.args.router.auto_model_id

    def shed_hopeless(self, p: Prepared) -> tuple[RouteDecision | None, list[Ticket]]:
        """Hopeless for every model that could answer: shed now, before waiting on the lookup
        or routing (the hop in flight is cancelled), so a shed costs microseconds even under
        load; even a would-be cache hit is shed. Returns a decision admission already forces
        (only the small model can take it), and the candidates' tickets."""
        if p.mode != "predictive":
            return None, []
        models = [self.large, self.small] if self._auto(p) else [p.requested_model]
        if self._auto(p) and not p.tier.downgrade and fixed_route(self.args.router, p.features, self.large) is not None:
            models = [self.large]  # too big for the small model, and no downgrade: only large counts
        tickets = [self.admission.ticket(m, p.ctx, p.tier, p.prompt_ids, p.sampling.max_tokens) for m in models]
        return self.only_small(p, self.admission.shed_early(tickets)), tickets

    def arrival(self, tickets: list[Ticket]) -> Arrival | None:
        """Count a request admission priced (`shed_hopeless`) as about to run until it is placed,
        where the busy-box move is on: a request placed meanwhile runs beside it."""
        return self.gate.arrivals.arrive() if tickets and self.choice.busy_from is not None else None

    def only_small(self, p: Prepared, feasible: list[bool]) -> RouteDecision | None:
        """Only the small model of an auto request's two can take it: with downgrade allowed,
        admission would send it there whatever the router says, so it goes now, without waiting
        for the router's embedding; without, the router's verdict alone decides between serving
        and shedding. None: the router decides."""
        if not self._auto(p) or not self.choice.only_small(feasible, downgrade=p.tier.downgrade):
            return None
        return RouteDecision(self.small, "deadline_downgrade")

    async def route(self, p: Prepared, cache: CacheState) -> RouteDecision:
        features = p.features
        try:
            if features.last_user_message and self.router.wants_embedding(features):
                vector = await self.cache.embedding(p, cache, self.stage_timeout(p))
                features = dataclasses.replace(features, vector=vector)
            t = time.perf_counter()
            try:
                if self.args.router.placement == "inline":
                    return self.router.route(features)
                return await asyncio.wait_for(self.backends.route(features), self.stage_timeout(p))
            finally:
                cache.clock.detail("route.decide", t)  # the routing itself, beyond the shared embedding
        except Exception as exc:  # router down: the target can answer anything
            log.warning("router failed, using the target model: %s", self._why(exc))
            return RouteDecision(self.large if self._auto(p) else p.requested_model, "router_unavailable")

    async def await_verdict(self, p: Prepared, routing: asyncio.Future, tickets: list[Ticket]) -> RouteDecision | None:
        """Wait for the router `verdict_wait_ms`, and longer only while the box is idle. On a
        loaded box the embedding can take longer than that wait, and a request that waited for
        it, feasible at arrival, could be shed later because the box filled up meanwhile. So once
        the wait is over, and the box is busy, the request commits against what it can take now:
        none of the models, shed; only the small one, downgrade (returned) or, where the tier
        forbids it, shed; the large one (or the model it named), routed there without the
        verdict ("router_late"; admission may still downgrade it). An idle box keeps waiting
        (checked every RECHECK_S): a long prompt's embedding takes longer than the wait even
        there, and nothing competes for its slot. None: the router answered."""
        wait_s = self.args.admission.verdict_wait_ms / 1000
        while True:
            await asyncio.wait({routing}, timeout=wait_s)
            if routing.done():
                return None
            feasible = self.admission.shed_early(tickets)  # raises if no model can take it now
            forced = self.only_small(p, feasible)
            if forced is not None:
                return forced
            if feasible == [False, True]:
                raise self.admission.shed_undecided(tickets[0], (time.monotonic() - p.ctx.received) * 1000)
            if not self.idle():
                # The router's safe choice without an embedding, as when the embedder is down.
                return RouteDecision(tickets[0].model_id, "router_late")
            wait_s = RECHECK_S

    async def admit(self, p: Prepared, decision: RouteDecision) -> Admitted:
        """Start, queue or shed (503); downgrade to the small model when only it can make the
        deadline and the tier allows it. fifo mode admits everything, in arrival order."""
        decision = self._moved_by_load(p, decision)
        if p.mode == "fifo":
            return Admitted(Permit(None), decision, None, time.perf_counter())
        ticket = self.admission.ticket(decision.model_id, p.ctx, p.tier, p.prompt_ids, p.sampling.max_tokens)
        if self._auto(p) and decision.model_id in (self.large, self.small):
            other = self.small if decision.model_id == self.large else self.large
            alt = self.admission.ticket(other, p.ctx, p.tier, p.prompt_ids, p.sampling.max_tokens)
            choice = self.choice.choose(ticket, alt, downgrade=p.tier.downgrade)
            ticket = choice.ticket
            if choice.reason is not None:  # the classifier's score stays in the header beside the move
                decision = RouteDecision(ticket.model_id, choice.reason, decision.p_hard, decision.threshold)
        await self.admission.admit(ticket)
        return Admitted(Permit(self.gate, ticket), decision, ticket, time.perf_counter())

    def _moved_by_load(self, p: Prepared, decision: RouteDecision) -> RouteDecision:
        """An auto request the classifier judged: the threshold moved by live load may send it to
        the other model; the router itself judges difficulty only."""
        if not self._auto(p) or decision.p_hard is None or decision.threshold is None:
            return decision
        c = self.args.router.classifier
        shifted = self.choice.by_load(decision.model_id, decision.p_hard, decision.threshold, self.load.threshold_shift(),
                                      (c.min_threshold, c.max_threshold))
        if shifted is None:
            return decision
        model_id, reason, threshold = shifted
        return RouteDecision(model_id, reason, decision.p_hard, threshold)

    def overlap_lookup(self) -> bool:
        """Start the model before the cache lookup returns? `idle`: only while nothing runs on
        any model, here or (as last synced) in another ingress, so a hit's wasted prefill
        delays no one; under load the lookup is short against the queue anyway."""
        mode = self.args.ingress.overlap_cache_lookup
        return self.idle() if mode == "idle" else mode

    def idle(self) -> bool:
        """No model runs anything: this ingress's count and the others', as last synced."""
        return self.gate.concurrency() == 0 and not any(s.inflight for s in self.load.stages.values())

    def count(self, decision: RouteDecision) -> None:
        key = f"{decision.model_id}/{decision.reason}"
        self.route_counts[key] = self.route_counts.get(key, 0) + 1

    def stats(self) -> dict[str, Any]:
        downgrades = sum(n for k, n in self.route_counts.items() if k.endswith("/load_downgrade"))
        return {"routes": dict(self.route_counts), "load_downgrades": downgrades, "load": self.load.snapshot()}

    def stage_timeout(self, p: Prepared) -> float:
        return max(0.001, p.ctx.remaining_s(self.args.ingress.stage_timeout_s))

    def _why(self, exc: BaseException) -> str:
        return describe(exc, with_message=self.args.ingress.log_prompts)
