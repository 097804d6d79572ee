"""Domain logic without Ray: engine, detokenizer, sampling, admission, cache, router, context."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
import torch

from admission.ledger import AdmissionLedger, ReplicaReport
from configs.schemas import AdmissionConfig, CacheConfig, RouterConfig
from engines.detokenizer import IncrementalDetokenizer
from target.decoding import Generation
from engines.sampling import probabilities, sample
from engines.types import GenerateRequest, SamplingParams
from ingress.context import context_from_headers
from ingress.errors import APIError
from router.base import RouteFeatures
from router.rules import RuleRouter
from semantic_cache.exact import CachedResponse, ExactCache
from semantic_cache.keys import exact_key


@pytest.fixture(scope="module")
def serve_file():
    """The `transformers` target (float32, drafted by llama.cpp) these tests exercise:
    configs/cpu-exact.yaml, serve_config.yaml with that target."""
    from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config

    return load_serve_config(CPU_EXACT_CONFIG)


@pytest.fixture(scope="module")
def engine(serve_file):
    from engines.transformers_engine import TransformersEngine

    return TransformersEngine(serve_file.args.target.engine, serve_file.args.host_tuning.cores_shared)  # as shipped


# --------------------------------------------------------------------------- engine


def _prompt(engine, text="What is the capital of France?"):
    return engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )


def test_score_k_tokens_matches_stepwise_decoding_and_rolls_back(engine):
    ids = _prompt(engine)
    seq = engine.new_sequence()
    logits = engine.prefill(seq, ids)
    proposal = [int(torch.argmax(logits)), 578, 1500, 42]
    scored = engine.score(seq, proposal)
    assert scored.shape[0] == len(proposal)
    engine.rollback(seq, len(ids))
    assert seq.length == len(ids)
    for i, tok in enumerate(proposal):
        step = engine.decode_step(seq, tok)
        assert torch.allclose(step, scored[i], atol=1e-3), f"position {i}"
    engine.rollback(seq, len(ids) + 1)
    again = engine.decode_step(seq, proposal[1])
    assert torch.allclose(again, scored[1], atol=1e-3)


def test_prefix_cache_hits_shared_prefixes_and_keeps_greedy_output_identical(engine, serve_file):
    from engines.transformers_engine import TransformersEngine

    config = serve_file.args.target.engine.model_copy(deep=True)
    config.prefix_cache.enabled = False
    plain = TransformersEngine(config)
    assert engine.prefix_cache is not None and plain.prefix_cache is None
    system = "You are a careful assistant for a bank. Answer in one sentence. " * 6
    before = engine.prefix_cache.stats()
    for question in ["How do I open an account?", "What is an overdraft?", "How do I open an account?"]:
        ids = _prompt_with_system(engine, system, question)
        params = SamplingParams(max_tokens=16, temperature=0.0)
        cached_text, cached_last = _run(engine, params, ids)
        plain_text, _ = _run(plain, params, ids)
        assert cached_text == plain_text, question
    after = engine.prefix_cache.stats()
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= 2 * 64, after  # requests 2 and 3 reuse the system prompt
    seq = engine.new_sequence()
    ids = _prompt_with_system(engine, system, "How do I open an account?")
    engine.prefill(seq, ids)
    block = engine.prefix_cache.block_size
    assert seq.reused == (len(ids) - 1) // block * block, "all full blocks but the last token come from the cache"


def test_batched_decode_matches_one_sequence_at_a_time(engine):
    prompts = ["What is the capital of France?", "Write a poem about the sea, the wind and the moon.", "Hi"]
    single, batched = [], []
    for group in (single, batched):
        for text in prompts:
            seq = engine.new_sequence()
            group.append((seq, int(engine.prefill(seq, _prompt(engine, text)).argmax())))
    for _ in range(8):  # different lengths: the batch is left-padded and masked
        one = torch.stack([engine.decode_step(seq, tok) for seq, tok in single])
        many = engine.decode_batch([seq for seq, _ in batched], [tok for _, tok in batched])
        assert torch.allclose(one, many, atol=1e-3), (one - many).abs().max()
        assert one.argmax(-1).tolist() == many.argmax(-1).tolist()
        single = [(seq, int(t)) for (seq, _), t in zip(single, one.argmax(-1))]
        batched = [(seq, int(t)) for (seq, _), t in zip(batched, many.argmax(-1))]
    assert [s.length for s, _ in single] == [s.length for s, _ in batched]


def test_concurrent_requests_share_forward_passes(serve_file):
    from target.service import ModelService

    stage = serve_file.args.target.model_copy(deep=True)
    stage.speculative.method = "none"
    stage.engine.warmup = False
    service = ModelService(stage)
    questions = ["Name a fruit.", "Name a colour.", "Name a planet.", "Name a river."]

    async def collect(i: int) -> tuple[str, str | None, int]:
        ids = _prompt(service.engine, questions[i])
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



def test_a_forward_pass_runs_on_one_thread_while_another_process_keeps_a_core_busy(engine):
    """Two torch threads beside a busy process stall at every barrier (host_tuning/cores.py); the
    engine drops to one thread while another process keeps a core busy, and takes both back
    once the box is idle again. The load is measured off the request path."""
    import subprocess
    import sys

    from host_tuning.cores import BUSY_CORES

    assert engine.cores.enabled and engine.cores.max_threads == 2, "the shipped target shares its cores"
    load = engine.cores.load
    ids = _prompt(engine)

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
    # cores busy), the load of the others still reads below the mark. Counted as others, they
    # would read ~2 cores in every window; a shared box's own noise (0.40 once, in CI) passes in
    # a window or two, so the lowest of up to three windows decides.
    readings: list[float] = []
    while len(readings) < 3 and (not readings or readings[-1] >= BUSY_CORES):
        until = time.monotonic() + 0.5
        while time.monotonic() < until:
            one_pass()
        readings.append(round(load.cores, 2))
    assert min(readings) < BUSY_CORES, f"our own passes read as {readings} cores of others"
    assert one_pass() == 2

_HOLDER = """
import sys, time
from host_tuning.cores import PassLock
lock = PassLock(sys.argv[1])
print("ready", time.monotonic(), flush=True)
with (lock.alone() if sys.argv[2] == "alone" else lock.beside()):
    print("in", time.monotonic(), flush=True)
    time.sleep(float(sys.argv[3]))
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
        start = time.monotonic()
        with cores.forward_pass(8) as threads:
            assert threads == 1 and time.monotonic() - start < 0.3, "beside a pass: one thread, at once"
        with cores.forward_pass(EXCLUSIVE_MIN_TOKENS) as threads:
            waited = time.monotonic() - start
            assert threads == 2 and waited >= 0.3, f"a long pass waits for the one under way ({waited:.2f} s)"
    finally:
        other.wait(timeout=10)
    with cores.forward_pass(EXCLUSIVE_MIN_TOKENS) as threads:
        other = _other_engine(path, "beside", 0)
        time.sleep(0.5)
        ended = time.monotonic()
    assert threads == 2 and _entered(other) >= ended, "another engine's step waited for the long pass"
    other.wait(timeout=10)
    assert cores.passes == {"all": 1, "one": 1, "alone": 2}


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
    ids = _prompt(engine)

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
    question = _prompt(service.engine, "Name a fruit.")
    long_prompt = _prompt(service.engine, "Summarize this. " + "The sea is blue and the sky is wide. " * 150)

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


