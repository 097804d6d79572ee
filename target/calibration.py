"""A model replica's start-up: warm the engines, then measure what its decisions are priced
from on this hardware: a verify pass of m tokens and a draft token (the speculation cost
model), how often the draft picks the target's greedy token (the model drafter's acceptance
prior), and a plain decode step of n sequences (the step-mode chooser's prior). Each runs on
the replica's worker thread, like every later forward pass: a second thread running torch ops
would make OpenMP keep two thread teams on the same cores, and every decode step after that
would run several times slower."""

from __future__ import annotations

import logging
import time

from configs.schemas import SpeculativeConfig
from engines.base import Engine
from engines.types import GenerateRequest, SamplingParams
from target.adaptive import CostModel
from target.decoding import Generation

log = logging.getLogger(__name__)

WARMUP_TEXT = "Warm up the engine with a short prompt about the weather in a city by the sea."
AGREEMENT_TOKENS = 16  # greedy tokens the draft is checked against the target on


def warm_up(model_id: str, *engines: Engine | None) -> None:
    """Pay first-call costs (allocator, kernel selection) before real traffic arrives."""
    start = time.monotonic()
    for engine in filter(None, engines):
        ids = engine.tokenizer.encode(WARMUP_TEXT)
        gen = Generation(engine, GenerateRequest("warmup", ids, SamplingParams(max_tokens=4, temperature=0.0)))
        gen.prefill()
        while not gen.finished:
            gen.step()
    log.info("%s warm in %.2f s", model_id, time.monotonic() - start)


def speculation_costs(model_id: str, engine: Engine, draft_engine: Engine | None, spec: SpeculativeConfig) -> CostModel:
    """What verifying m tokens and drafting one token cost on this replica."""
    ids = engine.tokenizer.encode(WARMUP_TEXT)
    seq = engine.new_sequence()
    engine.prefill(seq, ids)
    base = seq.length

    def score(m: int) -> None:
        engine.score(seq, ids[:m] if m <= len(ids) else (ids * m)[:m])
        engine.rollback(seq, base)

    draft_ms = 0.05  # n-gram / hint lookups are practically free
    prefill_ms = 0.0
    priors: dict[str, float] = {}
    if draft_engine is not None:
        # A prompt no context has seen: the warm-up's would be mostly reused from the draft's
        # prefix cache and price a catch-up far too cheap, which would make the planner start
        # the draft on long RAG prompts.
        fresh = ids[1:] + ids[:1]  # rotated: shares no prefix with the warm-up
        target = _greedy(engine, fresh, AGREEMENT_TOKENS)
        dseq = draft_engine.new_sequence()
        with draft_engine.alone():
            t = time.perf_counter()
            logits = draft_engine.prefill(dseq, fresh)
            prefill_ms = (time.perf_counter() - t) * 1000 / len(fresh)
        # One pass prices a draft step and counts how often the draft picks the target's greedy
        # token: the model drafter's acceptance prior. The configured prior is a guess for any
        # draft; llama.cpp on the target's own GGUF agrees nearly always, so the first requests
        # can draft long.
        samples, agree = [], 0
        for token in target:
            agree += int(logits.argmax()) == token
            with draft_engine.alone():
                t = time.perf_counter()
                logits = draft_engine.decode_step(dseq, token)
                samples.append((time.perf_counter() - t) * 1000)
        draft_engine.release(dseq)
        draft_ms = sorted(samples)[len(samples) // 2]
        priors["model"] = min(0.95, max(0.3, agree / len(target)))  # a few tokens are a small sample
    costs = CostModel.calibrate(score, spec.k_max, draft_ms, spec.prior_acceptance, prefill_ms, acceptance_priors=priors,
                                hold=engine.alone)
    engine.release(seq)
    log.info(
        "%s speculation: verify ms by tokens %s, draft %.1f ms/token, draft prefill %.1f ms/token, acceptance priors %s",
        model_id, [round(v.value, 1) for v in costs.verify], draft_ms, prefill_ms, costs.calibrated["acceptance_priors"],
    )
    return costs


PREFILL_PROBE_TOKENS = (48, 304)  # two prompt lengths: a line through them prices a prefill
PREFILL_PROBE_ROUNDS = 3  # each length timed this often, the fastest kept


def prefill_cost(model_id: str, engine: Engine) -> tuple[float, float]:
    """(fixed ms per pass, ms per prompt token) of a prefill on this replica, from prompts no
    context has seen: what admission prices prompts by until it has timed its own. The
    configured prior is a guess for any hardware: priced by it, the first clump of prompts after
    a start reaches its first tokens several times later than predicted. A replica starts beside
    the graph's others, all loading at once on a small box: one probe that lost its cores to them
    would price every prompt of this model that slow, so each length is timed in several rounds
    (a salt each, nothing reused from an earlier one) and the fastest kept."""
    ids = engine.tokenizer.encode(WARMUP_TEXT)
    best = {n: float("inf") for n in PREFILL_PROBE_TOKENS}
    for round_ in range(PREFILL_PROBE_ROUNDS):
        for n in PREFILL_PROBE_TOKENS:
            prompt = [ids[(i * 7 + n) % len(ids)] for i in range(n)]  # shares no prefix with another probe
            seq = engine.new_sequence(salt=n + round_ * 1000)  # a salt of its own: no prefix reused
            with engine.alone():
                start = time.perf_counter()
                engine.prefill(seq, prompt)
                best[n] = min(best[n], (time.perf_counter() - start) * 1000)
            engine.release(seq)
    (n1, n2), (t1, t2) = PREFILL_PROBE_TOKENS, (best[n] for n in PREFILL_PROBE_TOKENS)
    per_token = max(0.01, (t2 - t1) / (n2 - n1))
    fixed = min(max(0.0, t1 - per_token * n1), t1)
    log.info("%s prefill: %.1f ms a pass + %.2f ms a prompt token", model_id, fixed, per_token)
    return fixed, per_token


def plain_step_ms(model_id: str, engine: Engine, max_batch: int) -> dict[int, float]:
    """ms of a plain decode step of n sequences (n = 1, 2, 4, 8; fastest of 3): the prior that
    the step-mode chooser weighs against speculating in turns."""
    ids = engine.tokenizer.encode(WARMUP_TEXT)
    sizes = sorted({1, *(n for n in (2, 4, 8) if n <= max_batch)})
    seqs = []
    for i in range(sizes[-1]):
        seq = engine.new_sequence()
        engine.prefill(seq, ids[i:] + ids[:i])
        seqs.append(seq)
    step_ms = {}
    for n in sizes:
        batch, samples = seqs[:n], []
        for _ in range(3):
            lengths = [seq.length for seq in batch]
            with engine.alone():
                start = time.perf_counter()
                engine.decode_batch(batch, ids[:n] if n <= len(ids) else [ids[0]] * n)
                samples.append((time.perf_counter() - start) * 1000)
            for seq, length in zip(batch, lengths):
                engine.rollback(seq, length)
        step_ms[n] = min(samples)
    for seq in seqs:
        engine.release(seq)
    log.info("%s plain decode step ms by batch size %s", model_id, {n: round(ms, 1) for n, ms in step_ms.items()})
    return step_ms


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    """The engine's first n greedy tokens after `prompt`."""
    seq = engine.new_sequence()
    logits = engine.prefill(seq, prompt)
    tokens = []
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = engine.decode_step(seq, tokens[-1])
    engine.release(seq)
    return tokens
