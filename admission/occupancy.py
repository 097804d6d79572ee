"""How many requests the box held, integrated over time.

A request's decode cost is filed under the concurrency it ran at. Taken as the average of the
counts at its start and at its end, a request that starts and ends at the edges of a burst
would be filed under the burst's quiet edges while its steps are paid in the middle of it: a
low level would read as slow as a high one, and admission would shed requests at that level
that would make their deadlines. The time average over its decode is what its steps saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Reading:
    area: float  # request-seconds up to `at`
    at: float


class Occupancy:
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._area = 0.0
        self._at = clock()
        self._level = 0

    def set(self, level: int) -> None:
        """The box now holds `level` requests."""
        now = self._clock()
        self._area += self._level * (now - self._at)
        self._at, self._level = now, level

    def read(self) -> Reading:
        now = self._clock()
        return Reading(self._area + self._level * (now - self._at), now)

    def mean_since(self, start: Reading) -> float | None:
        """The time-average number of requests on the box since `start` (None: no time passed)."""
        now = self.read()
        span = now.at - start.at
        return (now.area - start.area) / span if span > 0 else None
