"""Prompt blocks keyed by a hash chain, as in vLLM's automatic prefix caching.

A block of `block_size` tokens is keyed by its tokens and its parent's key, so one key names
the whole prefix up to that block. Shared by the engine's prefix KV cache
(engines/prefix_cache.py) and the replica router's prefix affinity (router/prefix_affinity.py),
so both name a prefix the same way. Plain Python: tuples of ints hash the same in every process.

The chain starts from a salt, the tenant's (`salt_root`), as vLLM's `cache_salt` does: one
tenant's prompt never reuses, and so can never time, the KV of another tenant's prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def salt_root(salt: str | None) -> int:
    """The chain's first parent for a salt (a tenant): the same int in every process."""
    if not salt:
        return 0
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "big")


def block_keys(
    token_ids: Sequence[int], block_size: int, limit: int, root: int = 0
) -> list[tuple[int, tuple[int, ...]]]:
    """(chain key, tokens) of the whole blocks within the first `limit` tokens, chained from `root`."""
    keys, parent = [], root
    for start in range(0, min(limit, len(token_ids)) - block_size + 1, block_size):
        tokens = tuple(token_ids[start : start + block_size])
        parent = hash((parent, tokens))
        keys.append((parent, tokens))
    return keys
