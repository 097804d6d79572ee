"""Host tuning on a small CPU box (host_tuning/): the core share and pass lock across
processes, the lookup window and board, niceness."""

from __future__ import annotations

import os
import textwrap
import threading
import time

import pytest
import torch

from tests.conftest import prompt_ids


@pytest.fixture(scope="module")
def serve_file(exact_serve_file):
    """The `transformers` target (float32, drafted by llama.cpp): configs/cpu-exact.yaml."""
    return exact_serve_file


def test_a_forward_pass_runs_on_one_thread_while_another_process_keeps_a_core_busy(engine):
    """Two torch threads beside a busy process stall at every barrier (host_tuning/cores.py); the
    engine drops to one thread while another process keeps a core busy, and takes both back
    once the box is idle again. The load is measured off the request path."""
    import subprocess
    import sys

    from host_tuning.cores import BUSY_CORES

    assert engine.cores.enabled and engine.cores.max_threads == 2, "the shipped target shares its cores"
    engine.cores.threads()  # the box's load is sampled from the first pass that asks for it
    load = engine.cores.load
    ids = prompt_ids(engine)

    def settle(busy: bool) -> None:
        deadline = time.monotonic() + 5
        while (load.cores >= BUSY_CORES) != busy and time.monotonic() < deadline:
            time.sleep(0.05)

    def one_pass() -> int:
        seq = engine.new_sequence()
        engine.prefill(seq, ids)
        engine.release(seq)
        return engine._threads

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        settle(busy=True)
        assert load.cores >= BUSY_CORES, load.cores
        assert one_pass() == 1
    finally:
        spinner.kill()
        spinner.wait()
    settle(busy=False)
    assert load.cores < BUSY_CORES, f"the box stayed busy ({load.cores:.2f} cores) after the spinner stopped"
    assert one_pass() == 2
    # Our own passes are not "another process": after half a second of nothing but them (both
    # cores busy), the load of the others reads far below what those passes use. Counted as
    # others, they would read about two cores in every window; what the box's other processes
    # and the kernel do meanwhile (an earlier test's idle Ray cluster, memory monitors) can sit
    # above the busy mark on a shared CI box, so the lowest of up to three windows is held
    # under one core, half of what the passes use.
    readings: list[float] = []
    while len(readings) < 3 and (not readings or readings[-1] >= BUSY_CORES):
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            one_pass()
        readings.append(round(load.cores, 2))
    assert min(readings) < 1.0, f"our own passes read as {readings} cores of others"


_HOLDER = """
import sys, time
from host_tuning.cores import PassLock
lock = PassLock(sys.argv[1])
print("ready", time.monotonic(), flush=True)
with (lock.alone() if sys.argv[2] == "alone" else lock.beside()):
    print("in", time.monotonic(), flush=True)
    time.sleep(float(sys.argv[3]))
    print("out", time.monotonic(), flush=True)
"""


def _other_engine(path: str, how: str, seconds: float):
    """Another engine's pass over the same lock, in another process (as another model replica)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, path, how, str(seconds)], stdout=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.stdout.readline().startswith("ready")
    return proc


def _entered(proc) -> float:
    line = proc.stdout.readline().split()
    assert line and line[0] == "in", f"the other engine's pass never started: {line}"
    return float(line[1])


def _left(proc) -> float:
    line = proc.stdout.readline().split()
    assert line and line[0] == "out", f"the other engine's pass never ended: {line}"
    return float(line[1])


def test_a_long_pass_runs_alone_on_every_core_and_a_short_one_beside_another_engines_on_one(tmp_path):
    """host_tuning/cores.py's pass lock, across processes as between model replicas: a decode
    step beside another engine's pass runs on one thread at once; alone on the box, on all; a
    prompt's long pass waits for the passes under way, then runs on all threads while the
    other engines' passes wait for it."""
    from host_tuning.cores import EXCLUSIVE_MIN_TOKENS, CoreShare, PassLock

    path = str(tmp_path / "cores")
    cores = CoreShare(2, enabled=True)
    cores.lock = PassLock(path)
    with cores.forward_pass(8) as threads:
        assert threads == 2, "alone on the box, a decode step takes both cores"
    other = _other_engine(path, "beside", 0.6)
    try:
        _entered(other)
        with cores.forward_pass(8) as threads:
            beside_at = time.monotonic()
            assert threads == 1, "beside a pass: one thread"
        with cores.forward_pass(EXCLUSIVE_MIN_TOKENS) as threads:
            alone_at = time.monotonic()
            assert threads == 2, "a long pass runs on every thread"
        other_left = _left(other)
        assert beside_at < other_left, "a decode step runs beside the other engine's pass, not after it"
        assert alone_at >= other_left, "a long pass waits for the one under way"
    finally:
        other.wait(timeout=10)
    with cores.forward_pass(EXCLUSIVE_MIN_TOKENS) as threads:
        other = _other_engine(path, "beside", 0)
        time.sleep(0.5)
        ended = time.monotonic()
    assert threads == 2 and _entered(other) >= ended, "another engine's step waited for the long pass"
    other.wait(timeout=10)
    assert cores.passes == {"all": 1, "one": 1, "alone": 2}


