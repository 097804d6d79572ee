"""What the other ingress replicas on this node are running now: their requests, and which of
those are still in prefill.

A new prompt waits in its model replica's queue for the prompts ahead of it (and, where the
models share the cores, for every model's), and its prefill and decode run slower the more
sequences share the box. Each ingress replica knows its own requests; the others' reach it
through the controller (admission/sync.py) only as counts, twice a second, and a count there is
up to two syncs old. Predicted from such a count, a request that arrives just after the other
replica's last request ended was priced as if that one still ran (a busy box, not an idle one),
and a prompt admitted beside another ingress's long prefill was predicted to start at once.

Here every gate writes its running requests (model, start, predicted first token and finish,
whether the first token came), and how many requests it holds that are about to run (past
their first checks, waiting for the router's verdict; counted where the busy-box move is on),
to a file of its own in a per-user directory in /dev/shm, replaced whole at each change: an
arrival, its placing, a start, a first token, a release. It reads the other files when it
predicts, in-process: no hop, a read of a few small files. Each file names its writer's
replica, so the gate takes these counts in place of the controller's for the replicas on this
node, and the controller's for the others. Times are `time.monotonic()`, one clock for every process on the
node. A prompt still listed in prefill past its predicted first token is counted as the gate
counts its own (admission/running.py), and forgotten once it is as late again as it was
predicted to take. A file whose writer's process is gone counts for nothing and is removed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from host_tuning.shm import node_path

log = logging.getLogger(__name__)

SUFFIX = ".running"
ALIVE_CHECK_S = 1.0  # how often a file's writer is checked for a live process
MEMO_S = 0.002  # one admission decision asks many times: it reads the files once
# How often a gate with requests waiting reads the board again: a fraction of a prefill.
POLL_S = 0.01
_ids = itertools.count()


@dataclass(frozen=True)
class Listed:
    """A request running on an ingress replica, as its board row has it: what `prefills_ahead_ms`
    and `expected_end` (admission/running.py) read of it."""

    model_id: str
    started_at: float
    first_at: float  # predicted first token
    finish_at: float  # predicted last token
    longest: float  # the latest it can end (its max_tokens)
    prefilled: bool = False  # its first token came


@dataclass(frozen=True)
class View:
    """One reading of the board: the other replicas' requests, those of them still in prefill
    (less the forgotten), and their counts by replica id and model."""

    requests: list[Listed] = field(default_factory=list)
    prefilling: list[Listed] = field(default_factory=list)
    running: dict[str, dict[str, int]] = field(default_factory=dict)
    arriving: int = 0  # requests the other replicas hold that are about to run, not yet placed

    def by_model(self, synced: dict[str, dict[str, int]]) -> dict[str, int]:
        """The other replicas' running requests by model: those on this board as they are now, in
        place of the controller's `synced` counts (by replica id), and the rest as synced."""
        out: dict[str, int] = {}
        for counts in [*(c for r, c in synced.items() if r not in self.running), *self.running.values()]:
            for model, n in counts.items():
                out[model] = out.get(model, 0) + n
        return out


@dataclass
class _File:
    version: tuple[int, int]  # (inode, mtime): a write replaces the file
    replica: str
    running: list[Listed]
    arriving: int = 0
    alive_at: float = 0.0  # when its writer was last seen alive (time.monotonic)


