"""The decode steps waiting for a model replica's worker, and whether a job is scheduled to run
them. The event loop adds a step as its request asks for it; the worker takes a batch at a time.
It owns no thread: a test drives it directly. Thread-safe (the two sides are two threads)."""

from __future__ import annotations

import asyncio
import math
import threading

from target.decoding import Generation

Step = tuple[Generation, asyncio.Future]  # a request's generation and the future its chunk goes to


class StepQueue:
    def __init__(self, max_batch: int) -> None:
        self.max_batch = max_batch
        self._pending: list[Step] = []
        self._lock = threading.Lock()
        self._scheduled = False  # a job to run the pending steps is on the worker's queue

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, step: Step) -> bool:
        """Queue a step; True when the caller must schedule a job to run it (none is scheduled)."""
        with self._lock:
            self._pending.append(step)
            schedule, self._scheduled = not self._scheduled, True
        return schedule

    def take(self) -> tuple[list[Step], bool]:
        """The steps for one pass, their requests still waiting (a cancelled one has no step):
        all of them, or past `max_batch` the earliest deadlines first. True when steps are left
        for another job, which the caller must schedule (the queue stays scheduled)."""
        with self._lock:
            waiting = [step for step in self._pending if not step[1].cancelled()]
            self._pending = []
            if len(waiting) > self.max_batch:
                waiting.sort(key=_deadline)
                self._pending, waiting = waiting[self.max_batch :], waiting[: self.max_batch]
                return waiting, True
            self._scheduled = False
            return waiting, False

    def put_back(self, steps: list[Step]) -> bool:
        """Steps a job leaves for later because a prompt goes ahead of them: they keep their place
        at the front. True when the caller must schedule a job for them. One runner at most: a
        request answered while a job runs may schedule another, and two runners would put a
        turn ahead of each later prompt."""
        with self._lock:
            self._pending = [*steps, *self._pending]
            schedule, self._scheduled = not self._scheduled, True
        return schedule


def _deadline(step: Step) -> float:
    return step[0].request.deadline_unix or math.inf


def earliest_deadline_first(steps: list[Step]) -> list[Step]:
    return sorted(steps, key=_deadline)
