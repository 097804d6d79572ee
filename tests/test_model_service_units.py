"""A model replica's scheduler (target/service.py): shared forward passes, prefill priority,
cancellation, seats, and what a prompt's engine queue says ran ahead of it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engines.types import GenerateRequest, SamplingParams
from tests.conftest import prompt_ids


@pytest.fixture(scope="module")
def serve_file(exact_serve_file):
    """The `transformers` target (float32, drafted by llama.cpp): configs/cpu-exact.yaml."""
    return exact_serve_file


def test_concurrent_requests_share_forward_passes(serve_file):
    from target.service import ModelService

    stage = serve_file.args.target.model_copy(deep=True)
    stage.speculative.method = "none"
    stage.engine.warmup = False
    service = ModelService(stage)
    questions = ["Name a fruit.", "Name a colour.", "Name a planet.", "Name a river."]

    async def collect(i: int) -> tuple[str, str | None, int]:
        ids = prompt_ids(service.engine, questions[i])
        request = GenerateRequest(f"r{i}", ids, SamplingParams(max_tokens=12, temperature=0.0))
        text, last = "", None
        async for chunk in service.generate(request):
            text, last = text + chunk.text, chunk
        return text, last.finish_reason, last.completion_tokens

    async def all_at_once():
        return await asyncio.gather(*(collect(i) for i in range(len(questions))))

    results = asyncio.run(all_at_once())
    stats = service.snapshot()
    assert stats["max_batch"] >= 2, stats  # steps were shared
    assert stats["decode_batches"] < stats["batched_steps"], stats
    for text, reason, tokens in results:
        assert text and reason in ("stop", "length") and 1 <= tokens <= 12
    service.max_batch = 1  # the same requests one forward pass each
    alone = asyncio.run(all_at_once())
    assert [r[0] for r in alone] == [r[0] for r in results], "batching changes no greedy output here"


def test_a_cancelled_request_stops_its_prefill_midway_and_the_next_one_is_untouched(serve_file):
    """A model call cancelled during its prefill (a cache hit beside it, a client gone) stops at
    the next decoder layer instead of holding the worker for the rest of the prompt; the
    engine's next pass runs whole and gives the same answer as before."""
    from target.service import ModelService

    stage = serve_file.args.target.model_copy(deep=True)
    stage.speculative.method = "none"
    stage.engine.warmup = False
    service = ModelService(stage)
    layers = service.engine.model.get_decoder().layers
    ran: list[int] = []
    layers[0].register_forward_pre_hook(lambda m, a: ran.clear())
    for index, layer in enumerate(layers):
        layer.register_forward_hook(lambda m, a, o, index=index: ran.append(index))
    question = prompt_ids(service.engine, "Name a fruit.")
    long_prompt = prompt_ids(service.engine, "Summarize this. " + "The sea is blue and the sky is wide. " * 150)

    async def answer(ids: list[int], rid: str) -> str:
        text = ""
        async for chunk in service.generate(GenerateRequest(rid, ids, SamplingParams(max_tokens=8, temperature=0.0))):
            text += chunk.text
        return text

    async def cancelled_mid_prefill() -> None:
        ran.clear()
        task = asyncio.ensure_future(answer(long_prompt, "long"))
        while service._prefilling is None or not ran:  # its prefill is under way: a layer has run
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    before = asyncio.run(answer(question, "before"))
    assert len(ran) == len(layers)
    asyncio.run(cancelled_mid_prefill())
    service.executor.submit(lambda: None).result()  # the stopped pass and the abort behind it are done
    assert 0 < len(ran) < len(layers), f"the prefill ran {len(ran)} of {len(layers)} layers"
    stats = service.snapshot()
    assert stats["prefills_stopped"] == 1 and stats["requests_cancelled"] == 1, stats
    assert asyncio.run(answer(question, "after")) == before and len(ran) == len(layers)
    service.executor.shutdown()


