"""Routers decide which model answers a request. One small interface, many strategies."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(slots=True)
class RouteFeatures:
    """What a router may look at. Built once in the ingress, cheap to ship across a hop."""

    requested_model: str
    prompt_tokens: int
    max_tokens: int
    user_turns: int
    last_user_message: str


@dataclass(slots=True)
class RouteDecision:
    model_id: str
    reason: str  # short and stable: shows in the x-route header and in metrics


class Router(ABC):
    @abstractmethod
    def route(self, features: RouteFeatures) -> RouteDecision: ...
