"""Tells a prefill on the same node the moment the cache lookup beside it is over.

While the box is idle the ingress starts the model before its cache lookup comes back
(`overlap_cache_lookup`), and the prefill keeps to one thread so that the lookup's work has
the other core: the MiniLM embedding, and the Python around it in the cache replica and the
ingress (~17 ms of CPU a miss in all, measured per thread). All of that runs at niceness 0
against the prefill's 19, so whatever of it lands while the prefill runs on two threads stops
one of them, and the other spins at the next barrier: in a probe, a 245-token prefill took
~30 ms longer beside a lookup whose window ended with the embedding, and ~3 ms longer with
the window held until the ingress had handled the lookup's answer.

Until when, then? The ingress can only send an estimate (recent lookups' embedding and search
+ a margin). So once it has handled the answer, the ingress writes the request's id into a
small ring in shared memory (/dev/shm), and the model replica, at each check inside its pass,
takes its second core back once that id is there. A reader on another node never sees an id,
and the estimate ends its window.

Ids are 8 bytes of a hash of the request id: unique per request, so a repeat never finds an
old mark. Writes are 8 aligned bytes; a reader that misses one sees it at its next check or
falls back to the estimate: this is a hint for scheduling, never for correctness.
"""

from __future__ import annotations

import hashlib
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


def lookup_id(request_id: str) -> str:
    """A request's id on the board (hex): unique per request, so a repeat never finds an old mark."""
    return hashlib.blake2b(request_id.encode(), digest_size=_ID_BYTES).hexdigest()


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

    def mark(self, lookup: str) -> None:
        """This lookup (an id from `lookup_id`) is over."""
        if self._map is None:
            return
        offset = self._next * _ID_BYTES
        self._map[offset : offset + _ID_BYTES] = bytes.fromhex(lookup)
        self._next = (self._next + 1) % SLOTS

    def watch(self, lookup: str) -> Callable[[], bool] | None:
        """A check that says whether this lookup (an id from `lookup_id`) is over: ~1 us, one
        scan of 4 KB in C. None without a board."""
        if self._map is None or not lookup:
            return None
        board, needle = self._map, bytes.fromhex(lookup)
        return lambda: board.find(needle) != -1
