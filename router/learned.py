"""Learned routing: the difficulty classifier on the shared embedding, threshold moved by load.

p_hard >= threshold goes to the large model. The ingress shifts the threshold from live load
(router/load.py): when the large model is slow or busy, borderline requests go small
("load_downgrade") before admission has to shed anything; when the small one is, they go
large ("load_upgrade"). Clear-cut requests stay where they belong.
"""

from __future__ import annotations

from configs.schemas import RouterConfig
from router.base import RouteDecision, RouteFeatures, Router
from router.classifier import DifficultyClassifier
from router.rules import fixed_route


class ClassifierRouter(Router):
    def __init__(
        self, config: RouterConfig, large_model_id: str, small_model_id: str, classifier: DifficultyClassifier
    ) -> None:
        self.config = config
        self.large = large_model_id
        self.small = small_model_id
        self.classifier = classifier

    def wants_embedding(self, features: RouteFeatures) -> bool:
        return fixed_route(self.config, features, self.large) is None

    def route(self, features: RouteFeatures) -> RouteDecision:
        fixed = fixed_route(self.config, features, self.large)
        if fixed is not None:
            return fixed
        if features.vector is None:  # no embedding (empty turn, embedder down): the safe choice
            return RouteDecision(self.large, "no_embedding")
        c = self.config.classifier
        p = self.classifier.p_hard(features.vector)
        shifted = min(c.max_threshold, max(c.min_threshold, c.threshold + features.threshold_shift))
        large_now, large_idle = p >= shifted, p >= c.threshold
        if large_now == large_idle:
            reason = "classifier_hard" if large_now else "classifier_easy"
        else:
            reason = "load_upgrade" if large_now else "load_downgrade"
        return RouteDecision(self.large if large_now else self.small, reason, p, shifted)
