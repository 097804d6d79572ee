"""Automatic prefix caching for the transformers engine: reuse the KV of prompt prefixes.

Prompts are cut into blocks of `block_size` tokens. A block is keyed by a hash chain (its
tokens and its parent's key), so a key names the whole prefix up to that block, as in vLLM's
automatic prefix caching. A new prompt walks its blocks until the first miss, takes those KV
slices, and prefills only the rest. Blocks are evicted least recently used under a byte
budget; a lookup or insert touches a chain from its last block back to its first, so a parent
is always more recent than its children and leaves go first. (Blocks stored together share one
copy, freed when the last of them is evicted: the budget counts each block's own bytes.)

The engine runs every forward pass on one worker thread, so this needs no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from engines.blocks import block_keys

LayerKV = tuple[torch.Tensor, torch.Tensor]  # keys, values: [1, heads, tokens, head_dim]


class PrefixCache:
    def __init__(self, block_size: int = 16, max_bytes: int = 256 << 20) -> None:
        self.block_size = block_size
        self.max_bytes = max_bytes
        # chain key -> (the block's tokens, checked on a match against hash collisions; KV per layer)
        self._blocks: OrderedDict[int, tuple[tuple[int, ...], list[LayerKV]]] = OrderedDict()
        self.bytes = 0
        self.lookups = 0
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of those, served from the cache

    def _keys(self, token_ids: Sequence[int], limit: int, salt: int) -> list[tuple[int, tuple[int, ...]]]:
        """(chain key, tokens) of the full blocks within the first `limit` tokens."""
        return block_keys(token_ids, self.block_size, limit, salt)

    def match(self, token_ids: Sequence[int], salt: int = 0) -> tuple[int, list[LayerKV]]:
        """The longest cached prefix under `salt` (the tenant's `salt_root`): (tokens reused, KV
        per layer). At least one prompt token is always left to prefill, since the model must
        produce the next token's logits."""
        self.lookups += 1
        self.query_tokens += len(token_ids)
        found: list[int] = []
        for key, tokens in self._keys(token_ids, len(token_ids) - 1, salt):
            entry = self._blocks.get(key)
            if entry is None or entry[0] != tokens:
                break
            found.append(key)
        if not found:
            return 0, []
        for key in reversed(found):  # children first, so parents end up most recent
            self._blocks.move_to_end(key)
        blocks = [self._blocks[key][1] for key in found]
        layers = [
            (torch.cat([b[i][0] for b in blocks], dim=2), torch.cat([b[i][1] for b in blocks], dim=2))
            for i in range(len(blocks[0]))
        ]
        reused = len(found) * self.block_size
        self.hit_tokens += reused
        return reused, layers

    def insert(self, token_ids: Sequence[int], layers: Sequence[LayerKV], salt: int = 0) -> None:
        """Store the full blocks of `token_ids` that are not cached yet, from a sequence's KV.

        One copy per layer of the whole new span, each block a view into it: copying block by
        block makes thousands of small copies for one prompt, on the way to the first token.
        """
        b = self.block_size
        chain = self._keys(token_ids, len(token_ids), salt)
        new = [i for i, (key, _) in enumerate(chain) if key not in self._blocks]
        if new:
            lo, hi = new[0] * b, (new[-1] + 1) * b
            span = [(k[:, :, lo:hi].clone(), v[:, :, lo:hi].clone()) for k, v in layers]
            block_bytes = sum(k.nbytes + v.nbytes for k, v in span) * b // (hi - lo)
            for index in new:
                start = index * b - lo
                block = [(k[:, :, start : start + b], v[:, :, start : start + b]) for k, v in span]
                self._blocks[chain[index][0]] = (chain[index][1], block)
                self.bytes += block_bytes
        for key, _ in reversed(chain):  # children first, so parents end up most recent
            self._blocks.move_to_end(key)
        while self.bytes > self.max_bytes and self._blocks:
            _, (_, evicted) = self._blocks.popitem(last=False)
            self.bytes -= sum(k.nbytes + v.nbytes for k, v in evicted)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def stats(self) -> dict[str, float]:
        return {
            "prefix_lookups": self.lookups,
            "prefix_query_tokens": self.query_tokens,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_hit_rate": round(self.hit_rate, 4),
            "prefix_cache_blocks": len(self._blocks),
            "prefix_cache_mb": round(self.bytes / 2**20, 1),
        }
