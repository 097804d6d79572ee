"""Routers decide which model answers a request. One small interface, many strategies."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RouteFeatures:
    """What a router may look at. Built once in the ingress, cheap to ship across a hop."""

    requested_model: str
    prompt_tokens: int  # the prompt's tokens outside its system message(s)
    max_tokens: int  # what the client asked for; 0 when it left the limit to the server
    user_turns: int
    last_user_message: str
    vector: Any = None  # the request's MiniLM embedding (shared with the cache), when a router wants it
    threshold_shift: float = 0.0  # from live load: > 0 sends more to the small model, < 0 fewer


@dataclass(slots=True)
class RouteDecision:
    model_id: str
    reason: str  # short and stable: shows in the x-route header and in metrics
    p_hard: float | None = None  # the classifier's score, when one was asked
    threshold: float | None = None  # the (load-shifted) threshold it was compared with

    def header(self) -> str:
        value = f"{self.model_id};reason={self.reason}"
        if self.p_hard is not None and self.threshold is not None:
            value += f";p_hard={self.p_hard:.3f};threshold={self.threshold:.3f}"
        return value


class Router(ABC):
    def wants_embedding(self, features: RouteFeatures) -> bool:
        """Whether `route` would look at `features.vector` (the ingress then waits for it)."""
        return False

    @abstractmethod
    def route(self, features: RouteFeatures) -> RouteDecision: ...
