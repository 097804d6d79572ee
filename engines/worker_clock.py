"""What a model replica's worker thread spent its time on, by kind of job.

A new prompt waits in `engine_queue` for the one worker thread. To tell why it waited, the
replica marks the clock when the prompt joins the queue and reads, when its prefill starts,
how much of the wait went to other prompts' prefills and how much to decode steps (plain,
batched or speculative rounds). The job already running at the mark counts only from the mark.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

KINDS = ("prefills", "steps")


class WorkerClock:
    def __init__(self) -> None:
        self._spent = dict.fromkeys(KINDS, 0.0)  # seconds, whole jobs, since start-up
        self._running: tuple[str, float] | None = None  # the job on the worker now: kind, start
        self._lock = threading.Lock()

    @contextmanager
    def job(self, kind: str) -> Iterator[None]:
        """On the worker thread, around one job's forward work."""
        start = time.perf_counter()
        with self._lock:
            self._running = (kind, start)
        try:
            yield
        finally:
            with self._lock:
                self._running = None
                self._spent[kind] += time.perf_counter() - start

    def mark(self) -> dict[str, float]:
        """Totals as of now, the running job's elapsed part included: `since` counts from here."""
        with self._lock:
            totals = dict(self._spent)
            if self._running is not None:
                kind, start = self._running
                totals[kind] += time.perf_counter() - start
        return totals

    def since(self, mark: dict[str, float]) -> dict[str, float]:
        """ms of each kind of work done since `mark` (jobs finished since; the one running now,
        if any, is not counted until it ends)."""
        with self._lock:
            return {kind: max(0.0, (self._spent[kind] - mark[kind]) * 1000) for kind in KINDS}
