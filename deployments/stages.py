"""AdmissionController, SemanticCache and Router: small stateful stages."""

from __future__ import annotations

from ray import serve

from admission.ledger import AdmissionLedger, AdmissionShare, ReplicaReport
from configs.schemas import AdmissionConfig, CacheConfig, RouterConfig
from router.base import RouteDecision, RouteFeatures
from router.rules import RuleRouter
from semantic_cache.exact import CachedResponse, ExactCache


@serve.deployment(name="AdmissionController")
class AdmissionController:
    """Shares the service-wide admission limits out among live ingress replicas."""

    def __init__(self, args: dict) -> None:
        self.ledger = AdmissionLedger(AdmissionConfig.model_validate(args))

    async def report(self, replica_id: str, report: ReplicaReport) -> AdmissionShare:
        return self.ledger.report(replica_id, report)

    async def totals(self) -> dict[str, int]:
        return self.ledger.totals()


@serve.deployment(name="SemanticCache")
class SemanticCache:
    def __init__(self, args: dict) -> None:
        self.cache = ExactCache(CacheConfig.model_validate(args))

    async def lookup(self, key: str) -> CachedResponse | None:
        return self.cache.get(key)

    async def store(self, key: str, tenant: str, value: CachedResponse) -> None:
        self.cache.put(key, tenant, value)

    async def invalidate(self, tenant: str | None = None) -> int:
        return self.cache.invalidate(tenant)

    async def stats(self) -> dict[str, int]:
        return {"entries": len(self.cache), "hits": self.cache.hits, "misses": self.cache.misses}


@serve.deployment(name="Router")
class Router:
    def __init__(self, args: dict, large_model_id: str, small_model_id: str) -> None:
        self.router = RuleRouter(RouterConfig.model_validate(args), large_model_id, small_model_id)

    async def route(self, features: RouteFeatures) -> RouteDecision:
        return self.router.route(features)
