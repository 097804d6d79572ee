"""The ingress's admission policy: tiers, deadlines, tenant limits and the gate, in one place.

Everything here runs in-process on the request path (no hop); the controller only syncs the
service-wide shares and the fleet's load in the background (admission/sync.py).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Literal, Mapping

from admission.estimates import Observation, ServiceEstimates
from admission.gate import AdmissionGate, Rejection, Ticket
from admission.limits import OverLimit, TenantLimiter
from admission.prefix_memory import PrefixMemory
from configs.schemas import AdmissionConfig, TierConfig
from admission.errors import AdmissionError
from admission.request import RequestContext

Mode = Literal["predictive", "fifo"]
OUTBOX_KEPT = 512  # completions kept for the controller between syncs


class AdmissionPolicy:
    def __init__(self, config: AdmissionConfig, own_buckets: Iterable[str] | None = None) -> None:
        self.config = config
        self.estimates = ServiceEstimates(
            config.prior_itl_ms, config.prior_prefill_ms_per_token, config.estimate_max_age_s,
            config.estimate_half_life_s,
        )
        self.gate = AdmissionGate(
            config.max_inflight, config.max_queued, config.retry_after_s, self.estimates, config.safety,
            ttft_tail_quantile=config.ttft_tail_quantile, tenant_share=config.tenant_share,
        )
        self.limiter = TenantLimiter(config, own_buckets=own_buckets)
        self.prefixes = PrefixMemory()
        # model id -> (its deployment, sequences one replica holds): llama.cpp's KV contexts.
        self.seats_per_replica: dict[str, tuple[str, int]] = {}
        # Completions not yet sent to the controller for the other ingress replicas to learn
        # from; bounded, so a controller away for long costs the oldest, not memory.
        self.outbox: deque[Observation] = deque(maxlen=OUTBOX_KEPT)
        self.synced_at: float | None = None  # when the controller's view last arrived
        self.max_view_age_ms = 0.0  # the stalest the view got between two syncs

    # ------------------------------------------------------------------ per request

    def mode(self, headers: Mapping[str, str]) -> Mode:
        asked = headers.get("x-admission-mode")
        if asked and self.config.allow_mode_header:
            if asked not in ("predictive", "fifo"):
                raise AdmissionError("invalid", "x-admission-mode must be predictive or fifo", "invalid_request",
                                     param="x-admission-mode")
            return asked  # type: ignore[return-value]
        return self.config.mode

    def tier(self, ctx: RequestContext) -> TierConfig:
        """The request's tier (header, else the tenant's, else the default) and its deadlines."""
        owner = ctx.tenant.split("/", 1)[0]
        limits = self.config.tenant(owner)
        if ctx.tier_from_header:
            if ctx.tier not in self.config.tiers:
                raise AdmissionError(
                    "invalid", f"unknown SLO tier {ctx.tier!r}; this service has: {', '.join(self.config.tiers)}",
                    "invalid_request", param="x-slo-tier",
                )
            if limits.allowed_tiers is not None and ctx.tier not in limits.allowed_tiers:
                raise AdmissionError(
                    "forbidden", f"this API key may not use the {ctx.tier!r} tier", "tier_not_allowed", param="x-slo-tier"
                )
        else:
            ctx.tier = limits.tier or self.config.default_tier
        tier = self.config.tiers[ctx.tier]
        ctx.target_deadline = ctx.deadline or ctx.received + tier.e2e_ms / 1000
        if tier.ttft_ms is not None:
            ctx.ttft_deadline = ctx.received + tier.ttft_ms / 1000
        return tier

    def precheck_tenant(self, ctx: RequestContext) -> None:
        """429 when the tenant has no request left now (charges nothing: `charge_tenant` does)."""
        try:
            self.limiter.precheck(ctx.tenant.split("/", 1)[0])
        except OverLimit as over:
            raise _over_limit(over, ctx) from None

    def charge_tenant(self, ctx: RequestContext, tokens: int) -> None:
        """429 when the tenant is over its request or token rate."""
        try:
            self.limiter.check(ctx.tenant.split("/", 1)[0], tokens)
        except OverLimit as over:
            raise _over_limit(over, ctx) from None

    def charge_work(self, ctx: RequestContext, tokens: int) -> None:
        """429 when the tenant's token rate can't pay for work done before its request is
        tokenized (converting its grammar, say), charged before that work starts."""
        try:
            self.limiter.charge_tokens(ctx.tenant.split("/", 1)[0], tokens)
        except OverLimit as over:
            raise _over_limit(over, ctx) from None

    def ticket(self, model_id: str, ctx: RequestContext, tier: TierConfig, prompt_ids: Sequence[int],
               max_tokens: int) -> Ticket:
        keys = self.prefixes.keys(prompt_ids, ctx.cache_salt)
        return Ticket(
            model_id, ctx.tier, tier.priority, len(prompt_ids), max_tokens,
            deadline=ctx.target_deadline, ttft_deadline=ctx.ttft_deadline, tpot_ms=tier.tpot_ms, arrived=ctx.received,
            max_wait=None if tier.max_queue_ms is None else tier.max_queue_ms / 1000,
            tenant=ctx.tenant.split("/", 1)[0], cached_tokens=self.prefixes.cached_tokens(model_id, keys),
            prefix_keys=keys,
        )

    def shed_early(self, candidates: list[Ticket]) -> list[bool]:
        """Shed now, before the cache lookup and routing, when no model that could answer the
        request could take it: under overload the answer comes in microseconds, not after
        the lookup's hops and the embedding. Returns which candidates could take it."""
        rejections = [self.gate.check(t) for t in candidates]
        if candidates and all(r is not None for r in rejections):
            rej = rejections[0]
            assert rej is not None
            raise _shed(candidates[0], self.gate.count(rej))
        return [r is None for r in rejections]

    def shed_undecided(self, large: Ticket, waited_ms: float) -> AdmissionError:
        """The large model can't take the request and its tier may not be downgraded, so the
        router's verdict decides: served small, or shed. No verdict within `verdict_wait_ms`:
        shed now, where waiting for it made the slowest 503s under load."""
        rej = self.gate.reject(
            "deadline_unmeetable",
            f"the large model can't meet this request's deadline at the current load, and the router did not "
            f"decide within {self.config.verdict_wait_ms:.0f} ms whether the small model may take it "
            f"(this tier does not downgrade)",
            large, 0, waited_ms=waited_ms,
        )
        return _shed(large, self.gate.count(rej))

    async def admit(self, ticket: Ticket) -> None:
        """Start, queue (EDF within tier), or 503 with the prediction and a Retry-After."""
        try:
            await self.gate.acquire(ticket)
        except Rejection as rej:
            raise _shed(ticket, rej) from None
        self.prefixes.remember(ticket.model_id, ticket.prefix_keys)

    def observe(self, ticket: Ticket, *, ttft_ms: float, queue_ms: float, prefill_ms: float | None,
                completion_tokens: int, total_ms: float, chunks: int = 0, reused_tokens: int = 0,
                cut_short: bool = False) -> None:
        """A finished request, or one its client left mid-answer (`cut_short`), updates the
        service-time estimates of its model: its prefill is priced by the prompt tokens its engine
        computed (`reused_tokens` came from its prefix cache)."""
        # Filed under what its decode ran beside; without a first token seen, its ends' mean.
        during = self.gate.occupancy.mean_since(ticket.decode_from) if ticket.decode_from else None
        concurrency = during or (ticket.concurrency_at_start + self.gate.concurrency()) / 2
        observation = Observation(ticket.model_id, dict(
            prompt_tokens=max(1, ticket.prompt_tokens - reused_tokens), prefill_ms=prefill_ms, ttft_ms=ttft_ms,
            queue_ms=queue_ms,
            completion_tokens=completion_tokens, max_tokens=ticket.max_tokens, decode_ms=total_ms - ttft_ms,
            concurrency=concurrency, start_concurrency=ticket.concurrency_at_start, chunks=chunks, cut_short=cut_short,
            behind_step=ticket.behind_step, longest_step_ms=self._longest_step_ms(ticket) if ticket.behind_step else None,
        ), tuple(ticket.prefix_keys))
        self.estimates.learn(observation)
        self.outbox.append(observation)

    def take_observations(self) -> list[Observation]:
        """This replica's completions since the last call: for the controller to relay."""
        taken = list(self.outbox)
        self.outbox.clear()
        return taken

    def learn_from_others(self, observations: Iterable[Observation]) -> None:
        """The other ingress replicas' completions: the models' speeds they saw, learned here as
        this replica's own are (the same models, concurrency counted the same way: every replica's),
        and the prompts they sent, which the models' prefix caches now hold: a system prompt that
        reached the engines through another replica is priced here as held, not in full."""
        for observation in observations:
            self.estimates.learn(observation)
            if observation.prefix_keys:
                self.prefixes.remember(observation.model_id, list(observation.prefix_keys))

    def _longest_step_ms(self, ticket: Ticket) -> float:
        """The longest step a prompt started beside running requests could wait for: its own
        model's, or the slowest model's where the models share the cores."""
        models = self.estimates.models.values() if self.gate.shared_cores else [self.estimates[ticket.model_id]]
        return max(e.step_ms(ticket.concurrency_at_start) for e in models)

    def seed_prefill(self, model_id: str, fixed_ms: float, per_token_ms: float) -> None:
        """The prefill cost the model's replica timed at its start: the prior of its
        predictions here until its own prefills are observed."""
        if per_token_ms > 0:
            self.estimates[model_id].seed_prefill(fixed_ms, per_token_ms)

    def seed_itl(self, model_id: str, step_ms_by_batch: dict[int, float]) -> None:
        """The batched decode step the model's replica timed at its start: how its ITL rises
        with concurrency until observed here."""
        self.estimates[model_id].seed_itl(step_ms_by_batch)

    # ------------------------------------------------------------------ the controller's view

    def set_seats(self, seats_per_replica: dict[str, tuple[str, int]], replicas: dict[str, int] | None = None) -> None:
        """The gate's seat limit per model: one replica's sequences times its live replicas
        (one until the controller has counted them)."""
        self.seats_per_replica = dict(seats_per_replica)
        self.gate.seats = {
            model: seats * max(1, (replicas or {}).get(deployment, 1))
            for model, (deployment, seats) in self.seats_per_replica.items()
        }

    def synced(
        self, max_inflight: int, max_queued: int, others_by_replica: dict[str, dict[str, int]], live_replicas: int,
        replicas: dict[str, int] | None = None, others_tenants: tuple[str, ...] = (),
    ) -> None:
        now = time.monotonic()
        if self.synced_at is not None:
            self.max_view_age_ms = max(self.max_view_age_ms, (now - self.synced_at) * 1000)
        self.synced_at = now
        self.gate.set_limits(max_inflight, max_queued, others_by_replica)
        self.gate.shares.ingress_share = 1.0 / max(1, live_replicas)
        self.gate.shares.elsewhere = frozenset(others_tenants)
        self.limiter.share = 1.0 / max(1, live_replicas)
        if replicas:
            self.set_seats(self.seats_per_replica, replicas)

    def snapshot(self) -> dict:
        age = None if self.synced_at is None else round((time.monotonic() - self.synced_at) * 1000, 1)
        gate = self.gate
        return {
            "inflight": gate.inflight,
            "queued": gate.queued,
            "max_inflight": gate.max_inflight,
            "max_queued": gate.max_queued,
            "running_by_model": gate.running_by_model(),
            "others_inflight": dict(gate.others_inflight),
            # the other ingress replicas' prompts in prefill on this node now (node_board.py); null: no board
            "others_prefilling": None if gate.board is None else len(gate.board.others()),
            # requests here past their first checks, waiting to be placed on a model (busy-box move on)
            "arriving": gate.arrivals.count,
            "seats": dict(gate.seats),
            "admitted": gate.admitted,
            "rejected": dict(gate.rejected),
            "ttft_bias": {m: round(gate.bias(m), 3) for m in gate.calibration.ttft_bias},
            "ttft_tail_ms": round(gate.ttft_tail_ms(), 1),
            "estimates": self.estimates.snapshot(),
            "mode": self.config.mode,
            "rate_limited": self.limiter.limited,
            "view_age_ms": age,
            "max_view_age_ms": round(self.max_view_age_ms, 1),
        }