class NodeBoard:
    def __init__(self, directory: str | None = None, clock: Callable[[], float] = time.monotonic,
                 memo_s: float = MEMO_S, replica_id: str | None = None) -> None:
        self.directory = directory or node_path("running")
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._clock = clock
        self.memo_s = memo_s
        self._name = f"{os.getpid()}-{next(_ids)}{SUFFIX}"
        self._path = os.path.join(self.directory, self._name)
        # The controller's name for this replica: another gate takes this file's counts in
        # place of the controller's for it.
        self.replica_id = replica_id or self._name
        self._read: dict[str, _File] = {}
        self.failed = False  # set when the directory can't be written: this replica then only reads
        self._memo: tuple[float, View] | None = None  # (when, what `view` read then)
        self._due = False  # a write is scheduled
        self._watch: asyncio.Task[None] | None = None

    def publish(self, running: Iterable[Listed], arriving: int = 0) -> None:
        """This gate's running requests now, and its requests about to run."""
        rows = [[r.model_id, r.started_at, r.first_at, r.finish_at, r.longest, r.prefilled] for r in running]
        tmp = self._path + ".tmp"
        try:
            with open(tmp, "w") as f:
                json.dump({"replica": self.replica_id, "running": rows, "arriving": arriving}, f)
            os.replace(tmp, self._path)
        except OSError as exc:
            if not self.failed:
                log.warning("node board unwritable, other ingress replicas count this one's requests by the "
                            "controller's syncs: %r", exc)
                self.close()  # a file left as it was would say so for good
            self.failed = True

    def publish_soon(self, state: Callable[[], tuple[Iterable[Listed], int]]) -> None:
        """`publish(*state())` once the event loop is free: not on the way of the model call or
        of the token it follows; the changes of one turn of the loop are one write. Outside an
        event loop, now."""
        if self._due:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.publish(*state())
            return
        self._due = True

        def write() -> None:
            self._due = False
            self.publish(*state())

        loop.call_soon(write)

    def watch(self, waiting: Callable[[], bool], wake: Callable[[], None]) -> None:
        """While `waiting()`, call `wake` every POLL_S: another replica's prefill or request
        ending may let a queued request start, and nothing on this replica says so."""
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._poll(waiting, wake))

    async def _poll(self, waiting: Callable[[], bool], wake: Callable[[], None]) -> None:
        while waiting():
            await asyncio.sleep(POLL_S)
            wake()

    def others(self, now: float | None = None) -> list[Listed]:
        """The other gates' prompts in prefill, less those forgotten (see the module docstring)."""
        return self.view(now).prefilling

    def view(self, now: float | None = None) -> View:
        """The other gates' requests now (read at most once per `memo_s`)."""
        read_at = time.perf_counter()
        if self._memo is not None and read_at - self._memo[0] < self.memo_s:
            return self._memo[1]
        out = self._scan(self._clock() if now is None else now)
        self._memo = (read_at, out)
        return out

    def _scan(self, now: float) -> View:
        view = View()
        try:
            entries = list(os.scandir(self.directory))
        except OSError:
            return view
        seen = set()
        arriving = 0
        for entry in entries:
            name = entry.name
            if not name.endswith(SUFFIX) or name == self._name:
                continue
            try:
                # A write replaces the file: a new inode (mtimes are as coarse as the kernel's tick).
                version = (entry.inode(), entry.stat().st_mtime_ns)
            except OSError:
                continue
            cached = self._read.get(name)
            if cached is None or cached.version != version:
                cached = self._load(entry.path, version, cached)
                self._read[name] = cached
            if not self._alive(entry.path, name, cached):
                continue
            seen.add(name)
            arriving += cached.arriving
            counts = view.running.setdefault(cached.replica, {})
            for r in cached.running:
                counts[r.model_id] = counts.get(r.model_id, 0) + 1
                view.requests.append(r)
                # A prompt as late again as it was predicted to take is no longer waited for.
                if not r.prefilled and now <= r.first_at + max(0.0, r.first_at - r.started_at):
                    view.prefilling.append(r)
        for name in set(self._read) - seen:
            del self._read[name]
        return dataclasses.replace(view, arriving=arriving)

    def close(self) -> None:
        """This replica is going away: its requests no longer count anywhere."""
        try:
            os.unlink(self._path)
        except OSError:
            pass

    @staticmethod
    def _load(path: str, version: tuple[int, int], before: _File | None) -> _File:
        alive_at = before.alive_at if before is not None else 0.0
        try:
            with open(path) as f:
                doc = json.load(f)
            rows = [Listed(str(m), float(s), float(e), float(f), float(lo), bool(p))
                    for m, s, e, f, lo, p in doc["running"]]
            return _File(version, str(doc["replica"]), rows, max(0, int(doc.get("arriving", 0))), alive_at)
        except (OSError, ValueError, TypeError, KeyError):
            # removed since the listing (its writer replaces it whole: never half-written)
            return _File(version, "", [], 0, alive_at)

    def _alive(self, path: str, name: str, f: _File) -> bool:
        """Is the file's writer still running? Checked once per ALIVE_CHECK_S; a dead writer's
        file is removed (a replica killed without its shutdown leaves it)."""
        now = time.monotonic()
        if now - f.alive_at < ALIVE_CHECK_S:
            return True
        try:
            os.kill(int(name.split("-", 1)[0]), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
            return False
        except (ValueError, PermissionError, OSError):
            pass  # not ours to signal, or not a pid: trust the file
        f.alive_at = now
        return True
