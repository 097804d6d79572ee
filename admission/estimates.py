"""Online service-time statistics per model, updated from real completions.

A request's time in the model is prefill (a fixed part per pass plus ms per prompt token) plus
one decode step per output token. On a batching engine a step's cost depends on how many
sequences share it, so the inter-token latency is kept per concurrency level (1, 2, 4, 8, ... in
flight). The ITL observed at the client already includes speculative decoding's live acceptance
rate: more tokens accepted per round is a lower ITL. Each ingress replica learns from every
replica's completions (relayed by the controller: admission/sync.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from admission.output_length import OutputLengths

PRIOR_OUTPUT_FRACTION = 0.5  # of max_tokens, until observed
BATCH_COST = 0.5  # share of a step's cost each extra sequence adds, where not observed
MAX_AGE_S = 30.0  # a concurrency level not observed for this long starts to fade (see ByConcurrency)
STALE_HALF_LIFE_S = 90.0  # ... halving its (log) distance from the extrapolation this often
LIGHT_CONCURRENCY = 2  # prefills started with at most this many in flight price a pass's fixed part
PREFILL_LEVEL_MIN_TOKENS = 32  # computed prompt tokens a level's prefill cost starts from (ByConcurrency)
SNAPSHOT_BUDGETS = (16, 64, 256)  # max_tokens the snapshot shows the expected output of


def _bucket(concurrency: float) -> int:
    """1, 2, 4, 8, ...: the power of two nearest the concurrency (in log terms)."""
    return 1 << max(0, round(math.log2(max(1.0, concurrency))))


@dataclass
class Ewma:
    """An exponentially weighted mean. A sample's `weight` scales its say against the mean weight
    of recent ones: a ratio measured over many units (a prompt's tokens) counts for more than one
    measured over a few, whose noise the division magnifies."""

    alpha: float
    value: float | None = None
    samples: int = 0
    weight: float = 1.0  # the mean weight of recent samples (a starting value counts as one sample)

    def add(self, x: float, weight: float = 1.0) -> None:
        if self.value is None:
            self.value, self.weight = x, weight
        else:
            mean_weight = self.weight + self.alpha * (weight - self.weight)
            self.value += self.alpha * weight / mean_weight * (x - self.value)
            self.weight = mean_weight
        self.samples += 1


@dataclass
class ByConcurrency:
    """A cost per concurrency level (1, 2, 4, 8, ...), learned online. Between observed levels:
    interpolated; below the lowest: the lowest's; above the highest (or with nothing observed,
    from the prior): as the `shape` rises, where the model's replica timed its batched step
    (`seed`), else each added sequence is assumed to add half the cost again. A batching engine's
    step costs far less than that per added sequence: priced by the guess, an ingress that had
    not yet seen a model at some load held its requests at the head of the queue for seconds,
    for a per-token target the model met with room to spare, and never learned otherwise.

    A level last observed over `max_age_s` ago fades toward the extrapolation from the fresh
    levels: its log-distance from it halves every `half_life_s`. Kept as it was, one bad spell
    (a replica restarting beside the models, hogging the cores) leaves a level priced so high
    that admission never runs that many requests again, so it is never observed again either:
    the service stays at one request at a time for good. Dropped outright, a level learned under
    real load is replaced by the optimistic extrapolation after a quiet minute, and the next
    burst over-admits. Fading in log space does both: with the defaults a 67x outlier is down
    to 14x a minute after it went stale and to 5x after two, while a true 2.4x still counts as
    1.6x after a minute and a half; a level observed again counts at once.

    A level holds every sample from 0.71x to 1.41x its number, so its cost is placed at the mean
    concurrency its samples were taken at (`where`), not at the number: at a steady load of 10
    the "8" level holds the cost of 10, and read as the cost of 8 it priced a load of 8 as slow
    as one of 10.

    A level starts (or, gone stale, starts over) once its samples weigh `min_weight` between
    them, from their weighted mean; until then its load is priced from the other levels (a
    stale level goes on fading toward them). Started by one
    sample, a level is that sample: a prompt whose prefix the engine held, a token or two
    computed in a pass that waited behind another engine's, priced a level's prefill per token
    at that whole pass, and every prompt after it at that load was predicted past a standard
    request's deadline and shed.
    """

    levels: dict[int, Ewma] = field(default_factory=dict)
    where: dict[int, Ewma] = field(default_factory=dict)  # per level: the mean concurrency of its samples
    updated: dict[int, float] = field(default_factory=dict)
    max_age_s: float = MAX_AGE_S
    half_life_s: float = STALE_HALF_LIFE_S
    clock: Callable[[], float] = time.monotonic
    shape: list[tuple[int, float]] = field(default_factory=list)  # measured cost by level, ascending
    min_weight: float = 0.0  # a level's samples' weight before it starts (0: its first sample)
    # Per level not (freshly) started: its samples so far, (when the first came, sum of weight x
    # value, of weight, of weight x concurrency, count).
    pending: dict[int, tuple[float, float, float, float, int]] = field(default_factory=dict)

    def seed(self, by_level: dict[int, float]) -> None:
        """The cost by concurrency level as measured once (a batched step of n sequences): the
        prior with nothing observed, and how it rises above the highest level observed."""
        self.shape = sorted((int(b), float(v)) for b, v in by_level.items() if v > 0)

    def add(self, concurrency: float, value: float, weight: float = 1.0) -> None:
        level, now, at = _bucket(concurrency), self.clock(), max(1.0, concurrency)
        if level in self.levels and now - self.updated.get(level, now) <= self.max_age_s:
            self.levels[level].add(value, weight)
            self.where.setdefault(level, Ewma(0.2)).add(at, weight)
            self.updated[level] = now
            return
        # A new level, or a forgotten one, starts over from what it measures now.
        first, wx, w, wc, n = self.pending.get(level, (now, 0.0, 0.0, 0.0, 0))
        if now - first > self.max_age_s:
            first, wx, w, wc, n = now, 0.0, 0.0, 0.0, 0
        wx, w, wc, n = wx + weight * value, w + weight, wc + weight * at, n + 1
        if w < self.min_weight or w <= 0:
            self.pending[level] = (first, wx, w, wc, n)
            return
        self.pending.pop(level, None)
        self.levels[level] = Ewma(0.2, wx / w, n, w / n)
        self.where[level] = Ewma(0.2, wc / w, n, w / n)
        self.updated[level] = now

    def _at(self, level: int) -> float:
        """The mean concurrency of the level's samples (its number until it has one)."""
        where = self.where.get(level)
        return where.value if where is not None and where.value is not None else float(level)

    def _levels(self) -> dict[int, float]:
        """Each level's value as `at` uses it (a stale one faded toward the fresh ones)."""
        now = self.clock()
        known = {b: e.value for b, e in self.levels.items() if e.value is not None}
        fresh = {b: v for b, v in known.items() if now - self.updated.get(b, now) <= self.max_age_s}
        if not fresh:
            return known  # nothing newer to fade toward
        points = sorted((self._at(b), v) for b, v in fresh.items())
        out = dict(fresh)
        for b, v in known.items():
            if b not in out:
                expected = _interpolate(points, self._at(b), self.shape)
                weight = 0.5 ** ((now - self.updated[b] - self.max_age_s) / self.half_life_s)
                out[b] = expected * (v / expected) ** weight if expected > 0 and v > 0 else expected
        return out

    def _known(self) -> list[tuple[float, float]]:
        """(the mean concurrency of its samples, its cost) per level, ascending."""
        return sorted((self._at(b), v) for b, v in self._levels().items())

    def at(self, concurrency: float, prior: float) -> float:
        return self.at_each([concurrency], prior)[0]

    def at_each(self, concurrencies: list[float], prior: float) -> list[float]:
        """`at` for each of several concurrencies, the levels read once."""
        known = self._known()
        if not known:
            if self.shape:
                return [_interpolate(self.shape, c) for c in concurrencies]
            return [prior * (1 + BATCH_COST * (max(1.0, c) - 1)) for c in concurrencies]
        return [_interpolate(known, c, self.shape) for c in concurrencies]

    def snapshot(self) -> dict[int, float | None]:
        """Every level's value as `at` uses it (a stale one faded)."""
        live = self._levels()
        return {b: _round(live.get(b)) for b in sorted(self.levels)}


