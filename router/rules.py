"""Rule-based router: explicit model wins; `auto` sends short, simple requests to the small model."""

from __future__ import annotations

from configs.schemas import RouterConfig
from router.base import RouteDecision, RouteFeatures, Router


class RuleRouter(Router):
    def __init__(self, config: RouterConfig, large_model_id: str, small_model_id: str) -> None:
        self.config = config
        self.large = large_model_id
        self.small = small_model_id
        self._keywords = tuple(k.lower() for k in config.hard_keywords)

    def route(self, features: RouteFeatures) -> RouteDecision:
        c = self.config
        if features.requested_model != c.auto_model_id:
            return RouteDecision(features.requested_model, "explicit")
        if features.prompt_tokens > c.small_max_prompt_tokens:
            return RouteDecision(self.large, "long_prompt")
        if features.max_tokens > c.small_max_output_tokens:
            return RouteDecision(self.large, "long_output")
        if features.user_turns > c.small_max_turns:
            return RouteDecision(self.large, "deep_conversation")
        text = features.last_user_message.lower()
        if any(k in text for k in self._keywords):
            return RouteDecision(self.large, "hard_keyword")
        return RouteDecision(self.small, "simple")
