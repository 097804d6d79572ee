"""Speculative decoding on the real model: lossless greedy output, rollback, adaptive k."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch

from bench.workloads import conversations
from configs.schemas import EngineConfig, ModelStageConfig, SpeculativeConfig
from draft.proposers import ModelDraft, NgramDraft
from draft.remote import DraftSessions
from engines.types import GenerateRequest, SamplingParams, StructuredOutput
from target.adaptive import CostModel, KChooser
from target.decoding import Generation, Speculation


@pytest.fixture(scope="module")
def serve_file():
    """The `transformers` target (float32, drafted by llama.cpp) these tests exercise:
    configs/cpu-exact.yaml, serve_config.yaml with that target."""
    from configs.serve_config import CPU_EXACT_CONFIG, load_serve_config

    return load_serve_config(CPU_EXACT_CONFIG)


def _llama_config(serve_file) -> EngineConfig:
    return serve_file.args.target.speculative.draft_engine


@pytest.fixture(scope="module")
def spec_service(serve_file):
    from target.service import ModelService

    stage = ModelStageConfig(
        engine=serve_file.args.target.engine,
        speculative=SpeculativeConfig(method="ngram+draft_model", draft_engine=_llama_config(serve_file)),
    )
    return ModelService(stage)


def _chat_ids(tokenizer, conv) -> list[int]:
    text = tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(service, ids, params, speculation) -> tuple[list[int], str]:
    def run() -> tuple[list[int], str]:
        gen = Generation(service.engine, GenerateRequest("t", ids, params), speculation)
        chunks = [gen.prefill()]
        while not gen.finished:
            chunks.append(gen.step())
        return gen.tokens[len(ids) :], "".join(c.text for c in chunks)

    # On the replica's worker thread, as in serving: a second thread running the models would
    # give OpenMP a second thread team on the same cores and slow every pass ~3x.
    return service.executor.submit(run).result()


def _all_prompts():
    return [conv for convs in conversations().values() for conv in convs]


def test_greedy_speculation_is_token_identical_on_many_prompts(spec_service):
    tok = spec_service.engine.tokenizer
    params = SamplingParams(max_tokens=48, temperature=0.0)
    proposed = accepted = 0
    for conv in _all_prompts():
        ids = _chat_ids(tok, conv)
        plain, _ = _decode(spec_service, ids, params, None)
        spec = spec_service._speculation()
        fast, _ = _decode(spec_service, ids, params, spec)
        assert fast == plain, conv[-1]["content"][:60]
        proposed += spec.chooser.proposed
        accepted += spec.chooser.accepted
    assert proposed > 0 and accepted > 0, "speculation never ran: the test would prove nothing"


@pytest.mark.parametrize("k", [1, 3, 8])
def test_fixed_k_and_each_proposer_stay_lossless(spec_service, k):
    tok = spec_service.engine.tokenizer
    params = SamplingParams(max_tokens=32, temperature=0.0, stop=("\n\n",))
    ids = _chat_ids(tok, conversations()["code_edit"][0])
    plain, plain_text = _decode(spec_service, ids, params, None)
    for proposer in (ModelDraft(spec_service.draft_engine), NgramDraft()):
        spec = Speculation([proposer], KChooser(spec_service.costs, fixed_k=k))
        fast, text = _decode(spec_service, ids, params, spec)
        assert fast == plain and text == plain_text, f"{proposer.name} k={k}"


@pytest.mark.parametrize("adjust", [
    {"presence_penalty": 1.5}, {"frequency_penalty": 1.2}, {"repetition_penalty": 1.3},
    {"logit_bias": "first"}, {"min_tokens": 24}, {"ignore_eos": True},
])
def test_penalties_biases_and_eos_controls_stay_lossless_under_speculation(spec_service, adjust):
    """Each adjustment changes the greedy answer, and speculation (drafts at fixed k, the model
    draft and n-grams) reproduces the changed answer token for token: verification judges each
    draft position against the adjusted distribution, the drafts before it counted."""
    tok = spec_service.engine.tokenizer
    eos_controls = "min_tokens" in adjust or "ignore_eos" in adjust
    question = "Is the sky blue? Answer yes or no." if eos_controls else "List the colors of the rainbow, one per line."
    ids = _chat_ids(tok, [{"role": "user", "content": question}])
    plain, _ = _decode(spec_service, ids, SamplingParams(max_tokens=40, temperature=0.0), None)
    if adjust.get("logit_bias") == "first":  # push the plain answer's own first token away
        adjust = {"logit_bias": ((plain[0], -100.0),)}
    params = SamplingParams(max_tokens=40, temperature=0.0, **adjust)
    alone, alone_text = _decode(spec_service, ids, params, None)
    if eos_controls:
        assert len(plain) < 24 <= len(alone), "the answer ended early alone and went on past min_tokens"
    else:
        assert alone != plain, f"{adjust} did not change the answer: the test would prove nothing"
    proposed = 0
    for proposer in (ModelDraft(spec_service.draft_engine), NgramDraft()):
        spec = Speculation([proposer], KChooser(spec_service.costs, fixed_k=4))
        fast, text = _decode(spec_service, ids, params, spec)
        assert fast == alone and text == alone_text, (adjust, proposer.name)
        proposed += spec.chooser.proposed  # n-grams may find none to propose under a repetition penalty
    assert proposed > 0, "nothing was drafted: the test would prove nothing"


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_schema", json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                     "age": {"type": "integer"}}, "required": ["name", "age"], "additionalProperties": False})),
    StructuredOutput("json"),
    StructuredOutput("regex", "[A-Z][a-z]+ is [0-9]+ years old\\."),
])
def test_a_grammar_stays_lossless_under_speculation_and_drafts_it_forbids_cost_no_pass(spec_service, structured):
    """The grammar changes the answer; speculation reproduces it token for token, each verify
    row masked as the grammar stands after the drafts before it, and every emitted token keeps
    to the grammar (the whole output matches it)."""
    from engines.grammar import compiler_for

    tok = spec_service.engine.tokenizer
    ids = _chat_ids(tok, [{"role": "user", "content": "Ann is 31. Describe her as JSON with her name and age."}])
    plain, _ = _decode(spec_service, ids, SamplingParams(max_tokens=40, temperature=0.0), None)
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=structured)
    alone, alone_text = _decode(spec_service, ids, params, None)
    assert alone != plain, "the grammar did not change the answer: the test would prove nothing"
    proposed = 0
    for proposer in (ModelDraft(spec_service.draft_engine), NgramDraft()):
        spec = Speculation([proposer], KChooser(spec_service.costs, fixed_k=4))
        fast, text = _decode(spec_service, ids, params, spec)
        assert fast == alone and text == alone_text, (structured.kind, proposer.name)
        proposed += spec.chooser.proposed
    assert proposed > 0, "nothing was drafted: the test would prove nothing"
    state = compiler_for(tok, spec_service.engine.eos_token_ids).state(structured)
    for token in alone:
        assert token in spec_service.engine.eos_token_ids or state.accept(token), alone_text


def test_a_cached_answer_on_track_is_verified_whole_in_a_few_passes_and_a_wrong_one_changes_nothing(spec_service):
    """A verified semantic hit: the model's own answer offered as the draft is accepted in passes
    of 32, 64, 128 tokens (not k at a time), so the whole answer costs a few passes; an answer
    to another question is dropped at its first wrong token. Either way, the output is the
    model's own, token for token."""
    tok = spec_service.engine.tokenizer
    ids = _chat_ids(tok, [{"role": "user", "content": "Write a short story about a cat who learns to fly."}])
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain, plain_text = _decode(spec_service, ids, params, None)
    assert len(plain) == 48, "the answer must run to max_tokens for the pass count to mean anything"

    def with_hint(hint: list[int]) -> tuple[list[int], Generation]:
        def run():
            gen = Generation(spec_service.engine, GenerateRequest("t", ids, params, draft_hint_ids=hint),
                             spec_service._speculation())
            gen.prefill()
            while not gen.finished:
                gen.step()
            return gen.tokens[len(ids):], gen
        return spec_service.executor.submit(run).result()

    right, gen = with_hint(plain)
    assert right == plain
    assert gen.rounds <= 4, f"{gen.rounds} passes: the answer was not verified whole"  # prefill, 32, 15
    assert gen.spec.by_source["hint"][1] >= 48 - gen.rounds, gen.spec.by_source  # all but one token a pass
    other = _chat_ids(tok, [{"role": "user", "content": "Name three famous painters."}])
    wrong_answer, _ = _decode(spec_service, other, params, None)
    wrong, gen = with_hint(wrong_answer)
    assert wrong == plain and gen.spec.by_source.get("hint", [0, 0])[1] < 8, gen.spec.by_source


