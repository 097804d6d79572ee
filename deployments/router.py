"""Router: routing as its own deployment, asked only with `router.placement: remote` (the
ingress routes in-process by default)."""

from __future__ import annotations

from ray import serve

from configs.schemas import RouterConfig
from router.base import RouteDecision, RouteFeatures
from router.factory import make_router


@serve.deployment(name="Router")
class Router:
    def __init__(self, args: dict, large_model_id: str, small_model_id: str) -> None:
        self.router = make_router(RouterConfig.model_validate(args), large_model_id, small_model_id)

    async def route(self, features: RouteFeatures) -> RouteDecision:
        return self.router.route(features)
