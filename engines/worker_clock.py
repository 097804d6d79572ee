"""What a model replica's worker thread spent its time on, by kind of job.

A new prompt waits in `engine_queue` for the one worker thread. To tell why it waited, the
replica marks the clock when the prompt joins the queue and reads, when its prefill starts,
how much of the wait went to other prompts' prefills and how much to decode steps (plain,
batched or speculative rounds). The job already running at the mark counts only from the mark.
It also reads how many jobs ran ahead and the longest of them, whole: one slow job (a big
batched pass, a starved core) and many short ones call for different fixes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from engines.types import ENGINE_QUEUE_COUNTS

log = logging.getLogger(__name__)

KINDS = ("prefills", "steps")


@dataclass(frozen=True)
class Mark:
    at: float  # perf_counter
    totals: dict[str, float]  # seconds of each kind, the running job's elapsed part included


@dataclass(frozen=True)
class JobsAhead:
    jobs: int  # jobs that ran (whole or in part) between the mark and now
    longest_ms: float  # the longest of them, whole
    longest_seqs: int  # sequences in that job (a batched pass holds several)
    longest_cpu: float  # the process's CPU seconds per wall second during it (~threads when not starved)

    def timings(self) -> dict[str, float]:
        """As the first chunk carries them (engines/types.py:ENGINE_QUEUE_COUNTS); none if no job ran."""
        if not self.jobs:
            return {}
        values = (self.jobs, round(self.longest_ms, 1), self.longest_seqs, round(self.longest_cpu, 2))
        return dict(zip(ENGINE_QUEUE_COUNTS, map(float, values), strict=True))


class WorkerClock:
    SLOW_JOB_S = 0.5  # a job this long is logged: it holds every prompt queued behind it
    KEPT = 256  # finished jobs remembered: far more than ever run while one prompt waits

    def __init__(self) -> None:
        self._spent = dict.fromkeys(KINDS, 0.0)  # seconds, whole jobs, since start-up
        self._running: tuple[str, float] | None = None  # the job on the worker now: kind, start
        self._done: deque[tuple[float, float, int, float]] = deque(maxlen=self.KEPT)  # (end, secs, seqs, cpu)
        self._lock = threading.Lock()

    @contextmanager
    def job(self, kind: str, seqs: int = 1) -> Iterator[None]:
        """On the worker thread, around one job's forward work on `seqs` sequences."""
        start, cpu_start = time.perf_counter(), time.process_time()
        with self._lock:
            self._running = (kind, start)
        try:
            yield
        finally:
            end = time.perf_counter()
            secs = end - start
            cpu = (time.process_time() - cpu_start) / secs if secs > 0 else 0.0
            with self._lock:
                self._running = None
                self._spent[kind] += secs
                self._done.append((end, secs, seqs, cpu))
            if secs >= self.SLOW_JOB_S:
                log.warning("slow worker job: %s of %d sequence(s) took %.0f ms at %.2f CPU/s", kind, seqs,
                            secs * 1000, cpu)

    def mark(self) -> Mark:
        """Totals as of now, the running job's elapsed part included: `since` counts from here."""
        now = time.perf_counter()
        with self._lock:
            totals = dict(self._spent)
            if self._running is not None:
                kind, start = self._running
                totals[kind] += now - start
        return Mark(now, totals)

    def since(self, mark: Mark) -> dict[str, float]:
        """ms of each kind of work done since `mark` (jobs finished since; the one running now,
        if any, is not counted until it ends)."""
        with self._lock:
            return {kind: max(0.0, (self._spent[kind] - mark.totals[kind]) * 1000) for kind in KINDS}

    def jobs_since(self, mark: Mark) -> JobsAhead:
        """The jobs that finished since `mark`, and the longest of them."""
        with self._lock:
            ahead = [job for job in self._done if job[0] > mark.at]
        if not ahead:
            return JobsAhead(0, 0.0, 0, 0.0)
        _, secs, seqs, cpu = max(ahead, key=lambda job: job[1])
        return JobsAhead(len(ahead), secs * 1000, seqs, cpu)
