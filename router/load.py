"""Live load of the two model stages, as one ingress replica sees it, turned into a shift of
the router's threshold. Updated on the request path in O(1), read without a hop.

A stage's pressure is the larger of (requests in flight / its capacity) and (recent TTFT /
the TTFT SLO). A TTFT reading fades with age (half-life `ttft_half_life_s`), so a stage that
was slow and then got no traffic is not shunned forever.
"""

from __future__ import annotations

import math
import time

from configs.schemas import LoadAwareConfig


class StageLoad:
    def __init__(self, capacity: int, half_life_s: float) -> None:
        self.capacity = capacity
        self.half_life_s = half_life_s
        self.inflight = 0
        self._ttft_ms = 0.0
        self._at = time.monotonic()

    def observe_ttft(self, ms: float) -> None:
        now = time.monotonic()
        self._ttft_ms = 0.7 * self._decayed(now) + 0.3 * ms
        self._at = now

    def ttft_ms(self) -> float:
        return self._decayed(time.monotonic())

    def _decayed(self, now: float) -> float:
        return self._ttft_ms * math.pow(0.5, (now - self._at) / self.half_life_s)

    def pressure(self, ttft_slo_ms: float) -> float:
        return max(self.inflight / self.capacity, self.ttft_ms() / ttft_slo_ms)


class LoadTracker:
    def __init__(self, config: LoadAwareConfig, large_model_id: str, small_model_id: str) -> None:
        self.config = config
        self.stages = {
            large_model_id: StageLoad(config.large_capacity, config.ttft_half_life_s),
            small_model_id: StageLoad(config.small_capacity, config.ttft_half_life_s),
        }
        self.large, self.small = large_model_id, small_model_id

    def started(self, model_id: str) -> None:
        if model_id in self.stages:
            self.stages[model_id].inflight += 1

    def finished(self, model_id: str) -> None:
        if model_id in self.stages:
            self.stages[model_id].inflight = max(0, self.stages[model_id].inflight - 1)

    def observe_ttft(self, model_id: str, ms: float) -> None:
        if model_id in self.stages:
            self.stages[model_id].observe_ttft(ms)

    def threshold_shift(self) -> float:
        """> 0 when the large model is under more pressure than the small one."""
        c = self.config
        if not c.enabled:
            return 0.0
        excess = self.stages[self.large].pressure(c.ttft_slo_ms) - self.stages[self.small].pressure(c.ttft_slo_ms)
        return c.gain * max(-1.0, min(1.0, excess))

    def snapshot(self) -> dict:
        return {
            model: {"inflight": s.inflight, "ttft_ms": round(s.ttft_ms(), 1)} for model, s in self.stages.items()
        } | {"threshold_shift": round(self.threshold_shift(), 3)}
