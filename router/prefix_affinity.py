"""Which model replica should a prompt go to, so that its prefix KV is already there.

The engine's prefix cache (engines/prefix_cache.py) keys KV blocks of `block_size` tokens by a
hash chain (engines/blocks.py). This uses the same chain, remembering for each block which replica was last
sent a prompt containing it. A new prompt goes to the replica holding its longest known prefix
(a conversation's next turn, a shared system prompt), unless that replica is busier than the
least-loaded one by more than `imbalance`: then load wins, so a hot prefix can't pin all
traffic to one replica (the other replica learns the prefix on that request).

Plain Python, no Ray: deployments/replica_router.py plugs it into Ray Serve's request router.
It lives in each caller's process (every ingress replica learns on its own; a prefix none has
seen goes where its first block hashes to, the same replica from every ingress), costs a few
microseconds per request, and is bounded by `max_blocks` (LRU).
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence

from engines.blocks import block_keys


def block_hashes(token_ids: Sequence[int], block_size: int, max_prefix_blocks: int, root: int = 0) -> list[int]:
    """Chained keys of the prompt's whole leading blocks: block i's key covers blocks 0..i."""
    return [key for key, _ in block_keys(token_ids, block_size, block_size * max_prefix_blocks, root)]


class PrefixAffinity:
    def __init__(
        self, block_size: int = 16, imbalance: int = 2, max_blocks: int = 200_000, max_prefix_blocks: int = 256
    ) -> None:
        self.block_size = block_size
        self.imbalance = imbalance
        self.max_blocks = max_blocks
        self.max_prefix_blocks = max_prefix_blocks
        self._owner: OrderedDict[int, str] = OrderedDict()  # block hash -> replica last sent it
        self.routed = {"affinity": 0, "balanced": 0, "new": 0}  # why requests went where they went

    def hashes(self, token_ids: Sequence[int], root: int = 0) -> list[int]:
        """`root`: the request's salt (engines/blocks.py: salt_root), as its replica keys the KV."""
        return block_hashes(token_ids, self.block_size, self.max_prefix_blocks, root)

    def rank(
        self, token_ids: Sequence[int], loads: dict[str, int | None], root: int = 0
    ) -> tuple[list[list[str]], list[int]]:
        """Replica ids in preference order (groups, as Ray's router takes them), and the
        prompt's block hashes (pass them to `record` once the request is sent).

        `loads`: each candidate's requests in flight, None when unknown."""
        hashes = self.hashes(token_ids, root)
        replicas = list(loads)
        if not replicas:
            return [], hashes
        known = [q for q in loads.values() if q is not None]
        lowest = min(known, default=0)
        owner = None
        for h in reversed(hashes):  # the longest prefix some live replica holds
            candidate = self._owner.get(h)
            if candidate in loads:
                owner = candidate
                break
        if owner is not None and (loads[owner] or 0) - lowest <= self.imbalance:
            self.routed["affinity"] += 1
            rest = [r for r in replicas if r != owner]
            return [[owner], _least_loaded_first(rest, loads)], hashes
        if owner is None and hashes:
            # A prefix no one here has sent yet: the replica its first block hashes to, the same
            # in every ingress replica (each learns on its own), so a conversation whose turns
            # reach different ingress replicas still meets its KV on one model replica.
            home = max(replicas, key=lambda r: _rendezvous(hashes[0], r))
            if (loads[home] or 0) - lowest <= self.imbalance:
                self.routed["new"] += 1
                rest = [r for r in replicas if r != home]
                return [[home], _least_loaded_first(rest, loads)], hashes
        self.routed["balanced" if owner is not None else "new"] += 1
        # No holder, or it is too busy: power of two choices, the less loaded first.
        pair = random.sample(replicas, min(2, len(replicas)))
        return [_least_loaded_first(pair, loads), [r for r in replicas if r not in pair]], hashes

    def record(self, hashes: list[int], replica: str) -> None:
        """The request with these blocks went to `replica`: it holds them now."""
        for h in hashes:
            self._owner[h] = replica
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_blocks:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica died: its blocks are gone with it."""
        for h in [h for h, r in self._owner.items() if r == replica]:
            del self._owner[h]


def _rendezvous(block: int, replica: str) -> int:
    """Highest-random-weight score of `replica` for a block: the same in every process."""
    digest = hashlib.blake2b(f"{block}:{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _least_loaded_first(replicas: list[str], loads: dict[str, int | None]) -> list[str]:
    return sorted(replicas, key=lambda r: loads[r] if loads[r] is not None else 0)