def test_a_probe_held_alone_times_every_pass_on_all_threads_and_keeps_other_engines_out(tmp_path):
    """`CoreShare.alone()`, what a replica's start-up probes run in: the other engine's pass
    under way ends before the block starts, every pass inside (a decode step, a long prompt, the
    co-located draft's) runs on all threads without taking the lock again, and another engine's
    step waits for the block's end, so a probe times its own engine, not its neighbours'."""
    from host_tuning.cores import EXCLUSIVE_MIN_TOKENS, CoreShare, PassLock

    path = str(tmp_path / "cores")
    target, draft = CoreShare(2, enabled=True), CoreShare(2, enabled=True)
    target.lock = draft.lock = PassLock(path)  # one process's engines share its lock
    other = _other_engine(path, "beside", 0.4)
    _entered(other)
    with target.alone():
        started = time.monotonic()
        assert target.lock.held
        with target.forward_pass(8) as step, target.forward_pass(EXCLUSIVE_MIN_TOKENS) as prompt:
            assert (step, prompt) == (2, 2)
        with draft.forward_pass(4) as drafted:
            assert drafted == 2
        waiting = _other_engine(path, "beside", 0)
        time.sleep(0.4)
        ended = time.monotonic()
    assert not target.lock.held
    assert started >= _left(other), "the block waited for the pass under way"
    assert _entered(waiting) >= ended, "another engine's step waited for the block"
    for proc in (other, waiting):
        proc.wait(timeout=10)
    assert target.passes == {"all": 0, "one": 0, "alone": 2} and draft.passes["alone"] == 1


def test_a_prefill_beside_the_cache_lookup_leaves_a_core_free_until_the_moment_then_takes_both(serve_file):
    """Host tuning's lookup window: the prefill runs on one thread while the ingress's
    lookup embeds beside it, and goes back to both at the first decoder layer after the
    moment; the logits are the same as a plain pass's."""
    from engines.transformers_engine import TransformersEngine

    config = serve_file.args.target.engine
    engine = TransformersEngine(config)  # without core sharing: the box's load can't interfere
    assert config.num_threads == 2
    seen: list[int] = []
    layers = engine.model.get_decoder().layers
    moment_passes_at: list[int | None] = [None]
    released: list[tuple[float, str] | None] = [None]

    def record(module, args) -> None:
        index = len(seen)
        seen.append(torch.get_num_threads())
        if moment_passes_at[0] == index:
            engine.leave_one_core(time.perf_counter() - 1)  # as if the window had just ended

    for layer in layers:
        layer.register_forward_pre_hook(record)  # after the engine's own hook: sees its choice
    ids = prompt_ids(engine)

    def prefill(until: float, passes_at: int | None = None, ended=None) -> torch.Tensor:
        seen.clear()
        moment_passes_at[0] = passes_at
        assert engine.leave_one_core(until, ended)
        seq = engine.new_sequence()
        try:
            return engine.prefill(seq, ids)
        finally:
            released[0] = engine.one_core_released  # (when, why) it took the core back
            engine.leave_one_core(0.0)
            engine.release(seq)

    plain = prefill(0.0)
    assert set(seen) == {2} and len(seen) == len(layers)
    held = prefill(time.perf_counter() + 600)
    assert set(seen) == {1}, seen
    switched = prefill(time.perf_counter() + 600, passes_at=4)
    assert seen[:5] == [1] * 5 and set(seen[5:]) == {2}, seen
    assert released[0][1] == "estimate"
    # The lookup board says the lookup is over (here: once three layers have started): the core
    # comes back before the next layer, at the third layer's MLP.
    signalled = prefill(time.perf_counter() + 600, ended=lambda: len(seen) >= 3)
    assert seen[:3] == [1] * 3 and set(seen[3:]) == {2}, seen
    assert released[0][1] == "signal"
    for logits in (held, switched, signalled):
        assert torch.allclose(logits, plain, atol=1e-4)
    assert prefill(0.0) is not None and set(seen) == {2}, "the window ends with its pass"


