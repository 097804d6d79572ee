"""A prefill that starts beside the cache lookup leaves one core to the lookup's embedding.

While the box is idle the ingress starts the model before its cache lookup comes back
(`overlap_cache_lookup`), and the prefill keeps to one thread so that the lookup's work has
the other core: the MiniLM embedding, and the Python around it in the cache replica and the
ingress. All of that runs at niceness 0 against the prefill's 19, so whatever of it lands
while the prefill runs on two threads stops one of them, and the other spins at the next
barrier: a window that ends with the embedding still leaves the Python after it contending;
one held until the ingress has handled the lookup's answer leaves nearly nothing.

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
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from host_tuning.shm import node_path

log = logging.getLogger(__name__)

SLOTS = 512  # ids kept; a reader needs its id only for the short while of its window
_ID_BYTES = 8


def _default_path() -> str:
    return node_path("lookups")


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
        """A check that says whether this lookup (an id from `lookup_id`) is over: one scan of
        4 KB in C. None without a board."""
        if self._map is None or not lookup:
            return None
        board, needle = self._map, bytes.fromhex(lookup)
        return lambda: board.find(needle) != -1


# Past the embedding's own time: a window that ends before it leaves the two contending, which
# costs more TTFT than a window held a little too long.
MARGIN_MS = 3.0
# With the board ending the window, the ingress's estimate only stops a window whose signal
# never comes: later than the estimate, so a slow lookup keeps its core.
SIGNALLED_BACKSTOP = 2.0


@dataclass(slots=True)
class LookupOverlap:
    """Sent with a model call that starts beside the ingress's cache lookup."""

    estimate_ms: float  # how long the lookup's embedding and search take (the ingress's average)
    mark: str | None  # its id on the board, once the ingress has handled the lookup


class LookupWindow:
    """The ingress's side: what a model call beside the lookup carries, and the mark on the
    board once the lookup's answer is handled. Off: nothing is sent, no window opens."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.estimate_ms = 20.0  # EMA of the lookup's embedding + search in the cache replica
        self.board = LookupBoard() if enabled else None

    def learn(self, timings_ms: dict[str, float]) -> None:
        """A lookup's own timings (from the cache replica) refine the estimate."""
        if "embed" in timings_ms:
            busy_ms = timings_ms["embed"] + timings_ms.get("cache_semantic", 0.0) + MARGIN_MS
            self.estimate_ms += 0.2 * (busy_ms - self.estimate_ms)

    def open(self, request_id: str) -> LookupOverlap | None:
        if not self.enabled:
            return None
        return LookupOverlap(round(self.estimate_ms, 1), lookup_id(request_id))

    def close(self, overlap: LookupOverlap | None) -> None:
        """The lookup's answer is handled: a prefill on this node takes its second core back."""
        if overlap is not None and overlap.mark and self.board is not None:
            self.board.mark(overlap.mark)


@runtime_checkable
class LeavesOneCore(Protocol):
    """An engine whose passes can keep to one thread for a while (the transformers engine)."""

    one_core_released: tuple[float, str] | None  # (when, "estimate" | "signal") it took the core back

    def leave_one_core(self, until: float, ended: Callable[[], bool] | None = None) -> bool: ...


@dataclass(slots=True)
class _Opened:
    engine: LeavesOneCore
    ended: Callable[[], bool] | None
    held: bool
    started: float
    released: tuple[float, str] | None = None


class PrefillWindow:
    """The model replica's side: around a prefill that came with a `LookupOverlap`, keep the
    engine on one thread until the board says the lookup is over, or the estimate passes."""

    def __init__(self) -> None:
        self.board = LookupBoard()
        self._heard = False  # a mark has reached this replica: the estimate is only a backstop
        self.prefills = 0  # prefills that started beside a lookup
        self.signalled = 0  # of those, windows the board ended

    def open(self, engine: object, overlap: LookupOverlap | None, enqueued: float) -> _Opened | None:
        """A window around the prefill about to run, where the engine can keep one (`LeavesOneCore`)."""
        if overlap is None or not isinstance(engine, LeavesOneCore):
            return None
        self.prefills += 1
        ended = self.board.watch(overlap.mark) if overlap.mark else None
        backstop = SIGNALLED_BACKSTOP if ended is not None and self._heard else 1.0
        held = engine.leave_one_core(enqueued + overlap.estimate_ms / 1000 * backstop, ended)
        return _Opened(engine, ended, held, time.perf_counter())

    def close(self, opened: _Opened | None) -> None:
        """After the prefill, whatever ended it: the engine goes back to all its threads."""
        if opened is not None:
            opened.released = opened.engine.one_core_released
            opened.engine.leave_one_core(0.0)

    def report(self, opened: _Opened | None, timings_ms: dict[str, float]) -> None:
        """How long the prefill kept to one thread (`prefill.one_core`), and what ended that."""
        if opened is None or not opened.held:
            return
        released = opened.released
        timings_ms["prefill.one_core"] = ((released[0] if released else time.perf_counter()) - opened.started) * 1000
        if released is not None and released[1] == "signal":
            self.signalled += 1
        # The mark came, if not in time: this replica shares the ingress's node.
        self._heard = self._heard or (opened.ended is not None and opened.ended())
