from router.base import RouteDecision, RouteFeatures, Router
from router.rules import RuleRouter

__all__ = ["RouteDecision", "RouteFeatures", "Router", "RuleRouter"]
