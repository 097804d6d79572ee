"""Use every core of `num_threads` only while nothing else on the box wants one.

A forward pass split over 2 threads waits at every layer for the slower thread. When another
process runs on one of the 2 cores (the small model decoding, at the same niceness), one of our
threads keeps losing its core for a scheduler slice and the other spins at the barrier: decode
and prefill slow down several times over. On one thread beside the busy small model they stay
close to their speed alone. Alone, one thread decodes nearly as fast as two where a decode step
is bound by reading the weights, and prefills slower (prefill is compute).

So each forward pass runs on all its threads only while the other processes on the box have
used less than `BUSY_CORES` over the last ~150 ms; else on one. A decoding model uses a whole
core, the idle service's own processes a small part of one between them, the ingress and proxy
more under load: the mark leaves them a core too, so that their routing embedding does not
slow down and shed decisions stay fast (docs/small-cpu-tuning.md).

The load is sampled off the request path, on a daemon thread (20 reads of /proc/stat a second);
the engine reads a number. Not `procs_running`: our own OpenMP and llama.cpp threads spin for a
while after each pass, and counted as "others" they would send many passes to one thread on an
idle box. Where /proc/stat is missing (not Linux) the configured threads are always used.
`ModelService.snapshot()` counts the passes by thread count.

Engines that take part in `PassLock` (llama.cpp's) do better than guess from that load: a
pass runs on all its threads only alone, so two engines never put three threads on two cores.
A long pass (a prompt's prefill, a catch-up, a long verification: `EXCLUSIVE_MIN_TOKENS` or
more) waits for the passes under way and runs alone; the others wait for it. On one thread it
would take longer, and that is a request's first token waiting. A short pass (a decode step)
runs alone on all threads if no other engine is in a pass, else beside them on one (a decode
step reads the weights: one thread is nearly as fast). With the load rule alone, the target's
decode steps beside the small model's ran at about twice their time, and its prefills at half
speed.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from host_tuning.shm import node_path

BUSY_CORES = 0.35  # other processes' use, in cores, from which a pass runs on one thread
EXCLUSIVE_MIN_TOKENS = 32  # a pass over this many tokens runs alone on all its threads


def _busy_ticks() -> int:
    """Ticks the whole box has spent busy (not idle or waiting for I/O)."""
    with open("/proc/stat", "rb") as f:
        fields = f.readline().split()[1:]
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> int:
    """Ticks this process has spent on a CPU (user + system), all its threads."""
    with open("/proc/self/stat", "rb") as f:
        data = f.read()
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


class OthersLoad:
    """Cores used by other processes over the last ~`INTERVAL_S * WINDOW` seconds."""

    INTERVAL_S = 0.05
    WINDOW = 3

    def __init__(self) -> None:
        self.hz = os.sysconf("SC_CLK_TCK")
        self._samples: deque[tuple[float, int, int]] = deque(maxlen=self.WINDOW + 1)
        self.cores = 0.0
        self._sample()
        threading.Thread(target=self._run, name="others-load", daemon=True).start()

    def _sample(self) -> None:
        self._samples.append((time.monotonic(), _busy_ticks(), _own_ticks()))
        (t0, busy0, own0), (t1, busy1, own1) = self._samples[0], self._samples[-1]
        if t1 > t0:
            self.cores = max(0.0, ((busy1 - busy0) - (own1 - own0)) / self.hz / (t1 - t0))

    def _run(self) -> None:
        while True:
            time.sleep(self.INTERVAL_S)
            try:
                self._sample()
            except (OSError, ValueError):
                return


_load: OthersLoad | None = None
_load_lock = threading.Lock()


def others_load() -> OthersLoad | None:
    """The process's one sampler, started on first use; None where /proc/stat can't be read."""
    global _load
    with _load_lock:
        if _load is None:
            try:
                _load = OthersLoad()
            except (OSError, ValueError):
                return None
        return _load


class PassLock:
    """The box's CPU engines' forward passes: short ones side by side, a long one alone.

    A reader/writer lock over processes: `flock` on two files in /dev/shm (released by the
    kernel if a process dies). A long pass waits at the turnstile for the passes under way,
    holding it so that new short passes queue behind it instead of starving it."""

    def __init__(self, path: str | None = None) -> None:
        path = path or node_path("cores")
        self._turnstile = os.open(path + ".turnstile", os.O_RDWR | os.O_CREAT, 0o600)
        self._passes = os.open(path + ".passes", os.O_RDWR | os.O_CREAT, 0o600)
        # This process holds the box alone across several passes (`CoreShare.alone`): its engines'
        # passes then run without taking the lock again (flock on these descriptors does not nest).
        self.held = False

    @contextmanager
    def alone(self) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._passes, fcntl.LOCK_EX)
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._passes, fcntl.LOCK_UN)

    def try_alone(self) -> bool:
        """Alone now, if no pass runs or waits to run alone; then `release` after the pass."""
        try:
            fcntl.flock(self._turnstile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        try:
            fcntl.flock(self._passes, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False
        finally:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def release(self) -> None:
        fcntl.flock(self._passes, fcntl.LOCK_UN)

    @contextmanager
    def beside(self) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)  # behind a long pass that is waiting
        fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        fcntl.flock(self._passes, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(self._passes, fcntl.LOCK_UN)


class CoreShare:
    """The thread count for the next forward pass: `max_threads` on an otherwise idle box or for
    a long pass (then alone), else 1."""

    def __init__(self, max_threads: int, enabled: bool = True) -> None:
        self.max_threads = max_threads
        self._wants_load = enabled and max_threads > 1
        # The load sampler wakes 20 times a second: started only for an engine that asks for
        # `threads()` (torch's); a pass-lock engine never reads it, and every wake-up of
        # another thread stalls a multi-threaded pass at its next barrier.
        self.load: OthersLoad | None = None
        self.lock = _pass_lock() if enabled else None  # a one-thread engine's passes take part too
        self.passes = {"all": 0, "one": 0, "alone": 0}  # forward passes by the threads they ran on
        self.waited_ms = 0.0  # for other engines' passes to end

    @property
    def enabled(self) -> bool:
        return self._wants_load or self.lock is not None

    def threads(self) -> int:
        if self.load is None and self._wants_load:
            self.load = others_load()
        if self.load is None:
            return self.max_threads
        busy = self.load.cores >= BUSY_CORES
        self.passes["one" if busy else "all"] += 1
        return 1 if busy else self.max_threads

    @contextmanager
    def alone(self) -> Iterator[None]:
        """The box's cores to this process's engines alone, across every pass inside, on all their
        threads: for a probe that prices this engine, which would otherwise time its neighbours'
        passes too (at start-up every replica probes at once) and price its model up to twice as
        slow. Waiting for the passes under way happens before the block runs, not inside it."""
        lock = self.lock
        if lock is None or lock.held:
            yield
            return
        with lock.alone():
            lock.held = True
            try:
                yield
            finally:
                lock.held = False

    @contextmanager
    def forward_pass(self, tokens: int) -> Iterator[int]:
        """Hold the cores for one pass over `tokens` tokens; yields the threads it runs on."""
        lock = self.lock
        if lock is None:
            yield self.threads()
            return
        if lock.held:  # inside `alone()`: the box is this process's already
            self.passes["alone"] += 1
            yield self.max_threads
            return
        waiting = time.perf_counter()
        if tokens >= EXCLUSIVE_MIN_TOKENS:
            with lock.alone():
                self.waited_ms += (time.perf_counter() - waiting) * 1000
                self.passes["alone"] += 1
                yield self.max_threads
        elif self.max_threads > 1 and lock.try_alone():
            try:
                self.passes["all"] += 1
                yield self.max_threads
            finally:
                lock.release()
        else:
            with lock.beside():
                self.waited_ms += (time.perf_counter() - waiting) * 1000
                self.passes["one"] += 1
                yield 1


_lock: PassLock | None = None


def _pass_lock() -> PassLock | None:
    """The process's one lock (its engines take turns on one worker thread); None where the
    lock files can't be opened."""
    global _lock
    with _load_lock:
        if _lock is None:
            try:
                _lock = PassLock()
            except OSError:
                return None
        return _lock