def _shed(ticket: Ticket, rej: Rejection) -> AdmissionError:
    extra: dict = {"queued_ahead": rej.queued_ahead, "waited_ms": round(rej.waited_ms, 1), "tier": ticket.tier,
                   "model": ticket.model_id}  # the model the prediction is for
    if ticket.deadline is not None:
        extra["deadline_ms"] = round((ticket.deadline - ticket.arrived) * 1000)
    if ticket.ttft_deadline is not None:
        extra["ttft_deadline_ms"] = round((ticket.ttft_deadline - ticket.arrived) * 1000)
    if rej.predicted is not None:
        extra["predicted"] = rej.predicted.as_dict()
    if rej.not_now is not None:
        extra["not_started"] = rej.not_now
    return AdmissionError("shed", rej.message, rej.reason, retry_after_s=rej.retry_after_s, details=extra,
                          tenant_limit=rej.tenant_limit)


def _over_limit(over: OverLimit, ctx: RequestContext) -> AdmissionError:
    return AdmissionError(
        "over_rate",
        f"rate limit: this API key is over its {over.limit} rate ({over.rate:g}/s)",
        f"rate_limit_{over.limit}",
        retry_after_s=over.retry_after_s,
        details={"limit": over.limit, "rate_per_s": over.rate, "retry_after_s": over.retry_after_s, "tier": ctx.tier},
        tenant_limit=True,
    )