def _interpolate(known: list[tuple[float, float]], concurrency: float, shape: list[tuple[int, float]] | None = None) -> float:
    """Between observed levels: linear; below the lowest: the lowest's; above the highest: the
    highest's, times how much `shape` rises from there (where it has levels that high), and past
    that each added sequence adds BATCH_COST of the cost again."""
    c = max(1.0, concurrency)
    if c <= known[0][0]:
        return known[0][1]
    for (b0, v0), (b1, v1) in zip(known, known[1:]):
        if c <= b1:
            return v0 + (v1 - v0) * (c - b0) / (b1 - b0)
    top, value = known[-1]
    if shape and shape[-1][0] > top:
        rise = _interpolate(shape, c) / _interpolate(shape, top)
        return value * max(1.0, rise)
    return value * (1 + BATCH_COST * (c / top - 1))


@dataclass
class Line:
    """y = intercept + slope * x by least squares over recent points (each older point's weight
    decays by `1 - alpha` per new one). The intercept counts only once the points spread
    enough in x to tell it from the slope, and only where it and the slope are positive:
    otherwise it is 0, and every cost is in the slope. It is at most `max_share` of the mean y:
    a slope lost in noisy points would otherwise price every x alike."""

    alpha: float = 0.05
    min_points: int = 8
    min_spread: float = 0.25  # the x's standard deviation over their mean
    max_share: float = 0.5
    w: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    points: int = 0

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - self.alpha
        self.w, self.sx, self.sy = keep * self.w + 1, keep * self.sx + x, keep * self.sy + y
        self.sxx, self.sxy = keep * self.sxx + x * x, keep * self.sxy + x * y
        self.points += 1

    @property
    def intercept(self) -> float:
        fitted = self.fitted()
        return 0.0 if fitted is None else fitted

    def fitted(self) -> float | None:
        """The intercept, or None while too few points, too alike in x, tell it."""
        if self.points < self.min_points or self.w <= 0:
            return None
        mean_x, mean_y = self.sx / self.w, self.sy / self.w
        var_x = self.sxx / self.w - mean_x * mean_x
        if mean_x <= 0 or var_x <= (self.min_spread * mean_x) ** 2:
            return None
        slope = (self.sxy / self.w - mean_x * mean_y) / var_x
        if slope <= 0:
            return 0.0
        return min(self.max_share * mean_y, max(0.0, mean_y - slope * mean_x))


