"""Async front of an engine: one worker thread, many concurrent streaming requests.

torch releases the GIL in its kernels, but two forward passes at once on a 2-core box only
thrash. So every forward pass of this replica (target and co-located draft) runs on ONE
worker thread, and the event loop stays free for new requests, health checks and cancellations.

An engine that holds a fixed number of sequences (llama.cpp's KV contexts) runs at most that
many at once; the others wait for a seat in arrival order. Let in, a fifth sequence on four
contexts evicts one, which then recomputes its whole context on its next step, and so on round
the circle, and throughput collapses.

Iteration-level batching: the decode steps that requests ask for while the worker is busy
are collected, and the next worker job runs them as ONE forward pass (earliest deadline first
when more are waiting than `max_batch_size`). A new request's prefill joins the worker's queue
and its first decode step joins the next batch; a finished request leaves at once. A request
alone speculates, and the worker runs its next step as soon as the last one ends, without a
trip through the event loop between them (target/run_ahead.py). When several wait,
`StepModeChooser` prices a batched plain step (the weights read once for all, a token each)
against a speculative round each in turn (several tokens per round) from what this replica
observed, and takes the cheaper per token: on a small CPU box, turns for a few requests,
batching for more.

An engine without batching (llama.cpp) runs each sequence's decode step as its own worker job,
so a new prompt queued behind a round of them would wait for every one: with 4 seats, up to
three steps, each slow beside a busy target, and under overload those waits were what made
first tokens late. There, a prefill goes ahead of
the decode steps queued before it; the step in progress still finishes. Each deferred step
keeps its place in the round and is deferred once at most. With batching, a queued pass lets a
waiting prompt go first (once), a drafter's long catch-up waits for a round (one under way
stops at its next 64-token chunk), and a draft round under way stops drafting: a new prompt
waits for at most the job in progress, and that job for at most a chunk of drafting.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from configs.schemas import HostTuningConfig, ModelStageConfig
from draft.factory import build_proposers
from draft.proposers import Proposer
from engines.base import Engine, PassStopped
from engines.factory import build_engine
from engines.grammar import GrammarState, compiler_for
from engines.types import GenerateChunk, GenerateRequest
from engines.worker_clock import Mark, WorkerClock
from host_tuning.lookup_window import PrefillWindow
from target import calibration
from target.adaptive import CostModel, KChooser
from target.decoding import Generation, Speculation
from target.engine_stats import EngineStats
from target.run_ahead import NOTHING, RunAhead
from target.step_mode import StepModeChooser
from target.step_queue import StepQueue, earliest_deadline_first

if TYPE_CHECKING:
    from engines.vllm_service import VLLMService

log = logging.getLogger(__name__)


class ModelService:
    def __init__(
        self,
        config: ModelStageConfig,
        engine: Engine | None = None,
        remote_draft: Proposer | None = None,
        host: HostTuningConfig | None = None,
    ) -> None:
        self.config = config
        host = host or HostTuningConfig()
        self.engine = engine or build_engine(config.engine, host.cores_shared)
        self.stats = EngineStats()
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{config.engine.model_id}")
        # Grammars compile here, never on the event loop or the engine's worker: a slow one
        # delays only the request that sent it.
        self._grammar_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.worker_clock = WorkerClock()  # splits a prompt's engine_queue into what ran ahead of it
        # Host tuning: a prefill beside the ingress's cache lookup leaves it a core meanwhile.
        self.window = PrefillWindow() if host.window else None
        # Batching needs an engine that can decode several sequences in one pass.
        self.max_batch = config.engine.max_batch_size if self.engine.batches else 1
        if self.engine.max_sequences:  # a batch never holds more sequences than the engine keeps KV for
            self.max_batch = min(self.max_batch, self.engine.max_sequences)
        self.steps = StepQueue(self.max_batch)  # decode steps waiting for the worker (batching engines)
        self._decoding = 0  # requests past their prefill: how many steps a full batch would hold
        self._prefill_jobs: set[Future] = set()  # prefills submitted to the worker, not yet done
        # The generation whose prefill runs on the worker now: a cancel stops that pass midway.
        self._prefilling: Generation | None = None
        self._prefilling_lock = threading.Lock()
        # Without batching, a prefill goes ahead of queued steps; False only to measure the
        # difference (bench prefill_order), not a serving knob.
        self.prefill_first = True
        # FIFO, and a waiter cancelled (client gone) gives up its place; one event loop per replica.
        self._seats = asyncio.Semaphore(self.engine.max_sequences) if self.engine.max_sequences else None
        self.proposers, self.draft_engine = build_proposers(
            config.speculative, remote_draft, share_cores=host.cores_shared, target_engine=self.engine
        )
        for proposer in self.proposers:  # long catch-ups and draft rounds give way to a queued prompt
            proposer.prompt_waiting = self._prefill_waiting
        self._live: dict[str, Generation] = {}  # request id -> its generation, for late hints
        self._ahead: dict[Generation, asyncio.Future] = {}  # next steps asked for before their consumer asks
        self.run_ahead = RunAhead()  # a lone request's next step, claimed by the worker (target/run_ahead.py)
        self._early_hints: OrderedDict[str, list[int]] = OrderedDict()  # late hints that beat their request here
        self.costs: CostModel | None = None
        self.step_mode: StepModeChooser | None = None  # batch the waiting steps, or a round each in turn
        # On the worker thread, like every later forward pass (target/calibration.py).
        model_id, on_worker = config.engine.model_id, self.executor.submit
        self.prefill_cost: tuple[float, float] | None = None  # (fixed ms, ms per token), timed on this replica
        self.step_ms_by_batch: dict[int, float] = {}  # a plain decode step of n sequences, timed on this replica
        if config.engine.warmup:
            on_worker(calibration.warm_up, model_id, self.engine, self.draft_engine).result()
            self.prefill_cost = on_worker(calibration.prefill_cost, model_id, self.engine).result()
        if self.proposers:
            self.costs = on_worker(
                calibration.speculation_costs, model_id, self.engine, self.draft_engine, config.speculative
            ).result()
        if self.max_batch > 1 and (config.engine.warmup or self.proposers):  # admission's and the chooser's prior
            self.step_ms_by_batch = on_worker(calibration.plain_step_ms, model_id, self.engine, self.max_batch).result()
        if self.proposers and self.step_ms_by_batch:
            self.step_mode = StepModeChooser(self.step_ms_by_batch, self.max_batch, self._turn_token_ms)

    async def warmup(self) -> None:
        """Nothing left to do: the constructor warmed the engines on the worker thread."""

    def _turn_token_ms(self) -> float:
        """Live ms per token of a request speculating on its own: its best drafter's, or plain."""
        drafted = [self.costs.steady_token_ms(p.name) for p in self.proposers if not p.free]
        return min([*drafted, self.costs.verify_ms(1)])

    def snapshot(self) -> dict[str, object]:
        """The counters, plus the prefix cache's (hit rate, blocks, memory) where the engine has
        one, the step modes chosen, and, with host tuning, the forward passes by thread count and
        the prefills begun beside a cache lookup."""
        cache = getattr(self.engine, "prefix_cache", None)
        out = {**self.stats.as_dict(), **(cache.stats() if cache is not None else {})}
        if self.prefill_cost is not None:  # admission's prior for this model (ingress/pipeline.py)
            out["prefill_fixed_ms"], out["prefill_ms_per_token"] = (round(v, 3) for v in self.prefill_cost)
        if self.step_ms_by_batch:  # admission's ITL prior by concurrency for this model
            out["decode_step_ms_by_batch"] = {n: round(ms, 3) for n, ms in self.step_ms_by_batch.items()}
        if self.step_mode is not None:
            out["step_mode_batched"] = self.step_mode.decisions["batched"]
            out["step_mode_turns"] = self.step_mode.decisions["turns"]
        if self.window is not None:
            out["prefills_beside_lookup"] = self.window.prefills
            out["lookup_windows_signalled"] = self.window.signalled  # ended by the ingress's mark
        cores = getattr(self.engine, "cores", None)
        if cores is not None and cores.enabled:  # forward passes on all threads / on one beside a busy box
            out["passes_all_threads"] = cores.passes["all"]
            out["passes_one_thread"] = cores.passes["one"]
            out["passes_alone"] = cores.passes["alone"]  # long passes, on all threads while other engines wait
            out["pass_lock_wait_ms"] = round(cores.waited_ms)  # this replica's passes waiting for others
        return out

    # ------------------------------------------------------------------ requests

    def _speculation(self, request: GenerateRequest | None = None) -> Speculation | None:
        if not self.proposers or self.costs is None:
            return None
        if request is not None and request.sampling.seed is not None and not request.sampling.greedy:
            # Speculation keeps the distribution but changes which random draws are used, and
            # k adapts to timing: a seeded sample would not repeat. Seeded sampling decodes plainly.
            return None
        spec = self.config.speculative
        return Speculation(self.proposers, KChooser(self.costs, enabled=spec.adaptive or spec.fixed_k is not None, fixed_k=spec.fixed_k))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        """Stream chunks for one request. Cancelling the consumer stops it within one step."""
        loop = asyncio.get_running_loop()
        enqueued = time.perf_counter()
        # From the ingress's send to here, on one clock where both share a node (else skewed).
        hop_in_ms = (time.time() - request.sent_unix) * 1000 if request.sent_unix else None
        self.stats.requests_started += 1
        self.stats.active += 1
        gen: Generation | None = None
        finished = decoding = seated = False
        try:
            if self._seats is not None:
                if self._seats.locked():
                    self.stats.seat_waits += 1
                await self._seats.acquire()
                seated = True
            if request.deadline_unix is not None and time.time() > request.deadline_unix:
                finished = True
                yield GenerateChunk("", 0, "abort", len(request.prompt_token_ids), 0, {"deadline_expired": 1.0})
                return
            grammar = await self._grammar(request)
            gen = Generation(self.engine, request, self._speculation(request), grammar)
            self._live[request.request_id] = gen
            early = self._early_hints.pop(request.request_id, None)
            if early is not None:
                gen.add_hint(early)
            job = self.executor.submit(self._timed_prefill, gen, enqueued, self.worker_clock.mark())
            self._prefill_jobs.add(job)
            job.add_done_callback(self._prefill_jobs.discard)
            chunk = await asyncio.wrap_future(job, loop=loop)  # cancelled before it runs: dropped
            if hop_in_ms is not None:
                chunk.timings_ms["hop.in"] = max(0.0, hop_in_ms)
            self._decoding += 1
            decoding = True
            self._step_ahead(gen, chunk)
            while True:
                self.stats.forward_passes += 1
                self.stats.tokens_generated += chunk.num_tokens
                if chunk.finish_reason is not None:
                    finished = True
                    self.stats.draft_tokens_proposed += int(chunk.timings_ms.get("spec_proposed", 0))
                    self.stats.draft_tokens_accepted += int(chunk.timings_ms.get("spec_accepted", 0))
                    self.stats.hint_tokens_proposed += int(chunk.timings_ms.get("spec_hint_proposed", 0))
                    self.stats.hint_tokens_accepted += int(chunk.timings_ms.get("spec_hint_accepted", 0))
                    yield chunk
                    return
                yield chunk
                chunk = await self._step(gen)
        finally:
            if gen is not None and self._live.get(request.request_id) is gen:
                del self._live[request.request_id]
            ahead = self._ahead.pop(gen, None) if gen is not None else None
            if ahead is not None:
                ahead.cancel()  # not run if it has not started; its result dropped if it has
            if gen is not None:
                self.run_ahead.forget(gen)
            self.stats.active -= 1
            if decoding:
                self._decoding -= 1
            if finished:
                self.stats.requests_finished += 1
            else:
                self.stats.requests_cancelled += 1
                if gen is not None:
                    self._stop_prefill(gen)
                if gen is not None and not gen.finished:
                    # Free KV / draft state on the worker thread, after any step in flight.
                    self.executor.submit(self._abort, gen, gen.rounds, time.perf_counter())
            if seated:  # after the abort is queued: the next sequence's prefill runs behind it
                self._seats.release()

    EARLY_HINTS_KEPT = 64  # late hints for requests not (yet) here: most never come (another replica)

    def late_hint(self, request_id: str, hint_ids: list[int]) -> bool:
        """A draft hint for a request already under way (see `Generation.add_hint`). True when
        the request is running here and a drafter took the hint; one that has not arrived yet
        gets it when it starts. On another replica it is kept for nothing and soon dropped."""
        if not any(p.takes_hints for p in self.proposers):
            return False
        gen = self._live.get(request_id)
        if gen is not None:
            return gen.add_hint(hint_ids)
        self._early_hints[request_id] = list(hint_ids)
        while len(self._early_hints) > self.EARLY_HINTS_KEPT:
            self._early_hints.popitem(last=False)
        return False

    async def _grammar(self, request: GenerateRequest) -> GrammarState | None:
        """The request's grammar, compiled on the grammar thread (cached per tenant)."""
        structured = request.sampling.structured
        if structured is None:
            return None
        compiler = compiler_for(self.engine.tokenizer, self.engine.eos_token_ids)
        return await asyncio.get_running_loop().run_in_executor(
            self._grammar_thread, compiler.state, structured, request.cache_salt
        )

    async def _step(self, gen: Generation) -> GenerateChunk:
        """The next decode step of `gen`: usually asked for already, the moment its last one
        came back (`_resolved`), so that it computes while the last chunk travels to the client."""
        ahead = self._ahead.pop(gen, None)
        return await (ahead if ahead is not None else self._next(gen))

    def _next(self, gen: Generation) -> asyncio.Future:
        """`gen`'s next step: the one the worker claimed and runs already, where it did
        (target/run_ahead.py), else a step queued now. On the event loop's thread."""
        loop = asyncio.get_running_loop()
        taken = self.run_ahead.take_up(gen, loop)
        if taken is None:
            return self._schedule(gen)
        future, result = taken
        if result is not NOTHING:  # it ended before this asked
            loop.call_soon(self._resolved, gen, future, result)
        return future

    def _schedule(self, gen: Generation) -> asyncio.Future:
        """Queue `gen`'s next decode step, batched with whatever other steps are waiting. On the
        event loop's thread."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if self.max_batch <= 1:  # a job per sequence's step (see the module docstring)
            self.executor.submit(self._run_one, loop, gen, done)
            return done
        if self.steps.add((gen, done)):
            self.executor.submit(self._run_batch, loop)
        return done

    def _step_ahead(self, gen: Generation, chunk: GenerateChunk | None) -> None:
        """Ask for `gen`'s next step now, before its consumer has taken `chunk`: the engine does
        not wait for the chunk's trip to the ingress (a hop per token) between two steps. Only
        while its consumer is still there, and one step ahead at most."""
        if chunk is None or chunk.finish_reason is not None or gen.finished or gen in self._ahead:
            return
        if self._live.get(gen.request.request_id) is gen:
            self._ahead[gen] = self._next(gen)

    def _resolved(self, gen: Generation, done: asyncio.Future, result) -> None:
        """On the event loop: a step's result reaches its waiter, and the step after it is
        asked for at once."""
        _resolve(done, result)
        if not done.cancelled() and not isinstance(result, BaseException):
            self._step_ahead(gen, result)

    def _run_one(self, loop: asyncio.AbstractEventLoop, gen: Generation, done: asyncio.Future,
                 deferred: bool = False) -> None:
        """On the worker thread: one sequence's decode step, after any prefill queued behind it."""
        if done.cancelled():
            return  # its client left: no step
        if not deferred and self._prefill_waiting():
            self.executor.submit(self._run_one, loop, gen, done, True)  # behind it, in its turn
            return
        self._answer(loop, gen, done, self._lone_step(gen))

    def _answer(self, loop: asyncio.AbstractEventLoop, gen: Generation, done: asyncio.Future, result) -> None:
        """On the worker thread: hand the loop `gen`'s step. While `gen` decodes alone and no
        job waits for the worker, claim its next step first and run it at once
        (target/run_ahead.py), for as long as the loop keeps taking the claims up."""
        while self._runs_ahead(gen, result) and self.run_ahead.claim(gen):
            loop.call_soon_threadsafe(self._resolved, gen, done, result)
            result = self._lone_step(gen)
            self.stats.steps_run_ahead += 1
            done = self.run_ahead.finish(gen, result)
            if done is None:  # the loop takes the chunk up when it asks, or the request is gone
                return
        loop.call_soon_threadsafe(self._resolved, gen, done, result)

    def _runs_ahead(self, gen: Generation, result) -> bool:
        """`gen` goes on, alone, its consumer still there, and no job waits for the worker (a
        prompt, another request's step, a draft's proposal, an abort: each then waits for one
        step at most). The loop's state read from the worker: at worst one step more is run,
        as the loop's own step ahead may."""
        if not isinstance(result, GenerateChunk) or result.finish_reason is not None or gen.finished:
            return False
        if self._decoding != 1 or not self.executor._work_queue.empty():
            return False
        return self._live.get(gen.request.request_id) is gen

    def _lone_step(self, gen: Generation) -> GenerateChunk | BaseException:
        """On the worker thread: one request's step on its own (a speculative round where it
        speculates), counted and timed."""
        start = time.perf_counter()
        try:
            with self.worker_clock.job("steps"):
                result = gen.step()
        except Exception as exc:  # never strand the waiting request
            return exc
        if self.step_mode is not None and gen.spec is None:
            self.step_mode.observe_plain((time.perf_counter() - start) * 1000)
        self.stats.decode_batches += 1
        self.stats.batched_steps += 1
        return result

    def _prefill_waiting(self) -> bool:
        """A prefill is queued on the worker and not yet running."""
        return self.prefill_first and any(not job.running() and not job.done() for job in list(self._prefill_jobs))

    BATCH_WAIT_S = 0.003  # longest a step waits for the rest of its batch to ask

    def _run_batch(self, loop: asyncio.AbstractEventLoop, deferred: bool = False) -> None:
        """On the worker thread: one forward pass for the waiting decode steps. A prompt queued
        behind this job goes first, once: otherwise it waits for the pass in progress and this
        one after it, and under overload that wait alone can miss its TTFT."""
        if not deferred and self._prefill_waiting():
            self.executor.submit(self._run_batch, loop, True)  # still scheduled: steps keep joining it
            return
        # The requests of the last batch ask for their next step one by one, as the event loop
        # hands each its chunk: give the stragglers a moment instead of running a batch of one.
        give_up = time.perf_counter() + self.BATCH_WAIT_S
        while len(self.steps) < min(self._decoding, self.max_batch) and time.perf_counter() < give_up:
            time.sleep(0.0002)
        waiting, more = self.steps.take()
        if more:  # the rest go next
            self.executor.submit(self._run_batch, loop)
        if not waiting:
            return
        gens = [g for g, _ in waiting]
        if len(gens) > 1 and self.step_mode is not None:
            speculating = sum(g.spec is not None for g in gens)
            if not self.step_mode.batch(speculating, len(gens) - speculating):
                self._run_turns(loop, waiting)
                return
        start = time.perf_counter()
        try:
            with self.worker_clock.job("steps", len(gens)):
                results: list = [gens[0].step()] if len(gens) == 1 else Generation.step_batch(gens)
        except Exception as exc:  # never strand a waiting request
            results = [exc] * len(gens)
        else:
            if self.step_mode is not None:
                ms = (time.perf_counter() - start) * 1000
                if len(gens) == 1 and gens[0].spec is None:
                    self.step_mode.observe_plain(ms)
                elif len(gens) > 1:
                    self.step_mode.observe_batch(len(gens), ms)
        self.stats.decode_batches += 1
        self.stats.batched_steps += len(gens)
        self.stats.max_batch = max(self.stats.max_batch, len(gens))
        if len(waiting) == 1:
            self._answer(loop, *waiting[0], results[0])
            return
        for (gen, done), result in zip(waiting, results):
            loop.call_soon_threadsafe(self._resolved, gen, done, result)

    def _run_turns(self, loop: asyncio.AbstractEventLoop, waiting: list[tuple[Generation, asyncio.Future]]) -> None:
        """On the worker thread: each waiting request's own step (a speculative round where its
        drafters pay), one after another, earliest deadline first. Each is answered as soon as
        its step is done; a prefill queued meanwhile goes ahead of the rest."""
        waiting = earliest_deadline_first(waiting)
        for index, (gen, done) in enumerate(waiting):
            if index and self._prefill_waiting():  # the rest keep their place, behind the prefill
                if self.steps.put_back(waiting[index:]):
                    self.executor.submit(self._run_batch, loop, True)  # deferred once already
                return
            if done.cancelled():
                continue  # its client left: no step
            loop.call_soon_threadsafe(self._resolved, gen, done, self._lone_step(gen))

    def _abort(self, gen: Generation, rounds_at_cancel: int, cancelled_at: float) -> None:
        gen.abort()
        after = gen.rounds - rounds_at_cancel
        self.stats.last_cancel_rounds_after = after
        self.stats.max_cancel_rounds_after = max(self.stats.max_cancel_rounds_after, after)
        self.stats.last_cancel_free_ms = round((time.perf_counter() - cancelled_at) * 1000)

    def _timed_prefill(self, gen: Generation, enqueued: float, mark: Mark) -> GenerateChunk | None:
        queue_ms = (time.perf_counter() - enqueued) * 1000
        ahead_ms = self.worker_clock.since(mark)
        jobs = self.worker_clock.jobs_since(mark)
        window = self.window.open(gen.engine, gen.request.lookup_overlap, enqueued) if self.window else None
        with self._prefilling_lock:
            self._prefilling = gen
        cores = getattr(gen.engine, "cores", None)
        waited_before = cores.waited_ms if cores is not None else 0.0
        try:
            with self.worker_clock.job("prefills"):
                chunk = gen.prefill()
        except PassStopped:
            self.stats.prefills_stopped += 1
            return None  # nobody waits for it; the abort queued behind frees the sequence
        finally:
            with self._prefilling_lock:
                self._prefilling = None
                gen.engine.stop_pass(False)
            if window is not None:
                self.window.close(window)
        if window is not None:
            self.window.report(window, chunk.timings_ms)
        chunk.timings_ms["engine_queue"] = queue_ms
        if cores is not None and cores.waited_ms > waited_before:  # inside "prefill": other engines' passes ran
            chunk.timings_ms["prefill.cores_wait"] = cores.waited_ms - waited_before
        for kind, ms in ahead_ms.items():  # the worker's time on others' work while this one waited
            chunk.timings_ms[f"engine_queue.{kind}"] = ms
        chunk.timings_ms.update(jobs.timings())  # how many jobs that was, and the longest: one slow pass, or many
        return chunk

    def _stop_prefill(self, gen: Generation) -> None:
        """A cancelled request's prefill, if it is the one running now, stops at its next layer:
        the cache hit that cancelled a model call started beside the lookup, or a client gone,
        no longer holds the worker for the rest of a prompt (seconds, for a long one on CPU)."""
        with self._prefilling_lock:
            if self._prefilling is gen:
                gen.engine.stop_pass(True)


def _resolve(done: asyncio.Future, result) -> None:
    if done.cancelled():
        return
    if isinstance(result, BaseException):
        done.set_exception(result)
    else:
        done.set_result(result)


def build_service(
    config: ModelStageConfig, remote_draft: Proposer | None = None, host: HostTuningConfig | None = None
) -> "ModelService | VLLMService":
    """vLLM runs its own scheduler and speculation; every other engine runs under ModelService
    (our batching, prefix cache and speculative decoding)."""
    if config.engine.kind == "vllm":
        from engines.vllm_service import VLLMService

        if host is not None and host.enabled and host.engine_own_session:
            from host_tuning.engine_group import own_session_for_engine

            own_session_for_engine()
        return VLLMService(config)
    return ModelService(config, remote_draft=remote_draft, host=host)