def test_sampled_speculation_respects_limits(spec_service):
    tok = spec_service.engine.tokenizer
    ids = _chat_ids(tok, conversations()["chat"][0])
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.95)
    # Pinned k: with a 20-token budget the planner may (rightly) not speculate at all.
    spec = Speculation(list(spec_service.proposers), KChooser(spec_service.costs, fixed_k=4))
    tokens, text = _decode(spec_service, ids, params, spec)
    assert 0 < len(tokens) <= 20 and text.strip()
    assert spec.chooser.proposed > 0
    assert sum(p for p, _ in spec.by_source.values()) == spec.chooser.proposed


def test_seeded_sampling_decodes_without_speculation(spec_service):
    request = GenerateRequest("t", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.7, seed=3))
    assert spec_service._speculation(request) is None
    greedy = GenerateRequest("t", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, seed=3))
    assert spec_service._speculation(greedy) is not None


def test_a_hint_that_arrives_after_its_request_is_drafted_from_and_stays_lossless(spec_service):
    """With the cache lookup beside the prefill, a near miss reaches the replica after its
    request started (or, raced, just before it): either way the drafters take it."""
    import asyncio

    tok = spec_service.engine.tokenizer
    ids = _chat_ids(tok, conversations()["chat"][1])
    params = SamplingParams(max_tokens=32, temperature=0.0)
    plain, plain_text = _decode(spec_service, ids, params, None)

    async def run(request_id: str, early: bool) -> tuple[str, bool]:
        took = spec_service.late_hint(request_id, plain) if early else None  # before it gets here
        stream = spec_service.generate(GenerateRequest(request_id, ids, params))
        text = (await stream.__anext__()).text  # prefilled: the drafters have not run yet
        if not early:
            took = spec_service.late_hint(request_id, plain)
        async for chunk in stream:
            text += chunk.text
        return text, took

    for early in (False, True):
        before = spec_service.stats.hint_tokens_accepted
        text, took = asyncio.run(run(f"late-{early}", early))
        assert took is (not early), "a running request takes the hint; one not here yet keeps it for later"
        assert text == plain_text
        assert spec_service.stats.hint_tokens_accepted - before >= 16, early
    assert spec_service.late_hint("late-False", plain) is False  # finished: nothing takes it
    assert "late-True" not in spec_service._early_hints  # consumed when it started


def test_llama_engine_score_rollback_and_context_stealing(spec_service):
    draft = spec_service.draft_engine
    ids = _chat_ids(spec_service.engine.tokenizer, conversations()["chat"][1])
    a = draft.new_sequence()
    first = draft.prefill(a, ids)
    nxt = int(torch.argmax(first))
    scored = draft.score(a, [nxt, 100, 200])
    draft.rollback(a, len(ids))
    again = draft.decode_step(a, nxt)
    assert torch.allclose(again, scored[0], atol=1e-4)
    # Other sequences take every slot; `a` must recompute, as a new sequence would compute it.
    others = [draft.new_sequence() for _ in range(draft_contexts(draft) + 1)]
    for i, seq in enumerate(others):
        draft.prefill(seq, [5 + i, 2, 3, 4])
    draft.rollback(a, len(ids))
    evictions = draft.evictions
    recomputed = draft.decode_step(a, nxt)
    assert draft.evictions > evictions, "a kept its slot: the test no longer steals it"
    fresh = draft.new_sequence(salt=1)  # another tenant's: computed from scratch, on the same path
    assert torch.allclose(recomputed, draft.prefill(fresh, ids + [nxt]), atol=1e-4)
    for seq in [a, fresh, *others]:
        draft.release(seq)


def draft_contexts(engine) -> int:
    return engine.max_sequences