@dataclass
class ModelEstimates:
    prior_itl_ms: float
    prior_prefill_ms_per_token: float
    # A prefill pass costs a fixed part (the pass, sampling, the hop's bookkeeping) and a part per
    # prompt token. Priced per token alone, a cost learned on short prompts (mostly fixed part)
    # predicted long ones several times too slow and shed them. The fixed part comes from prefills
    # that started on a quiet box (at most LIGHT_CONCURRENCY in flight), where nothing else
    # shares their time; the per-token part is per level, as prefill slows with concurrency as
    # much as decode does on shared cores.
    prefill_fixed: Line = field(default_factory=Line)
    prior_prefill_fixed_ms: float = 0.0  # until the line is fitted: the model replica's own measurement
    prefill_ms_per_token: ByConcurrency = field(default_factory=ByConcurrency)
    overhead_ms: Ewma = field(default_factory=lambda: Ewma(0.2))  # time to first token beyond prefill
    output_lengths: OutputLengths = field(default_factory=OutputLengths)  # how long answers run
    itl: ByConcurrency = field(default_factory=ByConcurrency)
    # Time between a request's chunks: one engine step (a batched decode step, or a speculative
    # round of several tokens). A new request's prefill waits for the step in progress, which
    # for a lone speculating request is several ITLs long.
    step: ByConcurrency = field(default_factory=ByConcurrency)
    # How long a new prompt waited in the model replica's queue for the step in progress (the
    # replica's own measurement), by the requests running beside it. A model draft stops at its
    # next token for a waiting prompt and a round of turns lets it in after the turn under way,
    # so the wait is a verify pass or less: priced as the interval between one request's chunks
    # (a lone speculating request's whole round), first tokens beside a running request are
    # predicted later than they come. Until a wait is observed, one step stands in.
    prompt_wait: ByConcurrency = field(default_factory=ByConcurrency)
    max_age_s: float = MAX_AGE_S
    half_life_s: float = STALE_HALF_LIFE_S

    def __post_init__(self) -> None:
        for by in self.prefill_ms_per_token, self.itl, self.step, self.prompt_wait:
            by.max_age_s, by.half_life_s = self.max_age_s, self.half_life_s
        self.prefill_ms_per_token.min_weight = PREFILL_LEVEL_MIN_TOKENS

    def observe(self, *, prompt_tokens: int, prefill_ms: float | None, ttft_ms: float, queue_ms: float,
                completion_tokens: int, max_tokens: int, decode_ms: float, concurrency: float,
                start_concurrency: float | None = None, chunks: int = 0, cut_short: bool = False,
                behind_step: bool = False, longest_step_ms: float | None = None) -> None:
        """One request's service times. `cut_short`: its client left mid-answer, so its length says
        nothing of the model's (output fraction untouched), while its steps so far were real.
        `behind_step`: it started beside requests running on its model with no prefill ahead of
        it, so its `queue_ms` was the wait for the step in progress, which is at most
        `longest_step_ms` (the slowest model's step at that concurrency: the models share the
        cores). A longer wait was for a prefill this ingress did not know of (an ingress's on
        another node), which no prediction here can see coming: learned as the step's wait, one such prompt
        set a level's wait at many steps, and every prompt after it was predicted that late."""
        if behind_step and start_concurrency is not None:
            wait = queue_ms if longest_step_ms is None else min(queue_ms, longest_step_ms)
            self.prompt_wait.add(start_concurrency - 1, wait)
        if prefill_ms is not None and prompt_tokens > 0:
            level = start_concurrency or concurrency
            if level <= LIGHT_CONCURRENCY:
                self.prefill_fixed.add(prompt_tokens, prefill_ms)
            fixed = min(self.prefill_fixed_ms(), prefill_ms)
            # Weighted by its tokens: a prompt of a few tokens past its prefix cache measures the
            # pass's jitter over a handful of tokens, and as a plain mean of ratios it priced every
            # long prompt after it several times too slow.
            self.prefill_ms_per_token.add(level, (prefill_ms - fixed) / prompt_tokens, weight=prompt_tokens)
            self.overhead_ms.add(max(0.0, ttft_ms - queue_ms - prefill_ms))
        if max_tokens > 0 and not cut_short:
            self.output_lengths.add(completion_tokens, max_tokens)
        if completion_tokens > 1 and decode_ms > 0:
            self.itl.add(concurrency, decode_ms / (completion_tokens - 1))
        if chunks > 0 and decode_ms > 0:
            self.step.add(concurrency, decode_ms / chunks)

    def prefill_ms(self, prompt_tokens: int, concurrency: float = 1.0) -> float:
        per_token = self.prefill_ms_per_token.at(concurrency, self.prior_prefill_ms_per_token)
        return self.prefill_fixed_ms() + per_token * prompt_tokens + (self.overhead_ms.value or 0.0)

    def seed_itl(self, step_ms_by_batch: dict[int, float]) -> None:
        """A decode step of n sequences as the model's replica timed it at its start
        (target/calibration.py: plain_step_ms): the ITL by concurrency until observed here, and
        how it rises above the levels observed."""
        self.itl.seed(step_ms_by_batch)

    def prefill_fixed_ms(self) -> float:
        """A prefill pass's fixed part: fitted, or the prior until it can be."""
        fitted = self.prefill_fixed.fitted()
        return self.prior_prefill_fixed_ms if fitted is None else fitted

    def seed_prefill(self, fixed_ms: float, per_token_ms: float) -> None:
        """Priors from the model's own replica (target/calibration.py: prefill_cost), in place of
        the configured guess until this model's own prefills are observed here."""
        self.prior_prefill_fixed_ms = max(0.0, fixed_ms)
        self.prior_prefill_ms_per_token = per_token_ms

    def expected_tokens(self, max_tokens: int) -> float:
        # Until a few completions are observed, assume half the budget is used.
        if self.output_lengths.samples < 3:
            return max(1.0, PRIOR_OUTPUT_FRACTION * max_tokens)
        return max(1.0, self.output_lengths.expected(max_tokens))

    def itl_ms(self, concurrency: float) -> float:
        """Decode ms/token with this many sequences in flight (on the box)."""
        return self.itl.at(concurrency, self.prior_itl_ms)

    def itl_ms_each(self, concurrencies: list[float]) -> list[float]:
        """`itl_ms` at each of several concurrencies."""
        return self.itl.at_each(concurrencies, self.prior_itl_ms)

    def step_ms(self, concurrency: float) -> float:
        """One engine step with this many sequences in flight (until observed: one ITL)."""
        if not self.step.levels:
            return self.itl_ms(concurrency)
        return max(self.itl_ms(concurrency), self.step.at(concurrency, self.prior_itl_ms))

    def engine_step_ms(self, sequences: float) -> float:
        """One decode step of this many of the model's own sequences, as its replica timed it
        alone at its start (`seed_itl`); until timed, as observed here."""
        return _interpolate(self.itl.shape, sequences) if self.itl.shape else self.step_ms(sequences)

    def expected_rounds(self, max_tokens: int, concurrency: float) -> float:
        """Engine steps a request is expected to take: its tokens, over the tokens a step yields
        at this concurrency (more than one where the model speculates)."""
        itl, step = self.itl_ms(concurrency), self.step_ms(concurrency)
        return self.expected_tokens(max_tokens) * (itl / step if step > 0 else 1.0)

    def prompt_wait_ms(self, concurrency: float) -> float:
        """A new prompt's wait for the step in progress, with this many requests running on the
        box beside it: as observed, or one step until a wait is."""
        if not self.prompt_wait.levels:
            return self.step_ms(concurrency)
        return self.prompt_wait.at(concurrency, self.prior_itl_ms)

    def snapshot(self) -> dict:
        return {
            "step_ms_by_concurrency": self.step.snapshot(),
            "prompt_wait_ms_by_concurrency": self.prompt_wait.snapshot(),
            "prefill_fixed_ms": _round(self.prefill_fixed_ms()),
            "prefill_ms_per_token_by_concurrency": self.prefill_ms_per_token.snapshot(),
            "overhead_ms": _round(self.overhead_ms.value),
            "expected_output_tokens": {m: _round(self.expected_tokens(m)) for m in SNAPSHOT_BUDGETS},
            "itl_ms_by_concurrency": self.itl.snapshot(),
            "itl_seeded_ms_by_concurrency": {b: _round(v) for b, v in self.itl.shape},
            "completions": self.output_lengths.samples,
        }


