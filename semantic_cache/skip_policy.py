"""When a semantic match may skip verification, under an error bound (`semantic.mode: bounded`).

Every verified hit is a labelled example: the model either produced the cached answer exactly
(the match was right) or not (it would have been a wrong answer). `SkipPolicy` learns from these
labels when a candidate is safe to serve unverified, so that the probability of serving a wrong
answer stays below `max_error_rate`:

- **A learned similarity threshold, with a confidence bound.** Over the most recent labels, the
  lowest similarity t such that, among the labels at similarity >= t, the one-sided 95% upper
  confidence bound on the failure rate is at most `max_error_rate`. With no failures that
  needs n >= ln(0.05) / ln(1 - bound) labels above t (299 for 1%), so a new deployment verifies
  everything until it has seen enough.
- **Per entry:** a cached answer the model once rejected for a query at similarity s is never
  served unverified at similarity <= s (its neighbourhood is known to hold a different answer).
- **Exploration:** a fraction `explore_rate` of the candidates it would serve are verified anyway,
  so labels keep coming above the threshold, and the rate of wrong answers it would have served
  stays observed (`stats`).

This follows verified semantic caching with learned, per-prompt thresholds under a user-set
error bound (Schroeder et al., "vCache: Verified Semantic Prompt Caching", 2025), simplified to a
pooled threshold with a Wilson upper bound plus per-entry vetoes.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass

Z_95 = 1.6449  # one-sided 95%


def failure_upper_bound(failures: int, n: int) -> float:
    """One-sided 95% upper confidence bound on a failure rate seen as failures/n: exact for no
    failures (1 - 0.05^(1/n)), Wilson's score bound otherwise."""
    if n == 0:
        return 1.0
    if failures == 0:
        return 1.0 - 0.05 ** (1.0 / n)
    p = failures / n
    z2 = Z_95 * Z_95
    centre = p + z2 / (2 * n)
    spread = Z_95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z2 / n))


@dataclass(slots=True)
class _Label:
    score: float
    correct: bool


class SkipPolicy:
    def __init__(self, max_error_rate: float, explore_rate: float = 0.05, window: int = 5000,
                 rng: random.Random | None = None) -> None:
        self.max_error_rate = max_error_rate
        self.explore_rate = explore_rate
        self._labels: deque[_Label] = deque(maxlen=window)
        self._vetoes: dict[str, float] = {}  # entry key -> highest similarity it was rejected at
        self._rng = rng or random.Random()
        self.threshold: float | None = None  # None: nothing is safe to skip yet
        self.counts = {"labels": 0, "failures": 0, "skipped": 0, "explored": 0}

    def serve_unverified(self, score: float, entry_key: str) -> bool:
        """May a match at this similarity to this entry be served as is?"""
        if self.threshold is None or score < self.threshold:
            return False
        if score <= self._vetoes.get(entry_key, -1.0):
            return False
        if self._rng.random() < self.explore_rate:
            self.counts["explored"] += 1
            return False
        self.counts["skipped"] += 1
        return True

    def observe(self, score: float, entry_key: str, correct: bool) -> None:
        """A verification's outcome: did the model produce the cached answer?"""
        self._labels.append(_Label(score, correct))
        self.counts["labels"] += 1
        if not correct:
            self.counts["failures"] += 1
            self._vetoes[entry_key] = max(score, self._vetoes.get(entry_key, -1.0))
            if len(self._vetoes) > 4 * (self._labels.maxlen or 5000):
                self._vetoes.pop(next(iter(self._vetoes)))
        if not correct or len(self._labels) < 500 or self.counts["labels"] % 10 == 0:
            self.threshold = self._fit()  # a failure refits at once; otherwise every 10th label past 500

    def _fit(self) -> float | None:
        """The lowest observed similarity whose labels at or above it bound the failure rate."""
        labels = sorted(self._labels, key=lambda x: x.score)
        scores = [x.score for x in labels]
        failures_above = n_above = 0
        best = None
        for i in range(len(labels) - 1, -1, -1):  # from the most similar down
            n_above += 1
            failures_above += not labels[i].correct
            if i > 0 and scores[i - 1] == scores[i]:
                continue  # a threshold sits between distinct scores
            if failure_upper_bound(failures_above, n_above) <= self.max_error_rate:
                best = scores[i]
        return best

    def stats(self) -> dict[str, float]:
        return {**self.counts, "threshold": self.threshold if self.threshold is not None else -1.0}

    @staticmethod
    def labels_needed(max_error_rate: float) -> int:
        """Failure-free labels above a threshold before anything is skipped."""
        return math.ceil(math.log(0.05) / math.log(1.0 - max_error_rate))

