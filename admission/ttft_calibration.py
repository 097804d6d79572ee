"""How late first tokens come against admission's predictions, learned from every admitted
request: a mean bias per model that scales its predictions, and the recent tail of lateness a
first token must have to spare (a TTFT target is a tail bound, and a mean bias leaves half the
misses in place)."""

from __future__ import annotations

import collections
import math
import time

from admission.estimates import Ewma

# Observed / predicted time to first token, learned from every admitted request, scales the
# TTFT predictions within these bounds: the estimates are per concurrency level and miss what
# else loads the box, or count a wait that did not come. Right at the median, so averaged in log
# terms: the ratios are skewed (a first token can come several times late, never below zero), and
# their plain mean scaled most predictions past the first tokens they predict. The tail is
# `ttft_tail_ms`'s.
TTFT_BIAS_BOUNDS = (0.5, 3.0)
# The spare a first token needs against its TTFT target: a high quantile (`ttft_tail_quantile`,
# 0.95) of how late first tokens came against their (scaled) predictions, in ms, over the first
# tokens of the last 30 s (64 at most, from 10 on). Lateness is added, not multiplied: the
# large ratios come on short predictions, and as a factor on every prediction they turned away
# long requests that would have made their targets. Counted without an age limit, the lateness
# of a busy spell (the warm-up's) would shed requests at light load minutes later.
TTFT_TAIL_WINDOW = 64
TTFT_TAIL_MAX_AGE_S = 30.0
TTFT_TAIL_MIN_SAMPLES = 10
TTFT_TAIL_MAX_MS = 2000.0


class TtftCalibration:
    def __init__(self, tail_quantile: float | None = 0.95, clock=time.monotonic) -> None:
        self._clock = clock
        # per model: log(observed / predicted) time to first token once started
        self.ttft_bias: dict[str, Ewma] = {}
        # (when, ms the first token came after its scaled prediction), for `tail_ms`
        self.tail_quantile = tail_quantile
        self.ttft_late: collections.deque[tuple[float, float]] = collections.deque(maxlen=TTFT_TAIL_WINDOW)
        self._tail: float | None = None  # cached until a first token arrives or one ages out

    def bias(self, model_id: str) -> float:
        """Observed / predicted time to first token on this model, lately (its own engine, its
        own errors: the small model's and the target's differ)."""
        low, high = TTFT_BIAS_BOUNDS
        ewma = self.ttft_bias.get(model_id)
        return min(high, max(low, math.exp(ewma.value) if ewma is not None else 1.0))  # starts at log 1

    def tail_ms(self) -> float:
        """How late, at `tail_quantile`, the last 30 s of first tokens came against their
        (scaled) predictions, in ms: a first token must be predicted in time with this to spare."""
        while self.ttft_late and self.ttft_late[0][0] < self._clock() - TTFT_TAIL_MAX_AGE_S:
            self.ttft_late.popleft()
            self._tail = None
        if self._tail is None:
            self._tail = 0.0
            if self.tail_quantile is not None and len(self.ttft_late) >= TTFT_TAIL_MIN_SAMPLES:
                ordered = sorted(late for _, late in self.ttft_late)
                late = ordered[int(self.tail_quantile * (len(ordered) - 1))]
                self._tail = min(TTFT_TAIL_MAX_MS, max(0.0, late))
        return self._tail

    def learn(self, model_id: str, observed_s: float, predicted_s: float, scale: float) -> None:
        """A first token came `observed_s` after its start, predicted at `predicted_s` unscaled
        (its prediction was scaled by `scale`)."""
        if predicted_s > 0:  # against the unscaled prediction, or the bias would chase itself
            # From 1 (no error known yet), not from the first sample: the first requests after a
            # start meet a cold box, and one first token 4x late set every later prediction of
            # that model at 3x, shedding requests at light load until it wore off.
            ratio = min(4.0, max(0.1, observed_s * scale / predicted_s))
            self.ttft_bias.setdefault(model_id, Ewma(0.2, value=0.0)).add(math.log(ratio))
            self.ttft_late.append((self._clock(), (observed_s - predicted_s) * 1000))
            self._tail = None
