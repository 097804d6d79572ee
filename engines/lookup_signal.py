"""Tells a prefill on the same node the moment the cache lookup beside it is over.

While the box is idle the ingress starts the model before its cache lookup comes back
(`overlap_cache_lookup`), and the prefill keeps to one thread so that the lookup's MiniLM
embedding has the other core. Until when? The ingress can only send an estimate (recent
lookups' embedding and search + a margin), and it is off both ways: a window that ends early
leaves three threads on two cores (the prefill's barrier stalls at every op), one that ends
late keeps half the box idle for the difference.

So the SemanticCache replica writes the id of every lookup it finishes into a small ring in
shared memory, and the model replica, at each check inside its pass, takes its second core
back once its request's id is there. Both sides map the same file (/dev/shm); a reader on
another node never sees an id, and the ingress's estimate still ends its window.

An id is the first 8 bytes of the request's cache key (a SHA-256), so nothing else is sent
between the stages. Writes are 8 aligned bytes; a reader that misses one sees it at its next
check or falls back to the estimate: this is a hint for scheduling, never for correctness.
"""

from __future__ import annotations

import logging
import mmap
import os
import random
import tempfile
from collections.abc import Callable

log = logging.getLogger(__name__)

SLOTS = 512  # ids kept; a reader needs its id only for the ~20 ms of its window
_ID_BYTES = 8


def _default_path() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"latency-serve-lookups-{os.getuid()}")


def lookup_id(cache_key: str) -> str:
    """The part of a cache key (hex) that names its lookup on the board."""
    return cache_key[: 2 * _ID_BYTES]


class LookupBoard:
    """A ring of finished lookups' ids in a shared file. `ok` is False where it can't be mapped
    (then `mark` does nothing and `watch` gives None)."""

    def __init__(self, path: str | None = None) -> None:
        self.path = path or _default_path()
        self._map: mmap.mmap | None = None
        self._next = random.randrange(SLOTS)  # writers in several processes start apart
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < SLOTS * _ID_BYTES:
                    os.ftruncate(fd, SLOTS * _ID_BYTES)
                self._map = mmap.mmap(fd, SLOTS * _ID_BYTES)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            log.info("no lookup board at %s (%r): prefills beside a lookup end on the estimate", self.path, exc)

    @property
    def ok(self) -> bool:
        return self._map is not None

    def mark(self, cache_key: str) -> None:
        """The lookup for this cache key is over (its embedding and search are done)."""
        if self._map is None:
            return
        offset = self._next * _ID_BYTES
        self._map[offset : offset + _ID_BYTES] = bytes.fromhex(lookup_id(cache_key))
        self._next = (self._next + 1) % SLOTS

    def watch(self, lookup: str) -> Callable[[], bool] | None:
        """A check that says whether this lookup (an id from `lookup_id`) is over: ~1 us, one
        scan of 4 KB in C. None without a board."""
        if self._map is None or not lookup:
            return None
        board, needle = self._map, bytes.fromhex(lookup)
        return lambda: board.find(needle) != -1
