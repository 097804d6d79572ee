"""The prompts in prefill that the other ingress replicas on this node have started.

A new prompt waits in its model replica's queue for the prompts ahead of it (and, where the
models share the cores, for every model's). Each ingress replica knows its own; the others'
reached it only as counts, twice a second, through the controller (admission/sync.py). So a
prompt admitted beside another ingress's long prefill was predicted to start at once, and its
first token came late by most of that prefill: it was admitted where it should have been
queued or moved, and the lateness it taught (`TtftCalibration`) shed other requests later.

Here every gate writes its prompts in prefill (model, start, predicted first token) to a file
of its own in a per-user directory in /dev/shm, replaced whole at each change, and reads the
other files when it predicts, in-process: no hop, a read of a few small files. Times are
`time.monotonic()`, one clock for every process on the node. A prompt still listed past its
predicted first token is counted as the gate counts its own (admission/running.py), and
forgotten once it is as late again as it was predicted to take: a file whose writer died
stops counting by then, and is removed once its writer's process is gone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from host_tuning.shm import node_path

log = logging.getLogger(__name__)

SUFFIX = ".prefills"
FORGET_DEAD_AFTER_S = 60.0  # a file unchanged this long is checked for a live writer
MEMO_S = 0.002  # one admission decision asks many times: it reads the files once
# How often a gate with requests waiting reads the board again: a fraction of a prefill.
POLL_S = 0.01
_ids = itertools.count()


@dataclass(frozen=True)
class Pending:
    """A prompt in prefill on another ingress replica: what `prefills_ahead_ms` reads of it."""

    model_id: str
    started_at: float
    first_at: float
    prefilled: bool = False


class PrefillBoard:
    def __init__(self, directory: str | None = None, clock: Callable[[], float] = time.monotonic,
                 memo_s: float = MEMO_S) -> None:
        self.directory = directory or node_path("prefills")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._clock = clock
        self.memo_s = memo_s
        self._name = f"{os.getpid()}-{next(_ids)}{SUFFIX}"
        self._path = os.path.join(self.directory, self._name)
        self._read: dict[str, tuple[tuple[int, int], list[Pending]]] = {}  # file -> (its version, entries)
        self.failed = False  # set when the directory can't be written: this replica then only reads
        self._memo: tuple[float, list[Pending]] | None = None  # (when, what `others` read then)
        self._due = False  # a write is scheduled
        self._watch: asyncio.Task[None] | None = None

    def publish(self, pending: Iterable) -> None:
        """This gate's prompts in prefill now (tickets: model_id, started_at, first_at)."""
        rows = [[t.model_id, t.started_at, t.first_at] for t in pending]
        tmp = self._path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(rows, f)
            os.replace(tmp, self._path)
        except OSError as exc:
            if not self.failed:
                log.warning("prefill board unwritable, other ingress replicas won't see this one's prefills: %r", exc)
            self.failed = True

    def publish_soon(self, pending: Callable[[], Iterable]) -> None:
        """`publish(pending())` once the event loop is free: not on the way of the model call or
        of the first token it follows; the changes of one turn of the loop are one write.
        Outside an event loop, now."""
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.publish(pending())
            return
        self._due = True

        def write() -> None:
            self._due = False
            self.publish(pending())

        loop.call_soon(write)

    def watch(self, waiting: Callable[[], bool], wake: Callable[[], None]) -> None:
        """While `waiting()`, call `wake` every POLL_S: another replica's prefill ending may let a
        queued request start, and nothing on this replica says so."""
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._poll(waiting, wake))

    async def _poll(self, waiting: Callable[[], bool], wake: Callable[[], None]) -> None:
        while waiting():
            await asyncio.sleep(POLL_S)
            wake()

    def others(self, now: float | None = None) -> list[Pending]:
        """The other gates' prompts in prefill, less those forgotten (see the module docstring)."""
        now = self._clock() if now is None else now
        read_at = time.perf_counter()
        if self._memo is not None and read_at - self._memo[0] < self.memo_s:
            return self._memo[1]
        out = self._scan(now)
        self._memo = (read_at, out)
        return out

    def _scan(self, now: float) -> list[Pending]:
        out: list[Pending] = []
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return out
        seen = set()
        for entry in entries:
            name = entry.name
            if not name.endswith(SUFFIX) or name == self._name:
                continue
            seen.add(name)
            try:
                # A write replaces the file: a new inode (mtimes are as coarse as the kernel's tick).
                version = (entry.inode(), entry.stat().st_mtime_ns)
            except OSError:
                continue
            cached = self._read.get(name)
            if cached is None or cached[0] != version:
                cached = (version, self._load(entry.path))
                self._read[name] = cached
            live = [p for p in cached[1] if now <= p.first_at + max(0.0, p.first_at - p.started_at)]
            if not live and time.time() - version[1] / 1e9 > FORGET_DEAD_AFTER_S:
                self._remove_if_dead(entry.path, name)
            out.extend(live)
        for name in set(self._read) - seen:
            del self._read[name]
        return out

    def close(self) -> None:
        """This replica is going away: its prompts no longer count anywhere."""
        try:
            os.unlink(self._path)
        except OSError:
            pass

    @staticmethod
    def _load(path: str) -> list[Pending]:
        try:
            with open(path) as f:
                return [Pending(str(m), float(s), float(e)) for m, s, e in json.load(f)]
        except (OSError, ValueError, TypeError):
            return []  # removed since the listing (its writer replaces it whole: never half-written)

    def _remove_if_dead(self, path: str, name: str) -> None:
        try:
            pid = int(name.split("-", 1)[0])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except (ValueError, PermissionError, OSError):
            pass