# int8 costs this 135M model real quality (bench ttft: ~70% teacher-forced agreement); the
# floor here only tells "degraded" from "broken" (a broken model agrees on ~0%).
@pytest.mark.parametrize("dtype, floor", [("bfloat16", 0.8), ("int8", 0.3)])
def test_reduced_precision_engines_load_and_agree_with_float32(engine, serve_file, dtype, floor):
    from engines.transformers_engine import TransformersEngine

    config = serve_file.args.target.engine.model_copy(deep=True, update={"dtype": dtype})
    config.prefix_cache.enabled = False
    reduced = TransformersEngine(config)
    linear = reduced.model.get_decoder().layers[0].mlp.up_proj
    assert ("quantized" in type(linear).__module__) if dtype == "int8" else linear.weight.dtype == torch.bfloat16
    ids = _prompt(engine, "Name three primary colours.")
    text, _ = _run(engine, SamplingParams(max_tokens=12, temperature=0.0), ids)
    reference = engine.tokenizer.encode(text, add_special_tokens=False)
    seq = reduced.new_sequence()
    first = int(reduced.prefill(seq, ids).argmax())
    predicted = [first, *reduced.score(seq, reference[:-1]).argmax(-1).tolist()]
    agreement = sum(p == r for p, r in zip(predicted, reference)) / len(reference)
    assert agreement >= floor, f"{dtype} agrees with float32 on {agreement:.0%} of next tokens"


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
        async for chunk in service.generate(GenerateRequest(request_id, _prompt(service.engine, text), params)):
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


