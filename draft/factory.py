"""Build the drafters a SpeculativeConfig describes."""

from __future__ import annotations

from configs.schemas import SpeculativeConfig
from draft.proposers import HintDraft, ModelDraft, NgramDraft, Proposer
from engines.base import Engine


def build_proposers(
    config: SpeculativeConfig,
    remote_draft: Proposer | None = None,
    draft_engine: Engine | None = None,
    share_cores: bool = False,
    target_engine: Engine | None = None,
) -> tuple[list[Proposer], Engine | None]:
    """Return (drafters, the co-located draft engine if any). Free lookups first.

    Pass `draft_engine` to reuse a loaded engine instead of building one from the config, and
    `target_engine` (the engine the drafts are for) so that a co-located draft can take each
    prompt's KV from it.
    """
    if config.method == "none":
        return [], None
    parts: list[Proposer] = []
    if config.use_hints:
        parts.append(HintDraft(config.ngram_min, config.ngram_max))
    if "ngram" in config.method:
        parts.append(NgramDraft(config.ngram_min, config.ngram_max))
    if "draft_model" in config.method:
        if config.placement == "remote":
            if remote_draft is None:
                raise ValueError("placement: remote needs the DraftModel deployment handle")
            parts.append(remote_draft)
        else:
            if draft_engine is None:
                from engines.factory import build_engine

                assert config.draft_engine is not None
                draft_engine = build_engine(config.draft_engine, share_cores)
            parts.append(ModelDraft(draft_engine, target_engine))
    return parts, (draft_engine if "draft_model" in config.method and config.placement == "colocated" else None)