@dataclass(frozen=True)
class Observation:
    """One request's service times on its model, as `ModelEstimates.observe` takes them: what
    an ingress learns from, its own completions and the other ingress replicas' (admission/sync.py)."""

    model_id: str
    times: dict[str, Any]  # ModelEstimates.observe's keyword arguments
    # The prompt's block keys (admission/prefix_memory.py): its model's engine holds them now, so
    # the other ingress replicas price their prompts that share them by what is left to compute.
    prefix_keys: tuple[int, ...] = ()


class ServiceEstimates:
    """Estimates for every model this ingress sends requests to."""

    def __init__(self, prior_itl_ms: float, prior_prefill_ms_per_token: float, max_age_s: float = MAX_AGE_S,
                 half_life_s: float = STALE_HALF_LIFE_S) -> None:
        self._priors = (prior_itl_ms, prior_prefill_ms_per_token)
        self.max_age_s, self.half_life_s = max_age_s, half_life_s
        self.models: dict[str, ModelEstimates] = {}

    def __getitem__(self, model_id: str) -> ModelEstimates:
        if model_id not in self.models:
            self.models[model_id] = ModelEstimates(*self._priors, max_age_s=self.max_age_s, half_life_s=self.half_life_s)
        return self.models[model_id]

    def learn(self, observation: Observation) -> None:
        self[observation.model_id].observe(**observation.times)

    def snapshot(self) -> dict:
        return {m: e.snapshot() for m, e in self.models.items()}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