def _prompt_with_system(engine, system, question):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )


def test_prefix_cache_evicts_leaves_first_and_checks_tokens():
    from engines.prefix_cache import PrefixCache

    def kv(n):  # one layer, n tokens, 4 bytes per value
        return [(torch.arange(n, dtype=torch.float32).view(1, 1, n, 1), torch.zeros(1, 1, n, 1))]

    cache = PrefixCache(block_size=2, max_bytes=6 * 16)  # room for 6 blocks of (2 keys + 2 values) floats
    cache.insert([1, 2, 3, 4, 5, 6, 7], kv(7))  # 3 full blocks
    reused, layers = cache.match([1, 2, 3, 4, 9, 9])
    assert reused == 4 and torch.equal(layers[0][0].flatten(), torch.tensor([0.0, 1, 2, 3]))
    assert cache.match([1, 2])[0] == 0, "the last prompt token is always computed"
    cache.insert([8, 8, 8, 8, 8, 8, 8, 8], kv(8))  # 4 more blocks: over budget, the oldest go
    assert cache.bytes <= cache.max_bytes
    assert cache.match([1, 2, 3, 4, 5, 6, 0])[0] in (0, 2, 4)  # evicted from the leaf back, never a hole
    assert cache.match([8] * 9)[0] == 8


def _run(engine, params, ids):
    gen = Generation(engine, GenerateRequest("t", ids, params))
    chunks = [gen.prefill()]
    while not gen.finished:
        chunks.append(gen.step())
    return "".join(c.text for c in chunks), chunks[-1]


def test_greedy_generation_is_deterministic_and_real(engine):
    ids = _prompt(engine)
    text1, last1 = _run(engine, SamplingParams(max_tokens=20, temperature=0.0), ids)
    text2, _ = _run(engine, SamplingParams(max_tokens=20, temperature=0.0), ids)
    assert text1 == text2 and "Paris" in text1
    assert last1.finish_reason == "stop" and last1.prompt_tokens == len(ids)


def test_seeded_sampling_reproducible_and_seed_sensitive(engine):
    ids = _prompt(engine, "Write a poem.")
    a, _ = _run(engine, SamplingParams(max_tokens=16, temperature=1.0, seed=7), ids)
    b, _ = _run(engine, SamplingParams(max_tokens=16, temperature=1.0, seed=7), ids)
    c, _ = _run(engine, SamplingParams(max_tokens=16, temperature=1.0, seed=8), ids)
    assert a == b and a != c


def test_max_tokens_is_clamped_to_the_context_window(engine):
    ids = _prompt(engine)
    gen = Generation(engine, GenerateRequest("t", ids, SamplingParams(max_tokens=10**6, temperature=0.0)))
    assert gen.max_tokens == engine.max_model_len - len(ids)


# --------------------------------------------------------------------------- detokenizer


