"""Which prompt prefixes each model was lately sent, so that admission prices a prompt's prefill
by the tokens its engine will compute, not by those its prefix cache already holds.

A shared system prompt, an agent's growing transcript or a conversation's earlier turns are
prefilled once; priced in full on every request, a long conversation's next turn was predicted
seconds late and an interactive request shed, and a cost per token learned from prefills that
reused most of their prompt priced unseen prompts too cheap. Blocks are named as the engines'
prefix caches name them (engines/blocks.py: a hash chain salted by tenant), in an LRU per model
bounded by `max_blocks`: a guess at what the engine still holds, corrected, as every prediction
is, by how late first tokens come (admission/ttft_calibration.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from engines.blocks import block_keys, salt_root


class PrefixMemory:
    def __init__(self, block_size: int = 16, max_blocks: int = 16_384) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}  # per model: chain keys, least recent first
        self._last: tuple[Sequence[int], str | None, list[int]] | None = None  # one prompt's keys, asked per model

    def keys(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        """The prompt's chained block keys (the last prompt's are kept: each request asks for
        every model it may run on)."""
        last = self._last
        if last is not None and last[0] is token_ids and last[1] == salt:
            return last[2]
        keys = [key for key, _ in block_keys(token_ids, self.block_size, len(token_ids), salt_root(salt))]
        self._last = (token_ids, salt, keys)
        return keys

    def cached_tokens(self, model_id: str, keys: list[int]) -> int:
        """Leading tokens of the prompt whose blocks `model_id` was lately sent."""
        blocks = self._blocks.get(model_id)
        if not blocks:
            return 0
        known = 0
        for key in keys:
            if key not in blocks:
                break
            known += 1
        return known * self.block_size

    def remember(self, model_id: str, keys: list[int]) -> None:
        """The prompt went to `model_id`: its engine holds these blocks now."""
        blocks = self._blocks.setdefault(model_id, OrderedDict())
        for key in keys:
            blocks[key] = None
            blocks.move_to_end(key)
        while len(blocks) > self.max_blocks:
            blocks.popitem(last=False)
