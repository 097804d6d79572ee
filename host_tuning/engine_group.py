"""The vLLM engine's processes in a scheduling group of their own.

On Linux with the kernel's autogroup on (most desktop and VM kernels), the processes of one
session share one scheduling group. `serve run` puts all of Ray in one session, so a vLLM CPU
engine's compute threads (niceness 19) share a group with every request-path thread and Ray's
own. On a small box under many streams the scheduler then lets that group hold the cores for
long stretches: other processes, the kernel's softirq threads and the graph's own token relay
wait, and first tokens come late (docs/benchmarks.md, vllm_tax). `vllm serve` has its engine in
a session with nothing else in it. Giving the engine core process a session of its own (the
workers it starts inherit it) gives it that arrangement inside the graph: its own group,
weighed against Ray's as one.

vLLM starts its engine core with the `spawn` start method inside a Ray actor, so the hook is
the process target: `EngineCoreProc.run_engine_core` is swapped, in this process only, for
`run_engine_core_in_own_session`, which the child finds by name, and which calls `os.setsid()`
before running vLLM's own. vLLM's names are looked up when `own_session_for_engine()` is
called; if they are missing (another vLLM version) it says so and changes nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

_HOOKED = "_own_session_original"


def run_engine_core_in_own_session(*args, **kwargs):
    """The engine core process's entry: a session of its own, then vLLM's entry."""
    from vllm.v1.engine.core import EngineCoreProc

    try:
        os.setsid()
    except OSError as error:  # already a session or group leader: keep the session it has
        log.warning("vLLM engine core keeps its parent's scheduling group: setsid failed (%s)", error)
    else:
        _end_with_parent(os.getppid())
    entry = getattr(run_engine_core_in_own_session, _HOOKED, None) or EngineCoreProc.run_engine_core
    return entry(*args, **kwargs)


def _end_with_parent(parent: int, period_s: float = 1.0, grace_s: float = 10.0) -> None:
    """vLLM's engine core does not watch the process that started it, and one in a session of its
    own outlives a replica killed outright: it ends itself once that replica is gone (vLLM's
    shutdown on SIGTERM, then SIGKILL after `grace_s`; its workers follow it on their own)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        log.warning("vLLM engine core: the replica that started it is gone; ending")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="engine-core-parent-watch", daemon=True).start()


def own_session_for_engine() -> bool:
    """Make the engine core that vLLM starts next from this process take its own session.
    Returns whether the hook is in place."""
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError as error:
        log.warning("vLLM engine keeps Ray's scheduling group: %s", error)
        return False
    current = EngineCoreProc.__dict__.get("run_engine_core")
    original = getattr(current, "__func__", None)
    if original is run_engine_core_in_own_session:
        return True
    if original is None or not callable(original):
        log.warning("vLLM engine keeps Ray's scheduling group: EngineCoreProc.run_engine_core is not a static method")
        return False
    setattr(run_engine_core_in_own_session, _HOOKED, original)
    EngineCoreProc.run_engine_core = staticmethod(run_engine_core_in_own_session)
    return True
