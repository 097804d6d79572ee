"""OS priority: a model replica's compute below the request path, the request path above it."""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)


def set_niceness(level: int) -> int:
    """Raise this thread's niceness to `level` (never lower it: that needs privileges); the
    threads it starts from here on (the engine's worker, OpenMP's team) inherit it. Absolute,
    not an increment: Ray starts every worker process at `RAY_worker_niceness` (15 by default),
    ingress and proxy included, and `os.nice(19)` from there only clamps at 19. Returns the level."""
    current = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: this thread's
    if level > current:
        os.nice(level - current)
    return os.getpriority(os.PRIO_PROCESS, 0)


def below_everything() -> None:
    """Put this thread under SCHED_IDLE, the kernel's lowest weight, below any niceness: it
    runs on the cycles every other thread leaves (a core nobody else wants runs it at full
    speed). Still scheduled at a small share, so a lock it holds when preempted comes back
    within the scheduler's period. Niceness 19 where SCHED_IDLE is not available."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only, on Linux
    except (AttributeError, OSError):
        try:
            set_niceness(19)
        except (AttributeError, OSError):
            pass


def set_process_niceness(level: int) -> int | None:
    """Set every thread of this process to `level`, lower than Ray's 15 included, so the
    request path's small, latency-critical work (parse, tokenize, an embedding, relaying
    tokens) runs ahead of the model replicas' compute. Lowering needs CAP_SYS_NICE (root, or a
    raised RLIMIT_NICE); without it nothing changes. Returns the level set, or None. Threads
    started later inherit their creator's level."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's level is the only one
        tids = [0]
    try:
        for tid in tids:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, level)
            except ProcessLookupError:  # a thread that ended meanwhile
                pass
    except PermissionError:
        return None
    return level


def ahead_of_compute(level: int, who: str) -> None:
    """A request-path replica (`ingress.nice`, `cache.nice`) takes its configured level, or says
    why it could not."""
    if set_process_niceness(level) is None:
        log.warning("%s stays at niceness %d: lowering it to %d needs CAP_SYS_NICE; under load its work "
                    "then shares the cores with the model replicas' compute", who, os.getpriority(os.PRIO_PROCESS, 0), level)
