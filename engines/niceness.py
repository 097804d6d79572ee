"""OS priority of a model replica's compute."""

from __future__ import annotations

import os


def set_niceness(level: int) -> int:
    """Raise this thread's niceness to `level` (never lower it: that needs privileges); the
    threads it starts from here on (the engine's worker, OpenMP's team) inherit it. Absolute,
    not an increment: Ray starts every worker process at `RAY_worker_niceness` (15 by default),
    ingress and proxy included, and `os.nice(19)` from there only clamps at 19. Returns the level."""
    current = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux: this thread's
    if level > current:
        os.nice(level - current)
    return os.getpriority(os.PRIO_PROCESS, 0)