def test_the_lookup_board_tells_another_process_which_lookups_are_over(tmp_path):
    """The ingress marks a request's lookup as over; a model replica (another process on the
    node) watching that request's id sees it, and no other request's; ids are per request."""
    import subprocess
    import sys

    from host_tuning.lookup_window import SLOTS, LookupBoard, lookup_id

    path = str(tmp_path / "board")
    mine, other = lookup_id("chatcmpl-1"), lookup_id("chatcmpl-2")
    assert len(mine) == 16 and mine != other and lookup_id("chatcmpl-1") == mine
    watcher = LookupBoard(path)
    over, other_over = watcher.watch(mine), watcher.watch(other)
    assert watcher.ok and not over() and not other_over()
    subprocess.run(
        [sys.executable, "-c", f"from host_tuning.lookup_window import LookupBoard; LookupBoard({path!r}).mark({mine!r})"],
        check=True, timeout=60,
    )
    assert over() and not other_over()
    writer = LookupBoard(path)  # a ring: an old id is gone once every slot was written since
    for i in range(SLOTS):
        writer.mark(lookup_id(f"filler-{i}"))
    assert not over()
    unmapped = LookupBoard(str(tmp_path))  # a directory: no board, the estimate ends windows
    assert not unmapped.ok and unmapped.watch(mine) is None
    unmapped.mark(mine)


