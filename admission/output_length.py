"""How many tokens a request will make: its answer's length, or its `max_tokens` if that is less.

A share of `max_tokens` learned across requests prices every budget alike, but short budgets
are used up and long ones are not: an answer ends on its own. Learned over a mix of budgets, the
share comes out near one and prices a long budget as if it would be used nearly whole, which
sheds requests that have time to finish for a finish they would not have.

So the answers' lengths are learned instead, one sample per completion: an answer that ended on
its own is its length; one that reached its budget says only that the answer runs at least that
long (a censored sample). A budget `m` is then expected to yield E[min(L, m)], the sum over
k < m of P(L > k), with P the Kaplan-Meier estimate over the most recent samples. Past the
longest sample, the answers still running there are taken to run to the budget.
"""

from __future__ import annotations

from collections import deque

KEPT = 128  # the most recent completions the estimate is made from


class OutputLengths:
    def __init__(self, kept: int = KEPT) -> None:
        self._samples: deque[tuple[int, bool]] = deque(maxlen=kept)  # (tokens, reached its budget)
        self._survival: list[tuple[int, float]] | None = None  # (length, P(L > length)) per answer end
        self._expected: dict[int, float] = {}  # by budget, until the next sample

    @property
    def samples(self) -> int:
        return len(self._samples)

    def add(self, tokens: int, max_tokens: int) -> None:
        """A finished request: `tokens` made of a budget of `max_tokens`."""
        tokens = max(0, tokens)
        self._samples.append((tokens, tokens >= max_tokens))
        self._survival = None
        self._expected.clear()

    def expected(self, max_tokens: int) -> float:
        """E[min(L, max_tokens)] over the kept samples (the whole budget with none)."""
        if max_tokens in self._expected:
            return self._expected[max_tokens]
        total, start, alive = 0.0, 0, 1.0
        for length, survival in self._curve():
            if length >= max_tokens:
                break
            total += alive * (length - start)
            start, alive = length, survival
        total += alive * (max_tokens - start)
        self._expected[max_tokens] = total
        return total

    def _curve(self) -> list[tuple[int, float]]:
        """The Kaplan-Meier survival at each length some answer ended at, ascending."""
        if self._survival is None:
            ordered = sorted(self._samples)
            at_risk, alive, curve, i = len(ordered), 1.0, [], 0
            while i < len(ordered):
                length, ended, leaving = ordered[i][0], 0, 0
                while i < len(ordered) and ordered[i][0] == length:
                    ended += not ordered[i][1]
                    leaving += 1
                    i += 1
                if ended:
                    alive *= 1 - ended / at_risk
                    curve.append((length, alive))
                at_risk -= leaving
            self._survival = curve
        return self._survival