def test_llama_engine_decodes_several_sequences_in_one_pass_as_it_does_them_alone(serve_file):
    """decode_batch: each sequence's logits match its own decode step, over several steps, with
    sequences of different lengths and one that was evicted and must recompute."""
    from engines.llamacpp_engine import LlamaCppEngine

    engine = LlamaCppEngine(_llama_config(serve_file).model_copy(update={"max_sequences": 3, "prefill_quant": None}))
    prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "One, two, three,",
                                                    "def add(a, b):\n    return")]

    def greedy(batched: bool) -> list[list[int]]:
        seqs = [engine.new_sequence() for _ in prompts]
        nxt = [int(torch.argmax(engine.prefill(s, p))) for s, p in zip(seqs, prompts)]
        out = [[n] for n in nxt]
        for _ in range(6):
            if batched:
                rows = engine.decode_batch(seqs, nxt)
            else:
                rows = torch.stack([engine.decode_step(s, n) for s, n in zip(seqs, nxt)])
            nxt = [int(torch.argmax(r)) for r in rows]
            for o, n in zip(out, nxt):
                o.append(n)
        for s in seqs:
            engine.release(s)
        return out

    alone = greedy(False)
    engine.forget_prefixes()
    assert greedy(True) == alone
    # a fourth sequence takes a slot from a live one, which recomputes inside the next batch
    seqs = [engine.new_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        engine.prefill(s, p)
    intruder = engine.new_sequence()
    engine.prefill(intruder, engine.tokenizer.encode("Hello there"))
    evicted = engine.evictions
    rows = engine.decode_batch(seqs, [alone[i][0] for i in range(3)])
    assert engine.evictions > evicted
    assert [int(torch.argmax(r)) for r in rows] == [alone[i][1] for i in range(3)]


def test_llama_engine_keeps_running_sequences_in_consecutive_slots(serve_file):
    """llama.cpp evaluates a batch in one pass only over consecutive sequence ids: when a
    sequence below running ones ends, the highest running one moves into its slot and decodes
    on exactly as it would have; a new sequence takes the next slot up."""
    from engines.llamacpp_engine import LlamaCppEngine

    engine = LlamaCppEngine(_llama_config(serve_file).model_copy(update={"max_sequences": 4, "prefill_quant": None}))
    prompts = [engine.tokenizer.encode(t) for t in ("The capital of France is", "One, two, three,",
                                                    "def add(a, b):\n    return")]

    def start() -> tuple[list, list[int]]:
        seqs = [engine.new_sequence() for _ in prompts]
        return seqs, [int(torch.argmax(engine.prefill(s, p))) for s, p in zip(seqs, prompts)]

    seqs, nxt = start()
    expected = [[n] for n in nxt]
    for _ in range(6):
        nxt = [int(torch.argmax(r)) for r in engine.decode_batch(seqs, nxt)]
        for out, n in zip(expected, nxt):
            out.append(n)
    for s in seqs:
        engine.release(s)
    engine.forget_prefixes()

    seqs, nxt = start()
    assert [s.kv.slot for s in seqs] == [0, 1, 2]
    got = [[n] for n in nxt]
    for _ in range(2):
        nxt = [int(torch.argmax(r)) for r in engine.decode_batch(seqs, nxt)]
        for out, n in zip(got, nxt):
            out.append(n)
    moves = engine.moves
    engine.release(seqs[0])  # the lowest ends: the highest running one moves into its slot
    assert engine.moves == moves + 1 and [seqs[1].kv.slot, seqs[2].kv.slot] == [1, 0]
    live, nxt = seqs[1:], nxt[1:]
    for _ in range(4):
        nxt = [int(torch.argmax(r)) for r in engine.decode_batch(live, nxt)]
        for out, n in zip(got[1:], nxt):
            out.append(n)
    assert got[1:] == expected[1:]
    newcomer = engine.new_sequence()
    engine.prefill(newcomer, prompts[0])
    assert newcomer.kv.slot == 2 and engine.evictions == 0
    for s in (*live, newcomer):
        engine.release(s)


@pytest.mark.parametrize("prefill_quant", [None, "q8_0"], ids=["plain", "prefill_copy"])
def test_llama_engine_copies_a_prefix_held_by_a_running_sequence(serve_file, prefill_quant):
    """A prompt whose prefix a running sequence's slot holds takes it by copy (with and without
    a prefill copy of the weights), answers as a cold prefill does on the float32 target, leaves
    the running sequence intact, and never copies across tenants (salts)."""
    from engines.llamacpp_engine import LlamaCppEngine

    config = serve_file.args.target.engine.model_copy(update={"max_sequences": 3, "prefill_quant": prefill_quant})
    engine = LlamaCppEngine(config)
    system = engine.tokenizer.encode("You are a support assistant for a cloud storage company. " * 6)
    # questions of 16+ tokens: with a prefill copy every way evaluates them on it
    first = system + engine.tokenizer.encode(" Q: How do I share a folder with my family and keep it private from others?")
    second = system + engine.tokenizer.encode(" Q: Can I get a refund for last month if I cancel my plan today, please?")

    def greedy(prompt, n=6, keep=False):
        seq = engine.new_sequence()
        out = [int(torch.argmax(engine.prefill(seq, prompt)))]
        for _ in range(n - 1):
            out.append(int(torch.argmax(engine.decode_step(seq, out[-1]))))
        if not keep:
            engine.release(seq)
        return out, seq

    cold, _ = greedy(second)  # each from an empty cache, as the running one starts
    engine.forget_prefixes()
    first_alone, _ = greedy(first, 7)
    engine.forget_prefixes()
    running_out, running = greedy(first, keep=True)  # still owns its slot
    copies = engine.prefix_cache.copies
    copied, seq = greedy(second)
    assert engine.prefix_cache.copies == copies + 1 and seq.reused >= len(system) - 1
    assert copied == cold
    # the running sequence decodes on as if nothing happened
    assert int(torch.argmax(engine.decode_step(running, running_out[-1]))) == first_alone[-1]
    other_tenant = engine.new_sequence(salt=7)
    engine.prefill(other_tenant, second)
    assert other_tenant.reused == 0 and engine.prefix_cache.copies == copies + 1


def test_draft_sessions_recompute_when_state_is_missing(spec_service):
    sessions = DraftSessions(spec_service.draft_engine, max_sessions=1)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    ids = _chat_ids(spec_service.engine.tokenizer, conversations()["chat"][2])
    first = sessions.propose("a", ids, 4, params, seed=0).tokens
    sessions.propose("b", ids[:-3], 2, params, seed=0)  # evicts "a"
    assert sessions.propose("a", ids, 4, params, seed=0).tokens == first
    assert sessions.recomputed == 3


def _costs() -> CostModel:
    return CostModel(8, [30, 33, 36, 44, 48, 53, 57, 60, 63], draft_ms_per_token=8.0, prior_acceptance=0.7)


def test_adaptive_k_turns_speculation_off_when_drafts_fail_and_on_when_they_pass():
    good = KChooser(_costs())
    for _ in range(10):
        good.observe("model", 8, 8, 64.0, 63.0)
    k, rate = good.plan("model", 64, free=False)
    assert k >= 6 and rate > good.plain_rate()
    bad = KChooser(_costs())
    for _ in range(10):
        bad.observe("model", 4, 0, 32.0, 44.0)
    assert bad.plan("model", 64, free=False)[0] == 0
    probes = [bad.should_probe() for _ in range(KChooser.PROBE_EVERY)]
    assert probes == [False] * (KChooser.PROBE_EVERY - 1) + [True], "it probes now and then"
    assert KChooser(_costs()).plan("model", 0, free=False)[0] == 0, "no room, no drafts"


def test_acceptance_is_estimated_per_token_not_per_proposal():
    chooser = KChooser(_costs())
    for _ in range(50):  # true per-token acceptance 0.9 at k=8: a prefix of ~5 of 8 accepted
        chooser.observe("model", 8, 5, 64.0, 63.0)
    assert 0.8 < chooser.acceptance("model") < 0.9  # accepted/proposed would say 0.625


def test_free_drafts_are_worth_verifying_at_lower_acceptance_than_costly_ones():
    chooser = KChooser(_costs())
    for source in ("ngram", "model"):
        for _ in range(20):
            chooser.observe(source, 4, 1, 0.0 if source == "ngram" else 80.0, 44.0)  # model: 20 ms/token
    assert chooser.plan("ngram", 4, free=True)[0] > 0
    assert chooser.plan("model", 8, free=False)[0] == 0


def test_a_started_draft_pays_its_catch_up_in_the_round_that_needs_it():
    costs = _costs()
    costs.draft_prefill_per_token = 8.0  # as dear as a draft step (llama.cpp Q4_1 on this CPU)
    chooser = KChooser(costs)
    for _ in range(10):
        chooser.observe("model", 6, 6, 48.0, 57.0)
    chooser.started.add("model")
    k, rate = chooser.plan("model", 8, free=False, catch_up_tokens=2, remaining=100)
    assert k > 0 and rate > chooser.plain_rate(), "the usual 2-token catch-up (last draft + bonus) is cheap"
    # 40 tokens came from prompt lookup since its last round: ~320 ms before it can propose.
    assert chooser.plan("model", 8, free=False, catch_up_tokens=40, remaining=100)[0] == 0
    # Not started yet: the prompt prefill is a one-off, spread over the rest of the output.
    fresh = KChooser(costs)
    for _ in range(KChooser.OBSERVE_STEPS):
        fresh.note_step(free_used=False)
    fresh.observe("model", 6, 6, 48.0, 57.0)
    assert fresh.plan("model", 8, free=False, catch_up_tokens=40, remaining=400)[0] > 0


def test_a_model_draft_with_cheaper_tokens_takes_over_the_free_drafters_steps_too():
    costs = _costs()
    costs.draft_prefill_per_token = 3.0
    chooser = KChooser(costs)
    for _ in range(KChooser.OBSERVE_STEPS):
        chooser.note_step(free_used=True)  # prompt lookup carried every step so far ...
        chooser.observe("ngram", 3, 1, 0.0, 36.0, free=True)  # ... at 18 ms per token
    chooser.observe("model", 6, 6, 48.0, 57.0)  # the model draft: ~15 ms per token
    assert chooser.plan("model", 8, free=False, catch_up_tokens=100, remaining=200)[0] > 0
    for _ in range(20):  # the lookup's drafts all pass: 5 tokens per 44 ms, the model can't beat that
        chooser.note_step(free_used=True)
        chooser.observe("ngram", 4, 4, 0.0, 44.0, free=True)
    assert chooser.plan("model", 8, free=False, catch_up_tokens=100, remaining=200)[0] == 0


def test_calibration_prices_the_draft_prefill_on_a_prompt_it_has_not_seen(spec_service):
    measured = spec_service.costs.calibrated  # at start-up: later rounds move the live estimates
    # Priced on the warm-up's prompt, which the draft still held, it came out ~1/15 of a draft
    # step on this CPU; a real prefill costs ~0.2 (Q8_0) to ~0.45 (Q4_1) of one here.
    assert measured["draft_prefill_ms_per_token"] > measured["draft_ms_per_token"] / 10, measured


def test_a_prompt_evaluated_on_the_requantized_copy_hands_a_working_kv_to_the_decoding_context(serve_file):
    from engines.llamacpp_engine import LlamaCppEngine

    config = _llama_config(serve_file).model_copy(update={"max_sequences": 1, "prefill_quant": None})
    plain = LlamaCppEngine(config)
    fast = LlamaCppEngine(config.model_copy(update={"prefill_quant": "q8_0"}))
    ids = _chat_ids(plain.tokenizer, conversations()["rag"][0])
    assert len(ids) > 64

    def teacher_forced(engine, cut: int) -> list[int]:
        """Greedy picks after the prompt and after each of 12 given tokens; the prompt's tail
        from `cut` on is evaluated again after a rollback (a catch-up on a held prefix)."""
        seq = engine.new_sequence()
        engine.prefill(seq, ids)
        engine.rollback(seq, cut)
        picks = [int(torch.argmax(engine.prefill(seq, ids[cut:])))]
        for token in forced:
            picks.append(int(torch.argmax(engine.decode_step(seq, token))))
        engine.release(seq)
        return picks

    seq = plain.new_sequence()
    forced = [int(torch.argmax(plain.prefill(seq, ids)))]
    for _ in range(11):
        forced.append(int(torch.argmax(plain.decode_step(seq, forced[-1]))))
    plain.release(seq)
    reference = teacher_forced(plain, len(ids) - 40)
    handed_over = teacher_forced(fast, len(ids) - 40)  # 40 tokens >= PREFILL_MIN_TOKENS: the copy runs them
    agree = sum(a == b for a, b in zip(reference, handed_over))
    assert agree >= len(reference) - 2, (reference, handed_over)  # a broken KV would agree on ~none


def test_a_repeated_prompt_gets_the_same_first_token_whether_or_not_its_prefix_was_cached(serve_file):
    """The shipped small model decodes on Q8_0 and prefills on a float32 copy: a repeated prompt,
    short or long, runs its last token on that copy too, so the first token comes from the same
    weights as on a cold cache (the newcomer's "capital of France" said Paris once, then
    something else on every repeat). A conversation's next turn, a few new tokens after a long
    prefix its slot holds, runs where it decodes where that is off the flash-attention kernel
    (`auto` on a CPU with AVX-512): no round trip of the held KV through the copy."""
    from engines.llamacpp_engine import NEXT_TURN_HELD_TOKENS, NEXT_TURN_NEW_TOKENS, LlamaCppEngine

    config = serve_file.args.draft.engine
    assert config.kind == "llama_cpp" and config.prefill_quant == "f32", "the shipped small model"
    engine = LlamaCppEngine(config.model_copy(update={"max_sequences": 2, "flash_attention": "off"}))
    turns = conversations()["rag"][0]
    long = _chat_ids(engine.tokenizer, turns)
    assert len(long) > NEXT_TURN_HELD_TOKENS
    for ids in (_chat_ids(engine.tokenizer, [{"role": "user", "content": "What is the capital of France?"}]), long):
        engine.forget_prefixes()
        passes = engine.copy_passes
        first = engine.new_sequence()
        cold = engine.prefill(first, ids)
        engine.release(first)
        again = engine.new_sequence()
        warm = engine.prefill(again, ids)
        assert again.reused == len(ids) - 1, "the repeat found its prompt held"
        engine.release(again)
        assert engine.copy_passes == passes + 2, "both on the copy"
        assert int(torch.argmax(warm)) == int(torch.argmax(cold))
        assert torch.allclose(warm, cold, atol=0.1)  # the held KV made a round trip between the contexts

    passes = engine.copy_passes
    next_turn = _chat_ids(engine.tokenizer, [*turns, {"role": "assistant", "content": "It is in the second one."},
                                             {"role": "user", "content": "Why?"}])
    seq = engine.new_sequence()
    engine.prefill(seq, next_turn)
    assert seq.reused >= len(long) - 2 and len(next_turn) - seq.reused < NEXT_TURN_NEW_TOKENS
    assert engine.copy_passes == passes, "the next turn ran where it decodes"
    engine.release(seq)
    # With the kernel in both contexts (the target's draft) nothing is re-laid: the copy is faster
    draft_config = serve_file.args.target.speculative.draft_engine
    assert draft_config.flash_attention == "on" and draft_config.prefill_quant is not None
    draft = LlamaCppEngine(draft_config.model_copy(update={"max_sequences": 2}))
    for ids in (long, next_turn):
        seq = draft.new_sequence()
        draft.prefill(seq, ids)
        draft.release(seq)
    assert draft.copy_passes == 2


def test_step_mode_speculates_in_turns_where_a_small_batch_costs_more_per_token_and_batches_beyond():
    from target.step_mode import StepModeChooser

    # This box's shape: a plain step of 2 costs ~1.8x one, of 8 ~3x; a round in turn ~30 ms/token.
    turn_ms = 30.0
    chooser = StepModeChooser({1: 70.0, 2: 125.0, 4: 150.0, 8: 210.0}, 16, lambda: turn_ms)
    assert chooser.batch_ms[2].value == pytest.approx(137.5)  # n=3 interpolated
    assert chooser.batch_ms[15].value == pytest.approx(210 + 15 * 8)  # beyond 8: the last slope
    assert not chooser.batch(2, 0) and not chooser.batch(3, 0)  # 62 / 46 ms per token batched
    assert chooser.batch(8, 0)  # 26 ms per token
    assert chooser.batch(0, 2), "requests that don't speculate gain nothing from turns"
    # Hysteresis: batched at 4 (37.5 ms/token) stays batched against turns at 36 ...
    chooser._batched = True
    turn_ms = 36.0
    assert chooser.batch(4, 0)
    # ... and switches for a clear gain; what the batches cost live moves the choice.
    turn_ms = 30.0
    for _ in range(10):
        chooser.observe_batch(4, 300.0)
    assert not chooser.batch(4, 0)
    # A close batch estimate (62.5 ms/token against 45) is re-measured once after a long run of turns.
    turn_ms = 45.0
    chooser = StepModeChooser({1: 70.0, 2: 125.0}, 16, lambda: turn_ms)
    choices = [chooser.batch(2, 0) for _ in range(StepModeChooser.PROBE_EVERY + 1)]
    assert choices == [False] * StepModeChooser.PROBE_EVERY + [True]
    assert chooser.decisions == {"batched": 1, "turns": StepModeChooser.PROBE_EVERY}


def test_concurrent_speculating_requests_stay_lossless_in_turns_and_batched(spec_service):
    """Several requests waiting for a step: a speculative round each in turn, or one batched
    plain pass. Each mode runs when the chooser names it, and greedy output is what each request
    decodes alone."""
    import asyncio

    tok = spec_service.engine.tokenizer
    questions = ["Name a fruit.", "Name a colour.", "Name a planet."]
    prompts = [_chat_ids(tok, [{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    alone = [_decode(spec_service, ids, params, None)[1] for ids in prompts]

    async def collect(i: int) -> str:
        text = ""
        async for chunk in spec_service.generate(GenerateRequest(f"m{i}", prompts[i], params)):
            text += chunk.text
        return text

    async def all_at_once() -> list[str]:
        return await asyncio.gather(*(collect(i) for i in range(len(prompts))))

    chooser = spec_service.step_mode
    assert chooser is not None, "the shipped target batches and speculates"
    live = chooser.turn_token_ms
    try:
        for mode, turn_ms in (("turns", 1e-3), ("batched", 1e6)):
            chooser.turn_token_ms, chooser._batched = (lambda v=turn_ms: v), None
            before = dict(chooser.decisions)
            proposed = spec_service.stats.draft_tokens_proposed
            assert asyncio.run(all_at_once()) == alone, mode
            other = "batched" if mode == "turns" else "turns"
            assert chooser.decisions[mode] > before[mode] and chooser.decisions[other] == before[other]
            if mode == "turns":
                assert spec_service.stats.draft_tokens_proposed > proposed, "rounds in turn speculate"
    finally:
        chooser.turn_token_ms, chooser._batched = live, None


def test_a_draft_models_long_catch_up_waits_while_a_new_prompt_is_queued(spec_service):
    """A model drafter's first round is its own prefill of the whole context: while a new
    prompt waits for the worker, that round is a plain step instead (the prompt is not held
    behind seconds of catch-up under load), and the drafter starts once the prompt is through.
    Greedy output is the same either way."""
    tok = spec_service.engine.tokenizer
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ids = _chat_ids(tok, conversations()["rag"][0])
    assert len(ids) > 64
    plain, _ = _decode(spec_service, ids, params, None)
    waiting = [True]
    drafter = ModelDraft(spec_service.draft_engine)
    calls: list[int] = []
    real = drafter.propose

    def propose(state, context, k, p, rng):
        calls.append(len(context))
        return real(state, context, k, p, rng)

    drafter.propose = propose
    drafter.prompt_waiting = lambda: waiting[0]
    spec = Speculation([drafter], KChooser(spec_service.costs, fixed_k=4))

    def run() -> tuple[list[int], int]:
        gen = Generation(spec_service.engine, GenerateRequest("t", ids, params), spec)
        gen.prefill()
        for _ in range(3):  # the prompt still waits: no catch-up, plain steps
            gen.step()
        held = len(calls)
        waiting[0] = False
        while not gen.finished:
            gen.step()
        return gen.tokens[len(ids) :], held

    tokens, held = spec_service.executor.submit(run).result()
    assert held == 0, "the drafter caught up while a prompt was waiting"
    assert calls, "the drafter never started once the prompt was through"
    assert tokens == plain


def test_a_draft_round_stops_drafting_early_for_a_waiting_prompt_and_stays_lossless(spec_service):
    """Proposer.prompt_waiting in ModelDraft: when a new prompt comes while a round drafts, the
    round sends what it has drafted (one token) to verification instead of drafting all k;
    greedy output is unchanged. The replica's own drafters are wired to its queue."""
    assert any(getattr(p, "prompt_waiting", None) == spec_service._prefill_waiting for p in spec_service.proposers)
    tok = spec_service.engine.tokenizer
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ids = _chat_ids(tok, conversations()["chat"][0])
    plain, _ = _decode(spec_service, ids, params, None)
    drafter = ModelDraft(spec_service.draft_engine)
    drafting = [False]  # the prompt comes once the round has begun (so no catch-up is held)
    drafter.prompt_waiting = lambda: drafting[0]
    sizes: list[int] = []
    real = drafter.propose

    def propose(state, context, k, p, rng):
        drafting[0] = True
        try:
            proposal = real(state, context, k, p, rng)
        finally:
            drafting[0] = False
        sizes.append(len(proposal.tokens))
        return proposal

    drafter.propose = propose
    fast, _ = _decode(spec_service, ids, params, Speculation([drafter], KChooser(spec_service.costs, fixed_k=6)))
    assert sizes and set(sizes) == {1}, sizes
    assert fast == plain


def test_a_draft_models_catch_up_stops_between_chunks_for_a_waiting_prompt_and_goes_on_later(spec_service):
    """ModelDraft feeds a long context in CATCH_UP_CHUNK-token chunks and looks for a waiting
    prompt between them: with one waiting, the round gets no draft (a plain step) after one
    chunk, the draft keeps what it was fed, and the next round goes on from there and drafts
    what an unbroken catch-up would have."""
    chunk = ModelDraft.CATCH_UP_CHUNK
    ids = _chat_ids(spec_service.engine.tokenizer, conversations()["rag"][0])
    assert len(ids) >= 2 * chunk, len(ids)  # else it runs whole
    params = SamplingParams(max_tokens=8, temperature=0.0)
    whole = ModelDraft(spec_service.draft_engine)
    state = whole.begin(ids)
    expected = whole.propose(state, ids, 4, params, None).tokens
    whole.end(state)

    spec_service.draft_engine.forget_prefixes()  # else it takes the prompt over from `whole`'s KV
    kept = spec_service.draft_engine.held_prefix(ids)  # what running sequences still hold (a few tokens)
    assert kept < chunk
    chunked = ModelDraft(spec_service.draft_engine)
    waiting = [True]
    chunked.prompt_waiting = lambda: waiting[0]
    state = chunked.begin(ids)
    assert chunked.propose(state, ids, 4, params, None).tokens == []
    assert state.tokens == ids[: kept + chunk] and chunked.catch_up(state, ids) == len(ids) - kept - chunk
    waiting[0] = False
    resumed = chunked.propose(state, ids, 4, params, None).tokens
    chunked.end(state)
    assert len(resumed) == 4 and sum(a == b for a, b in zip(resumed, expected)) >= 3, (resumed, expected)


def test_a_draft_catches_up_from_the_prefix_its_engine_keeps_and_drafts_as_from_cold(spec_service):
    """A shared system prompt or the conversation's last turn is in the draft engine's KV from an
    earlier request: a new request's draft counts only the rest as its catch-up (what the planner
    prices) and takes the rest over in its first chunk, instead of chunk by chunk from the start,
    where each chunk ending inside the kept prefix would compute it again."""
    engine = spec_service.draft_engine
    tok = spec_service.engine.tokenizer
    from bench.peer_workloads import _SYSTEM  # a ~300-token support assistant's system prompt

    first = _chat_ids(tok, [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "How do refunds work?"}])
    second = _chat_ids(tok, [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": "Can I share a plan?"}])
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    assert shared >= 2 * ModelDraft.CATCH_UP_CHUNK, shared  # else the catch-up runs whole anyway
    # Sampled, for the distribution the draft draws its first token from: this question is a
    # near-tie between two answers, which a reduced-precision pass over a different split of the
    # prompt may order either way, so the greedy tokens alone would not say whether it saw the
    # same context.
    params = SamplingParams(max_tokens=8, temperature=1.0)

    def draft(ids) -> tuple[int, torch.Tensor, int]:
        drafter = ModelDraft(engine)
        state = drafter.begin(ids)
        catch_up = drafter.catch_up(state, ids)
        hits = engine.prefix_cache.hit_tokens
        probs = drafter.propose(state, ids, 1, params, torch.Generator().manual_seed(0)).probs
        drafter.end(state)
        return catch_up, probs[0], engine.prefix_cache.hit_tokens - hits

    def run():
        engine.forget_prefixes()
        leftover = engine.held_prefix(second)  # what sequences still running hold (a few tokens)
        cold = draft(second)
        engine.forget_prefixes()
        draft(first)  # an earlier request leaves its KV
        return leftover, cold, draft(second)

    leftover, (cold_catch_up, cold, _), (catch_up, warm, reused) = spec_service.executor.submit(run).result()
    assert leftover < ModelDraft.CATCH_UP_CHUNK and cold_catch_up == len(second) - leftover
    assert catch_up <= len(second) - shared and reused >= shared, (catch_up, reused, shared)
    # The other question's context moves this distribution by over half its mass; the same
    # context split differently, by a few hundredths.
    assert float((warm - cold).abs().sum()) / 2 < 0.1, float((warm - cold).abs().sum()) / 2


def test_a_probe_never_starts_a_model_draft_the_plan_declined(spec_service):
    """With speculation not paying, a round now and then probes a drafter the request runs, to
    notice when its drafts get good again. A model drafter that has not started would first
    ingest the whole context, the one-off the planner weighed when it declined it: a probe must
    not pay that (on a long prompt and a short answer, that decodes slower than plain)."""
    import copy

    tok = spec_service.engine.tokenizer
    ids = _chat_ids(tok, conversations()["rag"][0])
    params = SamplingParams(max_tokens=3 * KChooser.PROBE_EVERY + KChooser.OBSERVE_STEPS, temperature=0.0)
    costs = copy.deepcopy(spec_service.costs)
    costs.draft_prefill_per_token = 1000 * costs.verify_ms(1)  # a catch-up never pays back here
    started: list[int] = []

    class Watched(ModelDraft):
        def propose(self, state, context, k, p, rng):
            started.append(len(context))
            return super().propose(state, context, k, p, rng)

    spec_service.draft_engine.forget_prefixes()
    spec = Speculation([Watched(spec_service.draft_engine)], KChooser(costs))
    tokens, _ = _decode(spec_service, ids, params, spec)
    assert len(tokens) == params.max_tokens, "the answer ended before a probe was due: the test proves nothing"
    assert started == [], started


def test_turns_that_give_way_to_a_prompt_leave_one_batch_runner_queued(spec_service):
    """ModelService._run_turns: when a waiting prompt cuts a round of turns short, the rest go
    to the one batch runner. A second runner queued beside one already there (the requests
    answered meanwhile had scheduled it) ran a turn ahead of each later prompt, and the runners
    grew with every cut: bench load at 4x saw 9-17 jobs ahead of prompts that missed their TTFT."""
    service = spec_service
    queued, most, deferred_runs = [0], [0], [0]
    submit, run_batch = service.executor.submit, service._run_batch

    def counted(loop, deferred=False):
        queued[0] -= 1
        deferred_runs[0] += deferred
        return run_batch(loop, deferred)

    def watch(fn, *args):
        if fn == service._run_batch:
            queued[0] += 1
            most[0] = max(most[0], queued[0])
            fn = counted
        return submit(fn, *args)

    tok = service.engine.tokenizer
    conv = conversations()["chat"]

    async def run(request_id: str, ids: list[int], max_tokens: int) -> None:
        async for _ in service.generate(GenerateRequest(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0))):
            pass

    async def scenario() -> None:
        long = [asyncio.create_task(run(f"long{i}", _chat_ids(tok, conv[i % len(conv)]), 48)) for i in range(3)]
        await asyncio.sleep(0.8)  # all three decoding, a turn each
        for j in range(6):
            await run(f"prompt{j}", tok.encode(f"Question {j}: name a colour."), 1)
            await asyncio.sleep(0.05)
        await asyncio.gather(*long)

    service.executor.submit, service.step_mode.batch = watch, lambda *args: False
    try:
        asyncio.run(scenario())
    finally:
        del service.executor.submit, service.step_mode.batch
    assert deferred_runs[0] >= 1  # turns did give way to a prompt
    assert most[0] == 1, most[0]


def test_cpu_repack_off_loads_without_extra_buffer_types_and_the_engine_runs(serve_file, monkeypatch):
    """`cpu_repack` (auto: off on AMX CPUs, where the bundled llama.cpp's AMX matmul crashed the
    replica): models load with `use_extra_bufts` off, and the engine still prefills and decodes."""
    import llama_cpp as lib

    from engines.llamacpp_engine import LlamaCppEngine

    loaded = []
    real = lib.llama_model_load_from_file
    monkeypatch.setattr(lib, "llama_model_load_from_file",
                        lambda path, params: loaded.append(params.use_extra_bufts) or real(path, params))
    engine = LlamaCppEngine(_llama_config(serve_file).model_copy(update={"max_sequences": 1, "cpu_repack": "off"}))
    assert loaded and not any(loaded), loaded
    seq = engine.new_sequence()
    logits = engine.prefill(seq, engine.tokenizer.encode("The capital of France is"))
    assert engine.tokenizer.decode([int(torch.argmax(logits))]).strip() == "Paris"
    engine.release(seq)


@pytest.mark.parametrize("flash_attention", ["off", "on"])
def test_flash_attention_reaches_every_context_and_the_kv_handover_still_works(serve_file, monkeypatch, flash_attention):
    """`flash_attention` sets the decoding context's attention; the prefill copy always runs
    flash attention, and a prompt's KV is re-laid when the two store V differently. Either way
    the engine decodes a long prompt as the shipped setting does."""
    import llama_cpp as lib

    from engines.llamacpp_engine import LlamaCppEngine

    seen = []
    real = lib.llama_init_from_model
    monkeypatch.setattr(lib, "llama_init_from_model", lambda model, params: seen.append(params.flash_attn_type) or real(model, params))
    config = serve_file.args.draft.engine.model_copy(update={"max_sequences": 2})
    assert config.flash_attention == "auto" and config.prefill_quant is not None, "the shipped small model"
    engine = LlamaCppEngine(config.model_copy(update={"flash_attention": flash_attention}))
    want = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attention == "on" else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
    assert seen == [want, lib.LLAMA_FLASH_ATTN_TYPE_ENABLED], seen  # the decoding context, the prefill copy

    def greedy(engine) -> list[int]:
        ids = _chat_ids(engine.tokenizer, conversations()["rag"][0])
        seq = engine.new_sequence()
        out = [int(torch.argmax(engine.prefill(seq, ids)))]  # on the prefill copy, KV handed over
        for _ in range(11):
            out.append(int(torch.argmax(engine.decode_step(seq, out[-1]))))
        engine.release(seq)
        return out

    picks = greedy(engine)
    monkeypatch.setattr(lib, "llama_init_from_model", real)
    other = "on" if flash_attention == "off" else "off"
    reference = greedy(LlamaCppEngine(config.model_copy(update={"flash_attention": other})))
    assert sum(a == b for a, b in zip(picks, reference)) >= len(reference) - 2, (picks, reference)
    assert len(set(picks)) > 3, picks  # a broken KV decodes a repeated token or noise


@pytest.mark.parametrize("avx512, want", [(True, "off"), (False, "on")])
def test_auto_attention_is_off_with_avx512_and_on_without(monkeypatch, avx512, want):
    """`flash_attention: auto` (the default) picks the decoding context's attention by the CPU:
    matrix products where AVX-512 makes them the faster step, the kernel elsewhere. The context
    llama.cpp creates gets that setting, and the engine knows its V layout (a KV handover
    re-lays it only where two contexts differ)."""
    import llama_cpp as lib

    from engines import llamacpp_engine
    from engines.llamacpp_engine import LlamaCppEngine, decode_attention

    monkeypatch.setattr(llamacpp_engine, "cpu_has_avx512", lambda: avx512)
    assert decode_attention("auto") == want
    assert decode_attention("on") == "on" and decode_attention("off") == "off"
    seen = []
    real = lib.llama_init_from_model
    monkeypatch.setattr(lib, "llama_init_from_model", lambda model, params: seen.append(params.flash_attn_type) or real(model, params))
    from configs.serve_config import load_serve_config

    config = load_serve_config().args.target.engine.model_copy(update={"max_sequences": 1})
    assert config.kind == "llama_cpp" and config.flash_attention == "auto", "the shipped target"
    engine = LlamaCppEngine(config)
    on = want == "on"
    assert seen[0] == (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if on else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED), seen
    assert engine.flash_attention == want and engine._ctx.v_transposed is (not on)


def test_the_shipped_small_model_answers_as_float32_does():
    """The default's small model (Q4_1 kernels, its prompt prefilled in float32) gives the float32
    target's greedy answer to a question a newcomer asks first; with its prompt in Q4_1 too it
    answered "L'Étoile, …"."""
    from configs.serve_config import load_serve_config
    from engines.llamacpp_engine import LlamaCppEngine

    args = load_serve_config().args
    answers = []
    for config in (args.draft.engine, args.target.engine):
        engine = LlamaCppEngine(config.model_copy(update={"max_sequences": 1}))
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False)
        seq = engine.new_sequence()
        out = [int(torch.argmax(engine.prefill(seq, ids)))]
        for _ in range(7):
            out.append(int(torch.argmax(engine.decode_step(seq, out[-1]))))
        answers.append(engine.tokenizer.decode(out))
    assert "Paris" in answers[0] and answers[0] == answers[1], answers


def test_the_small_models_prompts_run_on_the_targets_float32_weights():
    """serve_config.yaml's small model decodes on a requantized copy and prefills on a float32
    one: that float32 copy is made from the shipped file, as the target's is, so a prompt's
    logits (and the KV the small model decodes from) are the float32 target's own, to the
    rounding of attention summed in another order (flash attention on the prefill copy only;
    the same prompt prefilled on Q8_0 weights is off by ~0.9)."""
    from configs.serve_config import load_serve_config
    from engines.llamacpp_engine import LlamaCppEngine

    shipped = load_serve_config().args
    small_config = shipped.draft.engine
    assert small_config.weights != "gguf" and small_config.prefill_quant == shipped.target.engine.weights
    small = LlamaCppEngine(small_config.model_copy(update={"max_sequences": 1}))
    target = LlamaCppEngine(shipped.target.engine.model_copy(update={"max_sequences": 1}))
    ids = _chat_ids(target.tokenizer, conversations()["rag"][0])
    logits = [engine.prefill(engine.new_sequence(), ids) for engine in (small, target)]
    assert torch.allclose(logits[0], logits[1], atol=0.05), float((logits[0] - logits[1]).abs().max())
    assert int(torch.argmax(logits[0])) == int(torch.argmax(logits[1]))


@pytest.fixture(scope="module")
def shipped_pair():
    """serve_config.yaml's llama.cpp target and its co-located Q4_1 draft, two slots each."""
    from configs.serve_config import load_serve_config
    from engines.llamacpp_engine import LlamaCppEngine

    target_stage = load_serve_config().args.target
    target = LlamaCppEngine(target_stage.engine.model_copy(update={"max_sequences": 2}))
    draft = LlamaCppEngine(target_stage.speculative.draft_engine.model_copy(update={"max_sequences": 2}))
    return target, draft


def _rag_ids(tokenizer) -> list[int]:
    return _chat_ids(tokenizer, conversations()["rag"][0])


def test_a_draft_beside_the_llama_target_takes_the_prompts_kv_instead_of_prefilling_it(shipped_pair):
    """The shipped draft takes the request's prompt KV from the target (which prefilled it on
    the same float32 weights its prefill copy holds) instead of computing it again: its catch-up
    is the one token the target has yet to see, and it drafts what it drafts after its own
    prefill."""
    target, draft = shipped_pair
    assert draft.takes_kv_from(target)
    ids = _rag_ids(target.tokenizer)
    tseq = target.new_sequence()
    context = ids + [int(torch.argmax(target.prefill(tseq, ids)))]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    drafts = {}
    for name, drafter in (("own", ModelDraft(draft)), ("handoff", ModelDraft(draft, target))):
        draft.forget_prefixes()
        taken, copies = draft.kv_taken, draft.copy_passes
        state = drafter.begin(ids, target_seq=tseq)
        catch_up = drafter.catch_up(state, context)
        drafts[name] = drafter.propose(state, context, 6, params, None).tokens
        drafter.end(state)
        if name == "handoff":
            assert catch_up == 1 and draft.kv_taken == taken + 1 and draft.copy_passes == copies, (catch_up, name)
        else:
            assert catch_up == len(context) and draft.kv_taken == taken and draft.copy_passes > copies
    assert drafts["handoff"][:3] == drafts["own"][:3] and len(set(drafts["own"])) > 2, drafts
    target.release(tseq)


def test_a_draft_computes_its_own_prompt_where_the_target_no_longer_holds_it(shipped_pair):
    """A target sequence released (or another tenant's, or held by an engine with another
    stream count) hands nothing over: the draft catches up on its own, as without a target."""
    from engines.llamacpp_engine import LlamaCppEngine

    target, draft = shipped_pair
    ids = _rag_ids(target.tokenizer)
    drafter = ModelDraft(draft, target)
    tseq = target.new_sequence(salt=7)
    context = ids + [int(torch.argmax(target.prefill(tseq, ids)))]
    draft.forget_prefixes()
    assert draft.take_kv(draft.new_sequence(salt=8), context, target, tseq) == 0  # another tenant's
    target.release(tseq)
    taken = draft.kv_taken
    state = drafter.begin(ids, salt=7, target_seq=tseq)
    assert drafter.catch_up(state, context) == len(context)
    assert len(drafter.propose(state, context, 4, SamplingParams(max_tokens=8, temperature=0.0), None).tokens) == 4
    drafter.end(state)
    assert draft.kv_taken == taken
    # llama.cpp moves a sequence's state only between contexts of as many streams.
    from configs.serve_config import load_serve_config

    one_slot = LlamaCppEngine(load_serve_config().args.target.speculative.draft_engine.model_copy(update={"max_sequences": 1}))
    assert not one_slot.takes_kv_from(target) and not ModelDraft(one_slot, target).target


def test_a_handoff_llama_cpp_refuses_turns_the_handoff_off_and_the_draft_still_drafts(shipped_pair, monkeypatch):
    from engines import llamacpp_context
    from engines.kv_state import KVStateFormatError

    target, draft = shipped_pair
    ids = _rag_ids(target.tokenizer)
    tseq = target.new_sequence()
    context = ids + [int(torch.argmax(target.prefill(tseq, ids)))]
    draft.forget_prefixes()
    real = llamacpp_context.Context.restore

    def refuse(ctx, buf, seq, source=None):
        if source is target._ctx:
            raise KVStateFormatError("not as this module reads it")
        return real(ctx, buf, seq, source)

    monkeypatch.setattr(llamacpp_context.Context, "restore", refuse)
    drafter = ModelDraft(draft, target)
    state = drafter.begin(ids, target_seq=tseq)
    try:
        proposal = drafter.propose(state, context, 4, SamplingParams(max_tokens=8, temperature=0.0), None)
        assert len(proposal.tokens) == 4 and not draft.takes_kv_from(target)
        assert drafter.catch_up(state, context + proposal.tokens[:1]) <= 2  # it went on from its own prefill
    finally:
        drafter.end(state)
        target.release(tseq)
        draft._kv_refused = False


def test_greedy_speculation_with_the_kv_handoff_is_token_identical_on_the_shipped_target(shipped_pair):
    """The shipped target drafted by its Q4_1 copy, each prompt's KV handed over: the greedy
    answer is the target's alone, token for token, and the drafts were taken over, not prefilled."""
    target, draft = shipped_pair
    tok = target.tokenizer
    params = SamplingParams(max_tokens=32, temperature=0.0)
    costs = CostModel(8, [20.0] * 9, 5.0, 0.8, draft_prefill_ms_per_token=1.0)
    taken, accepted = draft.kv_taken, 0
    for workload in ("rag", "chat", "code_edit"):
        ids = _chat_ids(tok, conversations()[workload][0])
        outputs = []
        for spec in (None, Speculation([ModelDraft(draft, target)], KChooser(costs, fixed_k=4))):
            gen = Generation(target, GenerateRequest("t", ids, params), spec)
            gen.prefill()
            while not gen.finished:
                gen.step()
            outputs.append(gen.tokens[len(ids):])
            accepted += spec.chooser.accepted if spec else 0
        assert outputs[0] == outputs[1], workload
    assert draft.kv_taken >= taken + 3 and accepted > 0, "no handoff or no accepted draft: the test would prove nothing"


def test_calibration_times_a_few_pass_sizes_and_prices_every_k_on_one_line():
    timed: list[int] = []

    def score(m: int) -> None:  # a pass: 20 ms fixed plus 1 ms a token
        timed.append(m)
        time.sleep((20 + m) / 1000)

    costs = CostModel.calibrate(score, 16, draft_ms_per_token=5.0, prior_acceptance=0.7, reps=1)
    assert sorted(set(timed)) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17], "a long k_max adds few timings"
    assert len(costs.verify) == 17 and costs.verify_ms(1) < costs.verify_ms(12) < costs.verify_ms(17)
    assert costs.verify_ms(12) == pytest.approx(32, abs=4), "sizes it did not time lie on the fitted line"
    assert len(CostModel.calibrate(lambda m: None, 8, 5.0, 0.7, reps=1).verify) == 9


def test_a_grammar_cutting_drafts_short_leaves_the_draft_priced_per_token_it_made(spec_service):
    """A grammar cuts a model draft at the first token it forbids, before the verify pass; the
    draft's time was still spent on every token it made. Priced per token that survived the
    cut, one structured request would leave the replica's draft looking several times dearer,
    and every later request on it would draft less."""
    import copy

    tok = spec_service.engine.tokenizer
    ids = _chat_ids(tok, [{"role": "user", "content": "What is the capital of France? Answer in a sentence."}])
    params = SamplingParams(max_tokens=80, temperature=0.0, structured=StructuredOutput("regex", "[A-Z][a-z ,]+\\."))
    costs = copy.deepcopy(spec_service.costs)
    before = costs.draft_per_token.value
    made: list[int] = []

    class Counted(ModelDraft):
        def propose(self, *args, **kwargs):
            proposal = super().propose(*args, **kwargs)
            made.append(len(proposal.tokens))
            return proposal

    spec = Speculation([Counted(spec_service.draft_engine)], KChooser(costs, fixed_k=6))
    _decode(spec_service, ids, params, spec)
    assert sum(made) > 2 * spec.chooser.proposed, ("the grammar cut few drafts: the test would prove nothing", made)
    assert costs.draft_per_token.value < 1.8 * before, (before, costs.draft_per_token.value, made)