def test_model_niceness_is_a_level_not_an_increment():
    """Ray starts every worker at niceness 15 (RAY_worker_niceness). A model stage's `nice` is
    the level its compute threads end at, whatever the worker started at; never lowered. In a
    child process: niceness sticks to the thread that set it and to the threads it starts."""
    import subprocess
    import sys

    code = (
        "import os, threading\n"
        "from host_tuning.niceness import set_niceness\n"
        "os.nice(15)\n"  # where Ray starts a worker
        "seen = []\n"
        "assert set_niceness(17) == 17, os.getpriority(os.PRIO_PROCESS, 0)\n"  # os.nice(17) would clamp at 19
        "t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0))); t.start(); t.join()\n"
        "assert seen == [17], seen\n"
        "assert set_niceness(16) == 17\n"  # never lowered
        "assert set_niceness(19) == 19\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_a_request_path_replica_goes_ahead_of_the_compute_on_every_thread_or_says_it_cannot():
    """`ingress.nice` / `cache.nice`: every thread of the process (Ray's included) goes to the
    level, below Ray's 15 where the process may (CAP_SYS_NICE), and threads started later
    inherit it; without the right, None and nothing changes."""
    import subprocess
    import sys

    code = (
        "import os, threading, time\n"
        "from host_tuning.niceness import set_process_niceness\n"
        "os.nice(15)\n"  # where Ray starts a worker
        "ray_thread = threading.Thread(target=time.sleep, args=(2,)); ray_thread.start()\n"
        "root = os.geteuid() == 0\n"
        "got = set_process_niceness(0)\n"
        "levels = {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')}\n"
        "seen = []\n"
        "t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0))); t.start(); t.join()\n"
        "if root: assert got == 0 and levels == {0} and seen == [0], (got, levels, seen)\n"
        "else: assert got is None and levels == {15}, (got, levels)\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def _stand_in_vllm(tmp_path, core: str) -> None:
    """A `vllm.v1.engine.core` module under tmp_path whose source is `core`."""
    package = tmp_path / "vllm" / "v1" / "engine"
    package.mkdir(parents=True)
    for folder in (tmp_path / "vllm", tmp_path / "vllm" / "v1", package):
        (folder / "__init__.py").write_text("")
    (package / "core.py").write_text(textwrap.dedent(core))


def _as_replica(tmp_path, main: str, out) -> None:
    """Run `main` as a replica would start vLLM's engine core: in a process of its own, with the
    stand-in vLLM and this repo importable, after the hook. `out`: a file, not a pipe, so an
    engine core left running cannot hold `run()` open."""
    import subprocess
    import sys

    script = textwrap.dedent(f"""
        import multiprocessing, os, signal, sys
        sys.path.insert(0, {str(tmp_path)!r})
        sys.path.insert(0, {os.getcwd()!r})
        from host_tuning.engine_group import own_session_for_engine
        from vllm.v1.engine.core import EngineCoreProc
        if __name__ == "__main__":
    """) + textwrap.indent(textwrap.dedent(main), "    ")
    done = subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT, timeout=120,
                          start_new_session=True, cwd=tmp_path)
    assert done.returncode in (0, -9), (tmp_path / "out").read_text()[-2000:]


def _started_engine_core(method: str, tmp_path) -> tuple[int, int, int, int]:
    """What the process that vLLM would start as its engine core reports about its session,
    started the way vLLM starts it (the class's static method as the target) after the hook."""
    _stand_in_vllm(tmp_path, """
        import os

        class EngineCoreProc:
            @staticmethod
            def run_engine_core(report, *, dp_rank=0):
                report.put((os.getpid(), os.getsid(0), os.getpgid(0), dp_rank))
    """)
    with open(tmp_path / "out", "w") as out:
        _as_replica(tmp_path, f"""
            assert own_session_for_engine() and own_session_for_engine()  # twice: hooked once
            context = multiprocessing.get_context({method!r})
            report = context.Queue()
            child = context.Process(target=EngineCoreProc.run_engine_core, args=(report,), kwargs={{"dp_rank": 3}})
            child.start()
            print(*report.get(timeout=60), os.getsid(0), flush=True)
            child.join(timeout=60)
        """, out)
    pid, sid, pgid, rank, parent_sid = map(int, (tmp_path / "out").read_text().split())
    assert rank == 3, "vLLM's own entry ran, with its arguments"
    return pid, sid, pgid, parent_sid


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_the_vllm_engine_core_takes_a_session_of_its_own(method, tmp_path):
    """host_tuning/engine_group.py: the engine core (and so the workers it starts) leaves the
    replica's session, so the kernel's autogroup schedules it apart from Ray's processes; with
    `spawn`, as vLLM starts it in a Ray actor, the child finds the hook by name."""
    pid, sid, pgid, parent_sid = _started_engine_core(method, tmp_path)
    assert sid == pid == pgid and sid != parent_sid


def test_an_engine_core_in_its_own_session_ends_when_the_replica_is_killed(tmp_path):
    """Out of the replica's session, nothing else stops the engine core with the replica: it
    watches for the replica's end and ends itself."""
    _stand_in_vllm(tmp_path, """
        import os, time

        class EngineCoreProc:
            @staticmethod
            def run_engine_core(report):
                report.put(os.getpid())
                time.sleep(120)
    """)
    with open(tmp_path / "out", "w") as out:
        _as_replica(tmp_path, """
            own_session_for_engine()
            context = multiprocessing.get_context("spawn")
            report = context.Queue()
            context.Process(target=EngineCoreProc.run_engine_core, args=(report,)).start()
            print(report.get(timeout=60), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # the replica, killed outright
        """, out)
    core = int((tmp_path / "out").read_text().split()[0])

    def running() -> bool:
        try:
            with open(f"/proc/{core}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except OSError:
            return False

    deadline = time.monotonic() + 20
    while running() and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = running()
    if alive:
        os.kill(core, 9)
    assert not alive, "the engine core outlived the replica"


def test_the_vllm_engine_keeps_its_session_where_vllm_has_no_such_entry(tmp_path, caplog):
    import sys

    from host_tuning import engine_group

    _stand_in_vllm(tmp_path, """
        class EngineCoreProc:
            pass
    """)
    saved = {name: module for name, module in sys.modules.items() if name == "vllm" or name.startswith("vllm.")}
    for name in saved:
        del sys.modules[name]
    sys.path.insert(0, str(tmp_path))
    try:
        assert engine_group.own_session_for_engine() is False
        assert "keeps Ray's scheduling group" in caplog.text
    finally:
        sys.path.remove(str(tmp_path))
        for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
            del sys.modules[name]
        sys.modules.update(saved)
