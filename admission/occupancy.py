"""How many requests the box held, and for how long each model shared it, integrated over time.

A request's decode cost is filed under the concurrency it ran at. Taken as the average of the
counts at its start and at its end, a request that starts and ends at the edges of a burst
would be filed under the burst's quiet edges while its steps are paid in the middle of it: a
low level would read as slow as a high one, and admission would shed requests at that level
that would make their deadlines. The time average over its decode is what its steps saw.

Where the models share the cores, what a step costs depends on more than the count: a step of
one model beside another model's decoding waits for the other's passes (they take turns for
the cores), so four sequences on one model step faster than one beside three on the other. So
for each model the time during which another model had requests running is integrated too
(`beside_since`), and its decode costs are filed apart from those it paid alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Reading:
    area: float  # request-seconds up to `at`
    at: float
    beside: Mapping[str, float] = field(default_factory=dict)  # per model: seconds another model ran


class Occupancy:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._area = 0.0
        self._at = clock()
        self._level = 0
        self._beside: dict[str, float] = {}  # per model: seconds up to `_at` another model ran
        self._others: dict[str, bool] = {}  # per model: another model runs now

    def set(self, by_model: Mapping[str, int]) -> None:
        """The box now holds `by_model[m]` requests on each model `m`."""
        now = self._clock()
        self._advance(now)
        self._level = sum(by_model.values())
        for model in set(by_model) | set(self._others):
            self._beside.setdefault(model, 0.0)
            self._others[model] = self._level - by_model.get(model, 0) > 0

    def read(self) -> Reading:
        now = self._clock()
        span = now - self._at
        beside = {m: s + (span if self._others.get(m) else 0.0) for m, s in self._beside.items()}
        return Reading(self._area + self._level * span, now, beside)

    def mean_since(self, start: Reading) -> float | None:
        """The time-average number of requests on the box since `start` (None: no time passed)."""
        now = self.read()
        span = now.at - start.at
        return (now.area - start.area) / span if span > 0 else None

    def beside_since(self, start: Reading, model_id: str) -> float | None:
        """The share of the time since `start` during which another model than `model_id` had
        requests running (None: no time passed)."""
        now = self.read()
        span = now.at - start.at
        if span <= 0:
            return None
        return (now.beside.get(model_id, 0.0) - start.beside.get(model_id, 0.0)) / span

    def _advance(self, now: float) -> None:
        span = now - self._at
        self._area += self._level * span
        for model, others in self._others.items():
            if others:
                self._beside[model] += span
        self._at = now
