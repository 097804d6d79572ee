"""Several requests want their next step: one batched plain pass, or a speculative round each?

A batched step reads the weights once for every request in it and yields one token each. A
speculative round verifies one request's drafted tokens in one pass and yields several. Which is
cheaper per emitted token depends on the hardware, the batch size and the contexts, so both are
priced from what this replica measures:
- in turns: the cost model's price of a caught-up draft at its best k (`CostModel.
  steady_token_ms`: live draft and verify costs, live acceptance). Not the rounds themselves:
  after a spell of batched steps a request's draft must first catch up, and rounds timed then
  would price turns far above what staying in turns costs;
- batched: a plain step of n sequences, per n, from start-up calibration, then live.

On a small CPU box a plain step of a few sequences costs well over one sequence's (small-M
GEMMs are not memory-bound there), while a speculative round with the llama.cpp draft yields
several tokens: a few concurrent requests make more tokens/s taking speculative rounds in turn,
and from several requests on batching catches up and then wins. A GPU prices a batch of 16 near
one sequence, so there batching wins from 2 (docs/speculative-decoding.md).

Switching costs a catch-up, so the mode changes only for a clear gain (`SWITCH_MARGIN`). A
batch size not run for a while is run again now and then when its estimate is close, so a
change on the box or in the contexts (longer ones make batched steps dearer) moves the choice.
"""

from __future__ import annotations

from collections.abc import Callable

from target.adaptive import Ema


class StepModeChooser:
    PROBE_EVERY = 24  # turns in a row before a close batch estimate is re-timed
    PROBE_MARGIN = 1.5  # ... close: within this factor of the turns' ms per token
    SWITCH_MARGIN = 1.1  # the other mode must be this much cheaper per token to switch
    ROUND_TOKENS = 4.0  # tokens per speculative round, to weigh speculating against plain requests

    def __init__(self, batch_ms_prior: dict[int, float], max_batch: int, turn_token_ms: Callable[[], float]) -> None:
        """`batch_ms_prior`: ms of a plain step of n sequences, observed at a few n (1 included);
        `turn_token_ms`: the live ms per token of a request speculating on its own."""
        assert 1 in batch_ms_prior
        self.max_batch = max_batch
        self.batch_ms = [Ema(_interpolate(batch_ms_prior, n), weight=0.2) for n in range(1, max_batch + 1)]
        self.turn_token_ms = turn_token_ms
        self._batched: bool | None = None  # the mode of the last decision
        self._turns_streak = 0
        self.decisions = {"batched": 0, "turns": 0}

    def batch_token_ms(self, n: int) -> float:
        return self.batch_ms[min(n, self.max_batch) - 1].value / n

    def turns_token_ms(self, speculating: int, plain: int) -> float:
        """ms per emitted token when each request takes its step in turn."""
        ms = speculating * self.ROUND_TOKENS * self.turn_token_ms() + plain * self.batch_ms[0].value
        return ms / (speculating * self.ROUND_TOKENS + plain)

    def batch(self, speculating: int, plain: int) -> bool:
        """True: one batched plain pass for all of them; False: a step each, in turn."""
        if not speculating:
            return True  # plain steps in turn only repeat what the batch does at once
        turns = self.turns_token_ms(speculating, plain)
        batched = self.batch_token_ms(speculating + plain)
        if self._batched is None:
            choice = batched <= turns
        elif self._batched:
            choice = batched <= turns * self.SWITCH_MARGIN
        else:
            choice = batched * self.SWITCH_MARGIN < turns
            if not choice and self._turns_streak >= self.PROBE_EVERY and batched <= turns * self.PROBE_MARGIN:
                choice = True  # re-measure the batch once
        self._turns_streak = 0 if choice else self._turns_streak + 1
        self._batched = choice
        self.decisions["batched" if choice else "turns"] += 1
        return choice

    def observe_batch(self, n: int, ms: float) -> None:
        self.batch_ms[min(n, self.max_batch) - 1].update(ms)

    def observe_plain(self, ms: float) -> None:
        """One plain step of one sequence (a request that does not speculate)."""
        self.batch_ms[0].update(ms)


def _interpolate(points: dict[int, float], n: int) -> float:
    """Piecewise-linear through the observed sizes; beyond the largest, the last slope goes on."""
    xs = sorted(points)
    if n in points:
        return points[n]
    if n > xs[-1]:
        if len(xs) == 1:
            return points[xs[0]] * n
        a, b = xs[-2], xs[-1]
        return points[b] + (points[b] - points[a]) / (b - a) * (n - b)
    lo = max(x for x in xs if x < n)
    hi = min(x for x in xs if x > n)
    return points[lo] + (points[hi] - points[lo]) * (n - lo) / (hi - lo)
