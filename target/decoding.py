"""One request's decode loop as a step-wise state machine, with optional speculation.

`Generation.prefill()` and `Generation.step()` each run one target forward pass and return a
chunk. The async service calls them one at a time on the engine's worker thread, so between
two forward passes the request can be cancelled, and requests interleave fairly.

A step is either a plain decode (one token) or a speculative round:
    draft proposes k tokens -> target scores [last, d1..dk] in ONE forward pass
    -> verify (greedy match / rejection sampling) -> roll the KV back past rejected drafts
    -> emit the accepted drafts plus one target token.
The emitted tokens are exactly what target-alone decoding would produce (greedy), or
distributed exactly like it (sampling).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from draft.proposers import Proposal, Proposer
from engines.base import Engine
from engines.blocks import salt_root
from engines.detokenizer import IncrementalDetokenizer
from engines.grammar import GrammarState, compiler_for
from engines.sampling import LOGPROB_FLOOR, LogitsAdjuster, end_where_nothing_is_allowed, make_generator, sample
from engines.types import GenerateChunk, GenerateRequest
from target.adaptive import KChooser
from target.verify import verify


@dataclass
class Speculation:
    """What a request needs to speculate: its drafters (+ per-request state) and a k chooser."""

    proposers: list[Proposer]
    chooser: KChooser
    states: list[Any] = field(default_factory=list)
    draft_ms: float = 0.0
    verify_ms: float = 0.0
    by_source: dict[str, list[int]] = field(default_factory=dict)  # source -> [proposed, accepted]


# A catch-up this long is a prefill, not a re-feed of the last few tokens after a rejection.
HELD_CATCH_UP_TOKENS = 32
# A cached answer still on track is verified this many tokens per pass at first, then twice as
# many each pass it is wholly accepted, up to the most. A pass's cost grows far slower than its
# tokens: a 64-token answer the model agrees with takes two passes; one it rejects at once costs
# one short pass more than a plain step.
ANSWER_CHUNK_FIRST, ANSWER_CHUNK_MAX = 32, 128


class Generation:
    def __init__(
        self, engine: Engine, request: GenerateRequest, speculation: Speculation | None = None,
        grammar: GrammarState | None = None,
    ) -> None:
        self.engine = engine
        self.request = request
        self.params = request.sampling
        self.salt = salt_root(request.cache_salt)
        self.seq = engine.new_sequence(self.salt)
        self.detok = IncrementalDetokenizer(engine.tokenizer, self.params.stop)
        self.rng = make_generator(self.params)
        # Penalties, logit_bias, min_tokens, ignore_eos: applied to every row the target chooses
        # from, draft positions included, so speculation stays lossless under them.
        self.adjust = (
            LogitsAdjuster(self.params, request.prompt_token_ids, engine.eos_token_ids)
            if self.params.adjusts_logits else None
        )
        # Structured output: every row chosen from is masked to what the grammar allows. The
        # service compiles it off its event loop and hands it in; built here otherwise.
        if grammar is None and self.params.structured is not None:
            grammar = compiler_for(engine.tokenizer, engine.eos_token_ids).state(self.params.structured, request.cache_salt)
        self.grammar = grammar
        self.spec = speculation
        self.tokens: list[int] = list(request.prompt_token_ids)  # prompt + emitted tokens
        self.completion_tokens = 0
        self.rounds = 0  # prefill + decode/speculative rounds completed (what cancellation must bound)
        self.finished = False
        self._last: int | None = None  # emitted but not yet in the target's KV cache
        # A request may not outgrow the context window, whatever max_tokens says.
        room = engine.max_model_len - len(request.prompt_token_ids)
        self.max_tokens = min(self.params.max_tokens, room)
        # A cached answer offered as a draft (a semantic match to verify, or a near miss): while
        # the output so far is its prefix, its continuation is proposed whole (`_answer_draft`).
        self.answer: list[int] | None = None
        self._answer_text = ""
        self._answer_chunk = ANSWER_CHUNK_FIRST
        if self.spec is not None and request.draft_hint_ids:
            self._take_answer(request.draft_hint_ids)
        if self.spec is not None:
            self.spec.states = [
                p.begin(request.prompt_token_ids, request.draft_hint_ids, salt=self.salt, target_seq=self.seq)
                for p in self.spec.proposers
            ]

    def add_hint(self, hint_ids: list[int]) -> bool:
        """A draft hint that arrived after the request started (the cache lookup ran beside the
        prefill): drafters that take hints and have none yet get it from their next round. The
        state is built whole before it is stored, so the worker thread sees none or all of it."""
        if self.spec is None or self.finished or not hint_ids:
            return False
        took = False
        if self.answer is None:
            self._take_answer(hint_ids)
            took = True
        for i, proposer in enumerate(self.spec.proposers):
            if self.spec.states[i] is None and proposer.takes_hints:
                self.spec.states[i] = proposer.begin(
                    self.request.prompt_token_ids, list(hint_ids), salt=self.salt, target_seq=self.seq
                )
                took = True
        return took

    # ------------------------------------------------------------------ steps

    def prefill(self) -> GenerateChunk:
        start = time.perf_counter()
        logits = self.engine.prefill(self.seq, self.request.prompt_token_ids)
        reused = self.seq.reused  # read before _emit: finishing frees the sequence
        row = self._adjusted(logits)
        chunk = self._emit([self._pick(row)], [row])
        chunk.timings_ms["prefill"] = (time.perf_counter() - start) * 1000
        if reused:
            chunk.timings_ms["prefix_reused_tokens"] = float(reused)
        self.rounds += 1
        return chunk

    def step(self) -> GenerateChunk:
        chunk = self._step()
        self.rounds += 1
        return chunk

    @staticmethod
    def step_batch(gens: list["Generation"]) -> list[GenerateChunk | Exception]:
        """One plain decode step for each generation, all in ONE forward pass of their shared
        engine. Speculation sits this round out: with several requests in the pass, the weights
        are read once for all of them, which is what a draft round would have saved. A sequence
        whose own choosing fails gets its exception in its place; the others get their chunks."""
        engine = gens[0].engine
        logits = engine.decode_batch([g.seq for g in gens], [g._last for g in gens])
        chunks: list = []
        for row, gen in enumerate(gens):
            gen.rounds += 1
            try:
                adjusted = gen._adjusted(logits[row])
                chunks.append(gen._emit([gen._pick(adjusted)], [adjusted]))
            except Exception as exc:  # this sequence's own failure: it ends alone, its batch-mates go on
                chunks.append(exc)
        return chunks

    def _step(self) -> GenerateChunk:
        assert not self.finished and self._last is not None
        if self.spec is not None:
            chunk = self._speculative_round()
            if chunk is not None:
                return chunk
        row = self._adjusted(self.engine.decode_step(self.seq, self._last))
        return self._emit([self._pick(row)], [row])

    def _adjusted(self, logits, drafts=()):
        """Logits as this request chooses from them (penalties, biases, EOS controls, its
        grammar); rows after draft positions count the drafts before them."""
        if self.adjust is not None:
            logits = self.adjust(logits, drafts)
        if self.grammar is not None:
            logits = self.grammar.mask(logits, drafts)
            logits = end_where_nothing_is_allowed(logits, self.engine.eos_token_ids)
        return logits

    def _pick(self, row) -> int:
        return sample(row, self.params, self.rng)

    def _speculative_round(self) -> GenerateChunk | None:
        """Draft, verify in one pass, roll back, emit. None when a plain step is the better bet."""
        spec = self.spec
        assert spec is not None and self._last is not None
        # Never draft past the output budget or the context window.
        cap = min(self.max_tokens - self.completion_tokens - 1, self.engine.max_model_len - self.seq.length - 2)
        if cap <= 0:
            return None
        t0 = time.perf_counter()
        on_track = self._answer_draft(cap)
        forced = [] if on_track else self._forced_draft(cap)
        if on_track or forced:  # a cached answer on track, or text the grammar allows alone
            proposer, proposal = None, Proposal(on_track or forced, None, "hint" if on_track else "grammar")
        else:
            chosen = self._choose_draft(cap)
            if chosen is None:
                return None
            proposer, state, k, proposal = chosen
            if proposal is None:
                proposal = proposer.propose(state, self.tokens, k, self.params, self.rng)
        t1 = time.perf_counter()
        drafted = len(proposal.tokens)
        if self.grammar is not None:  # a draft the grammar forbids: the target could never choose it
            allowed = self.grammar.allowed_prefix(proposal.tokens)
            proposal.tokens = proposal.tokens[:allowed]
            if proposal.probs is not None:
                proposal.probs = proposal.probs[:allowed]
        if not proposal.tokens:
            if proposer is not None:  # a draft made and all forbidden: its time and misses count
                spec.chooser.observe(proposer.name, 0, 0, proposal.marginal_ms, 0.0, free=proposer.free, drafted=drafted)
            return None
        base = self.seq.length
        logits = self.engine.score(self.seq, [self._last, *proposal.tokens])
        logits = self._adjusted(logits, proposal.tokens)  # row i: after i drafts, as the target alone sees it
        verdict = verify(logits, proposal.tokens, proposal.probs, self.params, self.rng)
        # Keep `last` and the accepted drafts in the KV; the new target token is pending.
        self.engine.rollback(self.seq, base + 1 + len(verdict.accepted))
        t2 = time.perf_counter()
        spec.draft_ms += (t1 - t0) * 1000
        spec.verify_ms += (t2 - t1) * 1000
        if proposer is None:
            if proposal.source == "hint":  # the cached answer: longer passes while wholly accepted
                whole = len(verdict.accepted) == len(proposal.tokens)
                self._answer_chunk = min(self._answer_chunk * 2, ANSWER_CHUNK_MAX) if whole else ANSWER_CHUNK_FIRST
        else:
            spec.chooser.observe(
                proposer.name, len(proposal.tokens), len(verdict.accepted), proposal.marginal_ms, (t2 - t1) * 1000,
                free=proposer.free, drafted=drafted,
            )
            if not proposer.free:
                spec.chooser.started.add(proposer.name)
        counts = spec.by_source.setdefault(proposal.source if proposer is None else proposer.name, [0, 0])
        counts[0] += len(proposal.tokens)
        counts[1] += len(verdict.accepted)
        emitted = [*verdict.accepted, verdict.next_token]
        return self._emit(emitted, logits[: len(emitted)])

    def _forced_draft(self, cap: int) -> list[int]:
        """Where the grammar allows only one text next (a JSON key, a tool call's opening), that
        text's tokens as a draft: the target verifies them in one pass instead of a step each."""
        if self.grammar is None:
            return []
        text = self.grammar.forced_text()
        if len(text) < 2:
            return []
        return self.engine.tokenizer.encode(text, add_special_tokens=False)[: min(cap, ANSWER_CHUNK_FIRST)]

    def _take_answer(self, hint_ids: list[int]) -> None:
        self.answer = list(hint_ids)
        self._answer_text = self.engine.tokenizer.decode(self.answer)

    def _answer_draft(self, cap: int) -> list[int]:
        """The cached answer's next tokens while the output so far is its prefix; [] once it went
        another way (the drafters' n-gram lookup over it may still find a match later). The
        prefix is compared as text where the token ids differ: the model may split the same text
        into other tokens than the cached answer's encoding did."""
        if self.answer is None:
            return []
        done = self.completion_tokens
        emitted = self.tokens[len(self.tokens) - done:]
        if emitted != self.answer[:done]:
            text = self.engine.tokenizer.decode(emitted)
            if not self._answer_text.startswith(text) or len(text) >= len(self._answer_text):
                self.answer = None  # another answer: done with it
                return []
            self.answer = emitted + self.engine.tokenizer.encode(self._answer_text[len(text):], add_special_tokens=False)
        return self.answer[done : done + min(cap, self._answer_chunk)]

    def _choose_draft(self, cap: int):
        """The (drafter, state, k, proposal-or-None) with the best expected tokens per ms."""
        chooser = self.spec.chooser
        best, best_rate, probe = None, chooser.plain_rate(), None
        for proposer, state in zip(self.spec.proposers, self.spec.states):
            proposal, catch_up = None, 0
            if proposer.free:  # a lookup costs nothing: see what it has before planning
                proposal = proposer.propose(state, self.tokens, cap, self.params, self.rng)
                if not proposal.tokens:
                    continue
                k, rate = chooser.plan(proposer.name, len(proposal.tokens), free=True)
            else:
                catch_up = proposer.catch_up(state, self.tokens)
                if catch_up > HELD_CATCH_UP_TOKENS and proposer.prompt_waiting is not None and proposer.prompt_waiting():
                    continue  # not now: a plain step (or a free drafter) this round, the prompt next
                remaining = self.max_tokens - self.completion_tokens
                k, rate = chooser.plan(
                    proposer.name, cap, free=False, catch_up_tokens=catch_up, remaining=remaining,
                )
            if catch_up <= HELD_CATCH_UP_TOKENS:
                # A probe costs a round, not a prefill: a model drafter that has yet to ingest
                # the context is started by `plan` alone, which weighs that one-off.
                probe = probe or (proposer, state, proposal)
            if k > 0 and rate > best_rate:
                best, best_rate = (proposer, state, k, proposal), rate
        if best is None:  # plain decoding wins; probe now and then
            chooser.note_step(free_used=False)
            if probe is None or not chooser.should_probe():
                return None
            best = (probe[0], probe[1], min(chooser.PROBE_K, cap), probe[2])
        else:
            chooser.note_step(free_used=best[0].free)
        proposer, state, k, proposal = best
        if proposal is not None:
            proposal.tokens = proposal.tokens[:k]
        return proposer, state, k, proposal

    def abort(self) -> None:
        """The request was cancelled: free the KV cache and the draft's state."""
        if not self.finished:
            self.finished = True
            self.engine.release(self.seq)
            self.seq = None
            if self.spec is not None:
                for proposer, state in zip(self.spec.proposers, self.spec.states):
                    proposer.end(state)

    # ------------------------------------------------------------------ output

    def _emit(self, tokens: list[int], rows=None) -> GenerateChunk:
        """Emit tokens in order, stopping at EOS, a stop string or the length limit. `rows`: the
        logits each token was chosen from, for its log-probability when the request asks."""
        parts: list[str] = []
        emitted = 0
        logprobs = [] if self.params.logprobs is not None and rows is not None else None
        for i, token in enumerate(tokens):
            if token in self.engine.eos_token_ids:
                return self._finish(parts, emitted, "stop", logprobs)
            self.completion_tokens += 1
            emitted += 1
            self.tokens.append(token)
            if self.adjust is not None:
                self.adjust.accept(token)
            if self.grammar is not None:
                self.grammar.accept(token)
            if logprobs is not None:
                logprobs.append(self._logprob(rows[i], token))
            self._last = token
            parts.append(self.detok.add(token))
            if self.detok.stopped:
                return self._finish(parts, emitted, "stop", logprobs)
            if self.completion_tokens >= self.max_tokens:
                return self._finish(parts, emitted, "length", logprobs)
        return GenerateChunk(text="".join(parts), num_tokens=emitted, logprobs=logprobs)

    def _logprob(self, row, token: int) -> tuple[str, float, list[tuple[str, float]]]:
        """(text, log-probability, the `logprobs` likeliest (text, log-probability)) at one position."""
        logp = torch.log_softmax(row.float(), dim=-1).clamp(min=LOGPROB_FLOOR)  # JSON has no -Infinity
        top: list[tuple[str, float]] = []
        if self.params.logprobs:
            values, ids = torch.topk(logp, self.params.logprobs)
            top = [(self.engine.tokenizer.decode([int(i)]), float(v)) for v, i in zip(values, ids)]
        return self.engine.tokenizer.decode([token]), float(logp[token]), top

    def _finish(self, parts: list[str], emitted: int, reason: str, logprobs: list | None = None) -> GenerateChunk:
        self.finished = True
        self.engine.remember(self.seq, self.tokens)  # the KV holds self.tokens[:seq.length]
        self.engine.release(self.seq)
        self.seq = None  # free the KV cache now, not when the caller drops us
        timings: dict[str, float] = {}
        if self.spec is not None:
            for proposer, state in zip(self.spec.proposers, self.spec.states):
                proposer.end(state)
            c = self.spec.chooser
            timings = {
                "spec_rounds": float(c.rounds),
                "spec_proposed": float(c.proposed),
                "spec_accepted": float(c.accepted),
                "spec_draft": self.spec.draft_ms,
                "spec_verify": self.spec.verify_ms,
            }
            for source, (proposed, accepted) in self.spec.by_source.items():
                timings[f"spec_{source}_proposed"] = float(proposed)
                timings[f"spec_{source}_accepted"] = float(accepted)
        if self.grammar is not None and self.grammar.masked_rows:
            timings["grammar_mask"] = self.grammar.mask_ms
            timings["grammar_rows"] = float(self.grammar.masked_rows)
        return GenerateChunk(
            text="".join(parts) + self.detok.flush(),
            num_tokens=emitted,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.completion_tokens,
            timings_ms=timings,
            logprobs=logprobs,
        )
