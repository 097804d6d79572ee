"""Learned routing: the difficulty classifier on the shared embedding.

p_hard >= threshold goes to the large model. The router judges difficulty only: the ingress
moves a borderline verdict by live load afterwards, in the one place that decides an auto
request's model (admission/model_choice.py: `load_downgrade`, `load_upgrade`). A
`threshold_shift` in the features still moves the threshold here, for callers that pass one.
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
