"""Rule-based routing: an explicit model wins; limits the small model can't serve go large;
with `kind: rules`, task keywords decide the rest."""

from __future__ import annotations

from configs.schemas import RouterConfig
from router.base import RouteDecision, RouteFeatures, Router


def fixed_route(config: RouterConfig, features: RouteFeatures, large: str) -> RouteDecision | None:
    """Decisions no score can overturn: the client named a model, or the request is too big
    for the small model. None: it's up to the router's judgement."""
    if features.requested_model != config.auto_model_id:
        return RouteDecision(features.requested_model, "explicit")
    if features.prompt_tokens > config.small_max_prompt_tokens:
        return RouteDecision(large, "long_prompt")
    if features.max_tokens > config.small_max_output_tokens:
        return RouteDecision(large, "long_output")
    if features.user_turns > config.small_max_turns:
        return RouteDecision(large, "deep_conversation")
    return None


class RuleRouter(Router):
    def __init__(self, config: RouterConfig, large_model_id: str, small_model_id: str) -> None:
        self.config = config
        self.large = large_model_id
        self.small = small_model_id
        self._keywords = tuple(k.lower() for k in config.hard_keywords)

    def route(self, features: RouteFeatures) -> RouteDecision:
        fixed = fixed_route(self.config, features, self.large)
        if fixed is not None:
            return fixed
        text = features.last_user_message.lower()
        if any(k in text for k in self._keywords):
            return RouteDecision(self.large, "hard_keyword")
        return RouteDecision(self.small, "simple")
