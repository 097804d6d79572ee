"""Build the router `serve_config.yaml` asks for."""

from __future__ import annotations

from configs.schemas import RouterConfig
from router.base import Router
from router.rules import RuleRouter


def make_router(config: RouterConfig, large_model_id: str, small_model_id: str) -> Router:
    if config.kind == "rules":
        return RuleRouter(config, large_model_id, small_model_id)
    from router.classifier import DifficultyClassifier
    from router.learned import ClassifierRouter

    classifier = DifficultyClassifier.load(config.classifier.weights)
    return ClassifierRouter(config, large_model_id, small_model_id, classifier)