def _stream(detok, tokenizer, text):
    out = [detok.add(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    out.append(detok.flush())
    return out


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 end", "plain ascii text"])
def test_detokenizer_never_emits_broken_utf8(engine, text):
    pieces = _stream(IncrementalDetokenizer(engine.tokenizer), engine.tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_cuts_at_stop_and_holds_back_partial_stops(engine):
    detok = IncrementalDetokenizer(engine.tokenizer, stop=("STOP here",))
    pieces = _stream(detok, engine.tokenizer, "alpha beta STOP here gamma")
    assert "".join(pieces) == "alpha beta "
    assert detok.stopped


def test_detokenizer_releases_partial_stop_at_the_end(engine):
    detok = IncrementalDetokenizer(engine.tokenizer, stop=("xyz!",))
    assert "".join(_stream(detok, engine.tokenizer, "ends with xy")) == "ends with xy"
    assert not detok.stopped


def test_stop_string_spanning_a_multibyte_character(engine):
    detok = IncrementalDetokenizer(engine.tokenizer, stop=("🚀",))
    assert "".join(_stream(detok, engine.tokenizer, "go 🚀 now")) == "go "


# --------------------------------------------------------------------------- sampling


def test_top_p_keeps_the_smallest_covering_set():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probabilities(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    probs = probabilities(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01))
    assert probs[0] == 1.0


@pytest.mark.parametrize("temperature, top_p", [(1.0, 5e-324), (5e-324, 1.0), (1e-300, 1e-300), (2.0, 1e-45)])
def test_extreme_sampling_values_stay_finite_and_pick_the_top_token(temperature, top_p):
    # Found by the schemathesis fuzzer: these made softmax/top-p return NaN and crashed the replica.
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 10
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    probs = probabilities(logits, params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-4
    assert sample(logits, params, torch.Generator().manual_seed(1)) == int(logits.argmax())


# --------------------------------------------------------------------------- admission


def test_ledger_shares_limits_among_live_replicas():
    now = [0.0]
    ledger = AdmissionLedger(AdmissionConfig(max_inflight=10, max_queued=5, sync_interval_s=1.0), clock=lambda: now[0])
    share = ledger.report("a", ReplicaReport(1, 0, 1, 0))
    assert (share.max_inflight, share.max_queued, share.live_replicas) == (10, 5, 1)
    share = ledger.report("b", ReplicaReport(2, 1, 2, 0))
    assert (share.max_inflight, share.max_queued, share.live_replicas) == (5, 3, 2)
    assert ledger.totals()["inflight"] == 3
    now[0] = 10.0  # "a" stopped reporting: it no longer holds a share
    assert ledger.report("b", ReplicaReport(0, 0, 2, 0)).max_inflight == 10
    # Each replica hears of the others' running requests, by model (its own are its own).
    ledger.report("c", ReplicaReport(3, 0, 3, 0, {"large": 2, "small": 1}))
    share = ledger.report("b", ReplicaReport(1, 0, 3, 0, {"large": 1}))
    assert share.others_inflight == {"large": 2, "small": 1}


# --------------------------------------------------------------------------- cache and keys


def _value(text="hi"):
    return CachedResponse(text, "stop", 3, 1, "m")


def test_exact_cache_ttl_lru_and_tenant_invalidation():
    now = [0.0]
    cache = ExactCache(CacheConfig(max_entries=2, ttl_s=10), clock=lambda: now[0])
    cache.put("k1", "t1", _value("a"))
    cache.put("k2", "t2", _value("b"))
    assert cache.get("k1").text == "a"
    cache.put("k3", "t1", _value("c"))  # evicts k2, the least recently used
    assert cache.get("k2") is None and cache.get("k3").text == "c"
    now[0] = 11.0
    assert cache.get("k1") is None  # expired
    cache.put("k4", "t1", _value())
    cache.put("k5", "t2", _value())
    assert len(cache.invalidate("t1")) == 1 and cache.get("k5") is not None


def test_cache_key_scopes_tenant_context_and_sampling():
    base = dict(tenant="t", model="chat:m", messages=[{"role": "user", "content": "Hi  there"}], sampling={"max_tokens": 5})
    key = exact_key(**base)
    assert key == exact_key(**{**base, "messages": [{"role": "user", "content": " Hi  there\n"}]})  # ends only
    # Whitespace inside is the text: code that differs only in its indentation is other code.
    assert key != exact_key(**{**base, "messages": [{"role": "user", "content": "Hi there"}]})
    code = lambda indent: [{"role": "user", "content": f"def f():\n{indent}return 1"}]  # noqa: E731
    assert exact_key(**{**base, "messages": code("    ")}) != exact_key(**{**base, "messages": code("  ")})
    assert key != exact_key(**{**base, "tenant": "u"})
    assert key != exact_key(**{**base, "sampling": {"max_tokens": 6}})
    with_history = [{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Ok"}] + base["messages"]
    assert key != exact_key(**{**base, "messages": with_history})
    assert key != exact_key(**{**base, "messages": [{"role": "system", "content": "x"}] + base["messages"]})


def test_cache_key_covers_tool_calls_ids_and_names():
    """Two agent conversations that differ only in a tool call's arguments, its id, the result's
    call id or a sender's name are other conversations: never one cached answer for both."""
    def convo(arguments='{"city": "Paris"}', call_id="call_1", answers="call_1", name=None):
        user = {"role": "user", "content": "Weather?", **({"name": name} if name else {})}
        return [user,
                {"role": "assistant", "content": "", "tool_calls": [{"id": call_id, "name": "w", "arguments": arguments}]},
                {"role": "tool", "content": "sunny", "tool_call_id": answers},
                {"role": "user", "content": "And so?"}]
    key = lambda messages: exact_key(tenant="t", model="chat:m", messages=messages, sampling={})  # noqa: E731
    base = key(convo())
    assert base == key(convo())
    assert base != key(convo(arguments='{"city": "Rome"}'))
    assert base != key(convo(call_id="call_2"))
    assert base != key(convo(answers="call_9"))
    assert base != key(convo(name="alice"))


# --------------------------------------------------------------------------- router


def test_rule_router():
    router = RuleRouter(RouterConfig(small_max_prompt_tokens=50, small_max_output_tokens=64), "large", "small")

    def route(**kw):
        f = dict(requested_model="auto", prompt_tokens=10, max_tokens=32, user_turns=1, last_user_message="hello")
        f.update(kw)
        return router.route(RouteFeatures(**f))

    assert (route().model_id, route().reason) == ("small", "simple")
    assert route(requested_model="large").reason == "explicit"
    assert route(prompt_tokens=51).reason == "long_prompt"
    assert route(max_tokens=65).reason == "long_output"
    assert route(user_turns=9).reason == "deep_conversation"
    assert route(last_user_message="Please PROVE it").reason == "hard_keyword"


# --------------------------------------------------------------------------- request context


def test_context_from_headers():
    ctx = context_from_headers({"authorization": "Bearer sk-secret", "x-request-deadline-ms": "1500"})
    assert ctx.tenant.startswith("key-") and "sk-secret" not in ctx.tenant
    assert 1.0 < ctx.remaining_s(100) <= 1.5
    assert context_from_headers({"x-tenant": "acme", "authorization": "Bearer k"}).tenant.endswith("/acme")
    assert context_from_headers({"x-tenant": "acme"}).tenant == "anonymous/acme"
    assert context_from_headers({}).tenant == "anonymous"
    ctx = context_from_headers({"cache-control": "no-cache", "x-slo-tier": "batch"})
    assert ctx.no_cache and not ctx.no_store and ctx.tier == "batch"
    for bad in ({"x-request-deadline-ms": "-1"}, {"x-request-deadline-ms": "abc"}, {"x-tenant": "a b"}):
        with pytest.raises(APIError):
            context_from_headers(bad)


# --------------------------------------------------------------------------- readiness


def test_health_says_warming_until_every_stage_answers(serve_file):
    from starlette.testclient import TestClient

    from ingress.api import build_api
    from ingress.pipeline import Pipeline

    pipeline = Pipeline(serve_file.args, backends=None, prompts={})
    client = TestClient(build_api(pipeline))
    pipeline.readiness.set(False)
    warming = client.get("/health")
    assert warming.status_code == 503 and warming.json()["status"] == "warming"
    pipeline.readiness.set(True)
    assert client.get("/health").json()["status"] == "ok"
    assert client.get("/v1/nope").json()["error"]["code"] == "not_found"


def test_idle_overlap_starts_the_model_beside_the_lookup_only_while_nothing_runs(serve_file):
    from ingress.pipeline import Pipeline

    args = serve_file.args.model_copy(deep=True)
    target = args.target.engine.model_id
    for mode, idle_answer in ((False, False), (True, True), ("idle", True)):
        args.ingress.overlap_cache_lookup = mode
        pipeline = Pipeline(args, backends=None, prompts={})
        assert pipeline.placement.overlap_lookup() is idle_answer, mode
        pipeline.gate.others_inflight = {target: 1}  # another ingress's request, as last synced
        assert pipeline.placement.overlap_lookup() is (mode is True), mode
        pipeline.gate.others_inflight = {}
        pipeline.placement.load.started(target)  # this ingress's own, before the gate's sync saw it
        assert pipeline.placement.overlap_lookup() is (mode is True), mode


def test_near_miss_hints_go_only_to_models_that_draft_from_them(serve_file):
    from ingress.pipeline import Pipeline
    from ingress.prepare import Prepared
    from semantic_cache.cache import Lookup
    from semantic_cache.exact import CachedResponse

    args = serve_file.args.model_copy(deep=True)
    target, small = args.target.engine.model_id, args.draft.engine.model_id
    pipeline = Pipeline(args, backends=None, prompts={})
    assert pipeline.cache.hint_models == {target}  # the small model does not speculate

    class Tokenizer:
        def encode(self, text, add_special_tokens):
            return [len(word) for word in text.split()]

    class Builder:
        tokenizer = Tokenizer()

    hint = Lookup("hint", CachedResponse("fifteen percent is 45", "stop", 5, 4, target), 0.8)
    p = Prepared.__new__(Prepared)
    p.cache_state, p.notes = "miss", {}
    assert pipeline.cache.hint_ids(p, small, Builder(), hint) is None and p.cache_state == "miss"
    assert pipeline.cache.hint_ids(p, target, Builder(), hint) == [7, 7, 2, 2] and p.cache_state == "hint"
    verify = Lookup("hint", hint.response, 0.93, "verify")  # semantic.mode verify: a match checked as a draft
    assert pipeline.cache.hint_ids(p, target, Builder(), verify) and p.cache_state == "verified"
    assert p.notes["x-cache-match"] == "verify;score=0.930"


def test_cache_key_follows_the_server_default_budget(serve_file):
    """The key is made before tokenizing, from the requested max_tokens; a request that leaves it
    to the server must not reuse answers made under another default budget."""
    from ingress.pipeline import Pipeline

    body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    short = serve_file.args.model_copy(deep=True)
    short.ingress.sampling.default_max_tokens = 16

    def key(args, **extra):
        return Pipeline(args, backends=None, prompts={}).preparer.prepare("chat", {**body, **extra}, context_from_headers({})).cache_key

    assert key(serve_file.args) != key(short)
    assert key(serve_file.args, max_tokens=8) == key(short, max_tokens=8)


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
        ids = _prompt(service.engine, questions[i])
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


def test_a_model_call_refused_at_a_full_serve_queue_is_a_503_with_retry_after_not_a_500():
    """Ray Serve refuses a call past the model's max_queued_requests with BackPressureError, and
    Ray's cancel() raises it again. Under FIFO at 4x capacity that escaped a cleanup path as a
    500 or cut the stream (bench load: 19 internal errors, 3 requests without an answer). The
    handle adapter (deployments/ingress.py) turns the refusal into a 503 and never raises on
    cancel; the pipeline passes the 503 on."""
    from types import SimpleNamespace

    from ray.serve.exceptions import BackPressureError

    from deployments.ingress import ServeModelStream
    from ingress.model_calls import ModelCalls

    class Refused:
        cancelled = 0

        async def __anext__(self):
            raise BackPressureError(num_queued_requests=64, max_queued_requests=64)

        def cancel(self):
            Refused.cancelled += 1
            raise BackPressureError(num_queued_requests=64, max_queued_requests=64)

    args = SimpleNamespace(ingress=SimpleNamespace(request_timeout_s=5.0, log_prompts=False))
    calls = ModelCalls(args, backends=None, load=None, metrics=None)  # type: ignore[arg-type]
    p = SimpleNamespace(ctx=SimpleNamespace(remaining_s=lambda cap: cap), model="smollm2-135m-instruct")
    with pytest.raises(APIError) as err:
        asyncio.run(calls.next(ServeModelStream(Refused(), p.model), p))
    assert err.value.status == 503 and err.value.code == "model_queue_full"
    assert err.value.headers["Retry-After"] == "1" and err.value.extra["model"] == p.model
    assert Refused.cancelled == 1
    ServeModelStream(Refused(), p.model).cancel()  # a cleanup path: never raises


def test_bench_engines_flag_is_checked_before_anything_runs(tmp_path, capsys):
    """`--engines` names engines of the engines suite only; a typo or another suite is refused
    at once (usage error), before any model loads or Ray starts."""
    from bench.__main__ import main
    from bench.engines import run

    with pytest.raises(SystemExit, match="transformers and/or vllm"):
        run(engines="tpu")
    with pytest.raises(SystemExit) as exit_info:
        main(["load", "--out", str(tmp_path / "x.json"), "--engines", "vllm"])
    assert exit_info.value.code == 2 and "does not apply to the load suite" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


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
        request = GenerateRequest(request_id, _prompt(service.engine, text), SamplingParams(max_tokens=1, temperature=0.0))
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
        assert 300 <= t["engine_queue.steps"] <= 420, t  # the step's last ~0.4 s
        assert t["engine_queue.steps"] + t["engine_queue.prefills"] <= t["engine_queue"] + 5, t
    assert one.timings_ms["engine_queue.prefills"] == 0.0, one.timings_ms
    assert two.timings_ms["engine_queue.prefills"] >= 0.9 * one.timings_ms["prefill"] - 2, (one.timings_ms, two.timings_ms)
    # The jobs that ran ahead, and the longest one whole (the step, 0.5 s, though 0.1 s ran before).
    assert one.timings_ms["engine_queue_jobs"] == 1.0 and two.timings_ms["engine_queue_jobs"] == 2.0, (one.timings_ms, two.timings_ms)
    for chunk in (one, two):
        assert 480 <= chunk.timings_ms["engine_queue_longest_ms"] <= 600, chunk.timings_ms
        assert chunk.timings_ms["engine_queue_longest_seqs"] == 1.0
        assert chunk.timings_ms["engine_queue_longest_cpu"] < 0.5, chunk.timings_ms  # it slept: no CPU
