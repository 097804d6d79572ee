"""Choose, per round, which drafter to use and how many tokens k to draft.

With per-token acceptance a and k drafts, a verify round yields on average
    E(k) = (1 - a^(k+1)) / (1 - a)      tokens (the accepted drafts plus one target token)
and costs  T(k) = k * d + v(k+1)        (d: draft cost per token, v(m): verifying m tokens).
Plain decoding yields 1 token per v(1). Each round we take the (drafter, k) with the best
E(k)/T(k): prompt lookup is free (d = 0) but only sometimes has a match; the draft model costs
d per token but always has a guess. When no plan beats plain decoding, k = 0, with a small
probe now and then to notice when drafts get good again.

Acceptance is estimated per drafter as accepted / (accepted + rejections): drafts are accepted
as a prefix, so `accepted / proposed` would read a = 0.9 at k = 8 as about 0.64.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext


class Ema:
    def __init__(self, value: float, weight: float = 0.2) -> None:
        self.value = value
        self.weight = weight

    def update(self, sample: float) -> None:
        self.value += self.weight * (sample - self.value)


class Acceptance:
    """Per-token acceptance from prefix-accept trials, with exponential forgetting."""

    def __init__(self, prior: float, prior_weight: float = 4.0, decay: float = 0.9) -> None:
        self.accepted = prior * prior_weight
        self.trials = prior_weight
        self.decay = decay

    @property
    def value(self) -> float:
        return self.accepted / self.trials

    def observe(self, proposed: int, accepted: int) -> None:
        rejected = 1 if accepted < proposed else 0
        self.accepted = self.accepted * self.decay + accepted
        self.trials = self.trials * self.decay + accepted + rejected


class CostModel:
    """Replica-wide: what verifying m tokens and drafting one token cost here, and how well
    each drafter has been doing (the prior for new requests)."""

    def __init__(
        self,
        k_max: int,
        verify_ms: list[float],
        draft_ms_per_token: float,
        prior_acceptance: float,
        draft_prefill_ms_per_token: float = 0.0,
        acceptance_priors: dict[str, float] | None = None,
    ) -> None:
        assert len(verify_ms) >= k_max + 1
        self.k_max = k_max
        self.verify = [Ema(ms, weight=0.1) for ms in verify_ms[: k_max + 1]]  # index m-1
        self.draft_per_token = Ema(draft_ms_per_token)
        self.draft_prefill_per_token = draft_prefill_ms_per_token  # a draft catching up on context
        self.prior_acceptance = prior_acceptance
        self.acceptance_priors = dict(acceptance_priors or {})  # per drafter, observed (else the prior)
        self.acceptance: dict[str, Acceptance] = {}
        # As timed at start-up (the EMAs above then follow live rounds).
        self.calibrated = {
            "verify_ms_by_tokens": [round(v.value, 1) for v in self.verify],
            "draft_ms_per_token": round(draft_ms_per_token, 2),
            "draft_prefill_ms_per_token": round(draft_prefill_ms_per_token, 2),
            "acceptance_priors": {k: round(v, 3) for k, v in self.acceptance_priors.items()},
        }

    @classmethod
    def calibrate(
        cls,
        score_fn,
        k_max: int,
        draft_ms_per_token: float,
        prior_acceptance: float,
        draft_prefill_ms_per_token: float = 0.0,
        reps: int = 5,
        acceptance_priors: dict[str, float] | None = None,
        hold: Callable[[], AbstractContextManager] = nullcontext,
    ):
        """Time `score_fn(m)` (a forward pass over m tokens) for m from 1 to k_max+1, each run
        inside `hold()` (the engine's cores to itself: `Engine.alone`).

        Takes the fastest of `reps` runs (interference only ever adds time) and fits a line
        v(m) = a + b*m: a forward pass costs a fixed part plus a per-token part, and a fit
        keeps one noisy sample from mis-pricing a whole range of k. Past the first few sizes a
        line needs only a few more points, so a long k_max does not lengthen the start much.
        """
        ms = sorted(set(range(1, min(k_max, 8) + 2)) | set(range(9, k_max + 2, 4)) | {k_max + 1})
        best = []
        for m in ms:
            samples = []
            for _ in range(reps):
                with hold():
                    start = time.perf_counter()
                    score_fn(m)
                    samples.append((time.perf_counter() - start) * 1000)
            best.append(min(samples))
        n = len(ms)
        mean_m, mean_v = sum(ms) / n, sum(best) / n
        slope = sum((m - mean_m) * (v - mean_v) for m, v in zip(ms, best)) / sum((m - mean_m) ** 2 for m in ms)
        slope = max(slope, 0.0)
        fitted = [max(mean_v + slope * (m - mean_m), best[0] * 0.5) for m in range(1, k_max + 2)]
        return cls(k_max, fitted, draft_ms_per_token, prior_acceptance, draft_prefill_ms_per_token, acceptance_priors)

    def verify_ms(self, m: int) -> float:
        return self.verify[min(m, len(self.verify)) - 1].value

    def observe_verify(self, m: int, ms: float) -> None:
        self.verify[min(m, len(self.verify)) - 1].update(ms)

    def steady_token_ms(self, source: str) -> float:
        """ms per emitted token of a model drafter at its best k, caught up on the context, at
        the replica's acceptance for it: what a request speculating on its own pays."""
        a = min(max(self.replica_acceptance(source).value, 1e-3), 0.999)
        d = self.draft_per_token.value
        return min(
            (k * d + self.verify_ms(k + 1)) * (1 - a) / (1 - a ** (k + 1)) for k in range(1, self.k_max + 1)
        )

    def replica_acceptance(self, source: str) -> Acceptance:
        if source not in self.acceptance:
            prior = self.acceptance_priors.get(source, self.prior_acceptance)
            self.acceptance[source] = Acceptance(prior, prior_weight=4.0, decay=0.98)
        return self.acceptance[source]


class KChooser:
    """Per request: its own acceptance per drafter; the replica's costs."""

    PROBE_EVERY = 8  # plain rounds between probes once speculation was switched off
    PROBE_K = 2
    OBSERVE_STEPS = 6  # steps to watch the free drafters before a model draft pays its catch-up

    def __init__(self, costs: CostModel, enabled: bool = True, fixed_k: int | None = None) -> None:
        self.costs = costs
        self.enabled = enabled
        self.fixed_k = fixed_k
        self._acceptance: dict[str, Acceptance] = {}
        # How often a free drafter (prompt lookup) carries a step: the model draft's one-off
        # catch-up only pays back over the steps the free drafters leave to it.
        self.free_share = Ema(0.5, weight=0.2)
        # ... and what its tokens cost (verify ms per emitted token): where a model draft would
        # be cheaper still, it takes those steps over too once started.
        self.free_token_ms: Ema | None = None
        self.started: set[str] = set()  # model drafters that have ingested the prompt
        self.steps = 0
        self._plain_rounds = 0
        self.rounds = 0
        self.proposed = 0
        self.accepted = 0

    def acceptance(self, source: str) -> float:
        if source not in self._acceptance:
            prior = self.costs.replica_acceptance(source).value
            self._acceptance[source] = Acceptance(prior, prior_weight=2.0, decay=0.8)
        return self._acceptance[source].value

    def plain_rate(self) -> float:
        return 1.0 / self.costs.verify_ms(1)

    def plan(
        self, source: str, cap: int, free: bool, catch_up_tokens: int = 0, remaining: int = 0
    ) -> tuple[int, float]:
        """Best k (<= cap) for this drafter and its expected tokens per ms; (0, plain) if none pays.

        A model drafter that must first ingest `catch_up_tokens` of context (its prompt prefill)
        pays that once: over the `remaining` output budget R its rate is
        R / (catch_up_ms + R * T(k) / E(k)), so it only starts where the one-off cost pays back.
        Once started, what it must catch up on (tokens the free drafters or plain steps emitted
        since its last round) is paid by this round alone.
        """
        if not self.enabled or cap <= 0:
            return 0, self.plain_rate()
        cap = min(cap, self.costs.k_max)
        if self.fixed_k is not None:
            k = min(self.fixed_k, cap)
            return k, float("inf")
        a = min(max(self.acceptance(source), 1e-3), 0.999)
        d = 0.0 if free else self.costs.draft_per_token.value
        # The draft's first pass of a round is counted in d; only the tokens beyond it cost extra
        # (after a fully accepted round there are 2: the last draft and the target's bonus).
        catch_up_ms = 0.0 if free else max(0, catch_up_tokens - 1) * self.costs.draft_prefill_per_token
        horizon, one_off, per_round = max(1, remaining), 0.0, catch_up_ms
        if catch_up_ms > 0 and source not in self.started:
            if self.steps < self.OBSERVE_STEPS:
                return 0, self.plain_rate()  # too early to know whether prompt lookup will carry us
            # It pays back over the steps it would carry: those the free drafters leave to plain
            # decoding, and theirs too where its tokens come cheaper than theirs.
            share = self.free_share.value
            if self.free_token_ms is not None and self._model_token_ms(a, d, cap) < self.free_token_ms.value:
                share = 0.0
            horizon = max(1, int(remaining * (1 - share)))
            one_off, per_round = catch_up_ms, 0.0
        best_k, best_rate = 0, self.plain_rate()
        for k in range(1, cap + 1):
            expected = (1 - a ** (k + 1)) / (1 - a)
            round_ms = per_round + k * d + self.costs.verify_ms(k + 1)
            rate = horizon / (one_off + horizon * round_ms / expected)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k, best_rate

    def _model_token_ms(self, a: float, d: float, cap: int) -> float:
        """A drafter's best ms per emitted token once it has caught up."""
        return min(
            (k * d + self.costs.verify_ms(k + 1)) * (1 - a) / (1 - a ** (k + 1)) for k in range(1, cap + 1)
        )

    def note_step(self, free_used: bool) -> None:
        """Record whether a free drafter carried this step."""
        self.steps += 1
        self.free_share.update(1.0 if free_used else 0.0)

    def should_probe(self) -> bool:
        """Called when no plan beats plain decoding: probe once every PROBE_EVERY such rounds."""
        self._plain_rounds += 1
        if self._plain_rounds >= self.PROBE_EVERY:
            self._plain_rounds = 0
            return True
        return False

    def observe(
        self,
        source: str,
        proposed: int,
        accepted: int,
        draft_ms: float,
        verify_ms: float,
        free: bool = False,
        drafted: int | None = None,
    ) -> None:
        """A round: `proposed` tokens verified in a pass of `verify_ms`, `accepted` of them kept.
        `drafted`: the tokens the drafter made, where a grammar cut its draft to `proposed` (0:
        no pass ran). The draft's time is per token it made: dividing by what survived the cut
        would price the draft several times its cost for every later request on the replica.
        The guesses the grammar forbade are misses for this request only; the replica's prior
        for new requests counts what its target verified, as a request without a grammar sees."""
        drafted = proposed if drafted is None else drafted
        if drafted <= 0:
            return
        self._plain_rounds = 0
        self.rounds += 1
        self.proposed += proposed
        self.accepted += accepted
        self.acceptance(source)
        self._acceptance[source].observe(drafted, accepted)
        if proposed > 0:
            self.costs.replica_acceptance(source).observe(proposed, accepted)
            self.costs.observe_verify(proposed + 1, verify_ms)
        if draft_ms > 0:  # free drafters report 0: they must not drag the model draft's cost down
            self.costs.draft_per_token.update(draft_ms / drafted)
        if free and proposed > 0:
            token_ms = verify_ms / (accepted + 1)
            if self.free_token_ms is None:
                self.free_token_ms = Ema(token_ms, weight=0.3)
            else:
                self.free_token_ms.update(token_ms)