def _calls_after_a_prompt_queued_behind_a_step(service, names: tuple[str, ...]) -> tuple[list[str], int]:
    """A long answer decodes; a job holds the worker while the answer's next step queues behind
    it; a fresh prompt arrives. Returns the engine calls (of `names`) from the prompt's arrival
    on, and the long answer's token count."""
    calls: list[str] = []
    for name in names:
        real = getattr(service.engine, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        setattr(service.engine, name, wrapped)

    async def collect(request_id: str, text: str, max_tokens: int, started: asyncio.Event | None = None) -> int:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        n = 0
        async for chunk in service.generate(GenerateRequest(request_id, prompt_ids(service.engine, text), params)):
            n += chunk.num_tokens
            if started is not None and n >= 2:
                started.set()
        return n

    async def scenario() -> tuple[list[str], int]:
        decoding = asyncio.Event()
        long = asyncio.create_task(collect("long", "Count from one to fifty.", 24, decoding))
        await decoding.wait()
        blocking = threading.Event()

        def block() -> None:
            blocking.set()
            time.sleep(0.5)

        blocker = asyncio.get_running_loop().run_in_executor(service.executor, block)
        while not blocking.is_set():  # the step in progress is done; the worker sleeps
            await asyncio.sleep(0.005)
        for _ in range(200):  # the long request's next step queues behind the blocker
            if service.executor._work_queue.qsize() >= 1:
                break
            await asyncio.sleep(0.005)
        assert service.executor._work_queue.qsize() >= 1
        mark = len(calls)
        fresh = asyncio.create_task(collect("fresh", "Name a colour.", 2))
        await blocker
        await fresh
        return calls[mark:], await long

    try:
        return asyncio.run(scenario())
    finally:
        service.executor.shutdown()


def test_a_new_prompt_goes_ahead_of_queued_llamacpp_steps(serve_file):
    """The small model (llama.cpp) batches its sequences' decode steps, up to the sequences it
    keeps KV for. A prompt that arrives while a decode pass is queued behind the one in progress
    runs before it: under load it otherwise waited for a whole round of them (bench load:
    0.5-0.8 s in `engine_queue` at 4x capacity). The deferred pass still runs, and the long
    answer is complete."""
    from target.service import ModelService

    stage = serve_file.args.draft.model_copy(deep=True)
    stage.engine.warmup = False
    service = ModelService(stage)
    assert service.max_batch == stage.engine.max_sequences
    after, long_tokens = _calls_after_a_prompt_queued_behind_a_step(service, ("prefill", "decode_batch", "decode_step"))
    assert after[0] == "prefill", after[:4]
    assert long_tokens > 2  # the deferred step ran, and the answer went on


def test_a_new_prompt_goes_ahead_of_a_queued_batched_decode_pass(serve_file):
    """The batched target: a prompt that arrives while a decode pass is queued behind the job
    in progress runs before that pass (once), so it waits for one job, not two (bench load, 4x:
    944 ms of decode steps ahead of a prompt that missed its 1 s TTFT). The deferred pass still
    runs and the answer goes on."""
    from target.service import ModelService

    stage = serve_file.args.target.model_copy(deep=True)
    stage.speculative.method = "none"
    stage.engine.warmup = False
    service = ModelService(stage)
    assert service.max_batch > 1
    after, long_tokens = _calls_after_a_prompt_queued_behind_a_step(service, ("prefill", "decode_batch", "decode_step"))
    assert after and after[0] == "prefill", after[:4]
    assert long_tokens > 2  # the deferred pass ran, and the answer went on


def test_a_llamacpp_stage_runs_no_more_sequences_than_it_has_contexts(serve_file):
    """Three streams on two llama.cpp contexts: the third waits for a seat instead of evicting a
    live sequence (which would then recompute its whole context on every step: 4 streams on the
    small model made ~50 tokens/s, 6 made 2.4). A stream cancelled while waiting gives its place
    up. (Greedy text is not compared with solo runs: llama.cpp's numerics differ with how much
    of a prompt's KV a context could reuse, and that differs between the two.)"""
    from target.service import ModelService

    stage = serve_file.args.draft.model_copy(deep=True)
    stage.engine.max_sequences = 2
    stage.engine.warmup = False
    service = ModelService(stage)
    questions = ["Name a fruit.", "Name a colour.", "Name a planet."]

    async def collect(i: int) -> str:
        ids = prompt_ids(service.engine, questions[i])
        text = ""
        async for chunk in service.generate(GenerateRequest(f"r{i}", ids, SamplingParams(max_tokens=12, temperature=0.0))):
            text += chunk.text
        return text

    async def scenario() -> list[str]:
        concurrent = await asyncio.gather(*(collect(i) for i in range(3)))
        assert service.stats.seat_waits >= 1 and service.engine.evictions == 0
        streams = [asyncio.create_task(collect(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert service._seats.locked()  # two seated, the third waiting
        streams[2].cancel()
        await asyncio.gather(*streams[:2])
        with pytest.raises(asyncio.CancelledError):
            await streams[2]
        # Every seat came back: two more streams run at once, neither waits.
        waits = service.stats.seat_waits
        await asyncio.gather(*(collect(i) for i in range(2)))
        assert service.stats.seat_waits == waits and not service._seats.locked()
        return concurrent

    concurrent = asyncio.run(scenario())
    assert all(concurrent) and service.engine.evictions == 0
    service.executor.shutdown()


def test_a_prompts_engine_queue_splits_into_the_prefills_and_steps_that_ran_ahead_of_it(serve_file):
    """engines/worker_clock.py: the first chunk says how much of its `engine_queue` the worker
    spent on decode steps and on other prompts' prefills; the job running at arrival counts only
    from then on. Two prompts arrive while a 0.4 s step holds the worker: the first waited for
    the step alone, the second for the step and the first one's prefill."""
    from target.service import ModelService

    stage = serve_file.args.target.model_copy(deep=True)
    stage.speculative.method = "none"
    stage.engine.warmup = False
    service = ModelService(stage)

    async def first_chunk(request_id: str, text: str):
        request = GenerateRequest(request_id, prompt_ids(service.engine, text), SamplingParams(max_tokens=1, temperature=0.0))
        async for chunk in service.generate(request):
            return chunk

    async def scenario():
        running = threading.Event()

        def step() -> None:
            with service.worker_clock.job("steps"):
                running.set()
                time.sleep(0.5)

        held = asyncio.get_running_loop().run_in_executor(service.executor, step)
        while not running.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.1)  # 0.1 s of the step ran before the prompts came: not theirs to wait for
        chunks = await asyncio.gather(first_chunk("one", "Name a colour."), first_chunk("two", "Name a planet."))
        await held
        return chunks

    one, two = asyncio.run(scenario())
    service.executor.shutdown()
    for chunk in (one, two):
        t = chunk.timings_ms
        assert 0 < t["engine_queue.steps"] < t["engine_queue_longest_ms"], t  # the part of the step after it came
        assert t["engine_queue.steps"] + t["engine_queue.prefills"] <= t["engine_queue"] + 5, t
    assert one.timings_ms["engine_queue.prefills"] == 0.0, one.timings_ms
    assert two.timings_ms["engine_queue.prefills"] >= 0.9 * one.timings_ms["prefill"] - 2, (one.timings_ms, two.timings_ms)
    # The jobs that ran ahead, and the longest one whole (the step, 0.5 s, though 0.1 s ran before).
    assert one.timings_ms["engine_queue_jobs"] == 1.0 and two.timings_ms["engine_queue_jobs"] == 2.0, (one.timings_ms, two.timings_ms)
    for chunk in (one, two):
        assert chunk.timings_ms["engine_queue_longest_seqs"] == 1.0
        assert chunk.timings_ms["engine_queue_longest_cpu"] < 0.5, chunk.timings_ms  # it slept: no CPU


def test_the_step_queue_batches_by_deadline_and_schedules_one_runner_at_a_time():
    """target/step_queue.py, driven without threads: the first step asks for a runner, the
    others join it; past max_batch the earliest deadlines go first and the rest ask for another
    runner; a cancelled request has no step; steps put back keep their place, one runner."""
    from types import SimpleNamespace

    from target.step_queue import StepQueue

    loop = asyncio.new_event_loop()
    try:
        def step(deadline):
            return SimpleNamespace(request=SimpleNamespace(deadline_unix=deadline)), loop.create_future()

        queue = StepQueue(max_batch=2)
        late, none, early, gone = step(30.0), step(None), step(10.0), step(5.0)
        assert queue.add(late) and not queue.add(none) and not queue.add(early) and not queue.add(gone)
        gone[1].cancel()  # its client left
        taken, more = queue.take()
        assert taken == [early, late] and more, "earliest deadlines first; the one without waits"
        assert not queue.add(step(1.0)), "a runner is still scheduled for what is left"
        taken, more = queue.take()
        assert len(taken) == 2 and not more and len(queue) == 0
        assert queue.put_back([none]), "put back with no runner scheduled: schedule one"
        assert not queue.put_back([late]) and queue.take() == ([late, none], False)
    finally:
        loop.close()


def test_a_replica_measures_its_prefill_and_batched_step_for_admissions_priors():
    """A model replica measures a prefill's fixed part and per-token cost at its start (two
    prompts nothing is cached for), and a plain decode step of 1 to 8 sequences, and reports
    them; an ingress seeds admission with them, so the first prompts after a start are not
    priced by the configured guess, nor the ITL of several streams by a guessed batch cost."""
    from admission.policy import AdmissionPolicy
    from configs.schemas import AdmissionConfig
    from configs.serve_config import load_serve_config
    from target.service import ModelService

    stage = load_serve_config().args.draft.model_copy(deep=True)  # the shipped llama.cpp small model
    service = ModelService(stage)
    stats = service.snapshot()
    fixed, per_token = stats["prefill_fixed_ms"], stats["prefill_ms_per_token"]
    assert 0 <= fixed < 500 and 0.01 <= per_token < 50, stats
    policy = AdmissionPolicy(AdmissionConfig())
    policy.seed_prefill(stage.engine.model_id, fixed, per_token)
    est = policy.estimates[stage.engine.model_id]
    assert est.prefill_ms(400) == pytest.approx(fixed + 400 * per_token)
    assert policy.estimates["another"].prefill_ms(400) == pytest.approx(400 * AdmissionConfig().prior_prefill_ms_per_token)
    step = stats["decode_step_ms_by_batch"]
    assert sorted(step) == [1, 2, 4, 8] and all(0 < ms < 1000 for ms in step.values()), step
    # Batched on the shipped engine, 8 sequences' step costs less than 8 single steps.
    assert step[8] < 8 * step[1], step
    policy.seed_itl(stage.engine.model_id, step)
    assert est.itl_ms(8) == pytest.approx(step[8]) and est.itl_ms(1) == pytest.approx(step[1])



def test_a_prefill_probe_that_lost_its_cores_does_not_price_every_prompt():
    """At start a replica's probes share a small box with the graph's other replicas loading; a
    probe stalled by them must not become admission's price of this model's every prefill (its
    requests would be shed or moved as if every prompt took that long). Each length is timed
    in rounds that reuse nothing, the fastest kept."""
    from configs.serve_config import load_serve_config
    from engines.factory import build_engine
    from target import calibration

    engine = build_engine(load_serve_config().args.draft.engine)  # the shipped llama.cpp small model
    real, calls = engine.prefill, []

    def prefill(seq, token_ids):
        calls.append(len(token_ids))
        if len(calls) == 1:
            time.sleep(1.5)  # the first probe loses its cores
        logits = real(seq, token_ids)
        assert seq.reused == 0, "a probe round reused an earlier round's prefix"
        return logits

    engine.prefill = prefill
    fixed, per_token = calibration.prefill_cost("small", engine)
    assert calls.count(calibration.PREFILL_PROBE_TOKENS[0]) == calibration.PREFILL_PROBE_ROUNDS > 1
    assert fixed < 500 and 0.01 <= per_token < 50, (fixed, per_token)

def _text_of(service, request_id: str, question: str, max_tokens: int) -> tuple[str, int]:
    async def collect() -> tuple[str, int]:
        ids = prompt_ids(service.engine, question)
        text, tokens = "", 0
        async for chunk in service.generate(GenerateRequest(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))):
            text, tokens = text + chunk.text, tokens + chunk.num_tokens
        return text, tokens

    return asyncio.run(collect())


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculating"])
def test_a_lone_request_runs_its_steps_ahead_and_answers_the_same(serve_file, speculative):
    """target/run_ahead.py: a request decoding alone has its next step run by the worker as
    soon as its last one ends, with no trip through the event loop between them. Most of its
    steps go that way, and the answer, chunk order included, is the one it gets without."""
    from target.service import ModelService

    stage = serve_file.args.target.model_copy(deep=True)
    if not speculative:
        stage.speculative.method = "none"
    stage.engine.warmup = False
    service = ModelService(stage)
    question = "Explain in detail how a bicycle works."
    ahead_text, ahead_tokens = _text_of(service, "ahead", question, 40)
    steps = service.stats.decode_batches
    assert ahead_tokens == 40 and service.stats.steps_run_ahead >= steps - 2 > 0, service.snapshot()
    assert len(service.run_ahead) == 0
    service._runs_ahead = lambda gen, result: False  # every step through the event loop
    before = service.stats.steps_run_ahead
    plain_text, plain_tokens = _text_of(service, "plain", question, 40)
    assert service.stats.steps_run_ahead == before
    assert (ahead_text, ahead_tokens) == (plain_text, plain_tokens)
    service.executor.shutdown()


def test_a_job_queued_beside_a_lone_request_waits_for_one_step_at_most(serve_file):
    """While a request runs its steps ahead, a job queued for the worker (a new prompt's
    prefill, a draft's proposal for another replica, an abort) starts after the step in progress
    and at most the one already claimed, not after the whole answer."""
    from target.service import ModelService

    stage = serve_file.args.draft.model_copy(deep=True)
    stage.engine.warmup = False
    service = ModelService(stage)
    steps = [0]
    real = service.engine.decode_batch, service.engine.decode_step

    def count(fn):
        def counted(*a, **kw):
            steps[0] += 1
            return fn(*a, **kw)
        return counted

    service.engine.decode_batch, service.engine.decode_step = (count(fn) for fn in real)

    async def scenario() -> tuple[int, int, int]:
        started = asyncio.Event()

        async def collect() -> int:
            ids = prompt_ids(service.engine, "Count from one to one hundred.")
            n = 0
            async for chunk in service.generate(GenerateRequest("long", ids, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))):
                n += chunk.num_tokens
                if n >= 4:
                    started.set()
            return n

        long = asyncio.create_task(collect())
        await started.wait()
        at_submit = steps[0]
        ran_at = await asyncio.get_running_loop().run_in_executor(service.executor, lambda: steps[0])
        return at_submit, ran_at, await long

    at_submit, ran_at, tokens = asyncio.run(scenario())
    assert service.stats.steps_run_ahead > 0
    assert ran_at - at_submit <= 2, (at_submit, ran_at)
    assert tokens == 48
    service.executor.shutdown()


def test_a_lone_request_cancelled_while_running_ahead_leaves_nothing_claimed(serve_file):
    """Its consumer gone, the step under way ends, nothing more runs for it, its KV is freed on
    the worker, and the next request decodes (and runs ahead) as before."""
    from target.service import ModelService

    stage = serve_file.args.draft.model_copy(deep=True)
    stage.engine.warmup = False
    service = ModelService(stage)

    async def scenario() -> None:
        ids = prompt_ids(service.engine, "Count from one to one hundred.")
        stream = service.generate(GenerateRequest("gone", ids, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)))
        n = 0
        async for chunk in stream:
            n += chunk.num_tokens
            if n >= 6:
                break
        await stream.aclose()
        await asyncio.get_running_loop().run_in_executor(service.executor, lambda: None)  # after the abort
        assert service.stats.requests_cancelled == 1 and service.stats.active == 0
        assert len(service.run_ahead) == 0 and not service._ahead
        assert service.stats.last_cancel_rounds_after <= 2, service.snapshot()
        before = service.stats.steps_run_ahead
        text = ""
        async for chunk in service.generate(GenerateRequest("next", ids, SamplingParams(max_tokens=12, temperature=0.0))):
            text += chunk.text
        assert text and service.stats.steps_run_ahead > before

    asyncio.run(scenario())
    service.executor.shutdown()
