from router.base import RouteDecision, RouteFeatures, Router
from router.factory import make_router
from router.rules import RuleRouter

__all__ = ["RouteDecision", "RouteFeatures", "Router", "RuleRouter", "make_router"]
