"""Draft proposers: each proposes up to k next tokens for a request's context.

One interface, three kinds:
- `ModelDraft`: a small/cheap model run autoregressively over its own KV cache (any Engine:
  llama.cpp on the target's own GGUF is the fast one here).
- `NgramDraft`: prompt lookup. If the context's last n tokens occurred earlier, propose what
  followed them. Free, and strong when the answer quotes the prompt (RAG, code edits).
- `HintDraft`: the same lookup over a hint text (e.g. a semantic-cache near-miss answer).

Deterministic proposers return `probs=None` (a point mass), which the verifier understands.
Which drafter a round uses, and how many tokens, is decided in target/adaptive.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from engines.base import Engine, Sequence
from engines.sampling import probabilities
from engines.types import SamplingParams


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None = None  # [len(tokens), vocab]; None = deterministic (point mass)
    source: str = ""
    marginal_ms: float = 0.0  # cost of drafting these tokens, without one-off catch-up (prompt prefill)


class Proposer(ABC):
    name: str = "proposer"
    free: bool = False  # True for lookups that cost ~nothing (the planner asks them first)
    takes_hints: bool = False  # drafts from `hint_ids` alone (its state is None without one)
    # "A new prompt waits for the worker", set by the replica (ModelService._prefill_waiting).
    # While true, a model drafter's long catch-up waits for a later round (the planner,
    # target/decoding.py), one under way stops at its next chunk, and a round under way stops
    # drafting (ModelDraft): under load each would hold a queued prompt long enough to miss its
    # TTFT.
    prompt_waiting: Callable[[], bool] | None = None

    def begin(
        self, prompt_ids: list[int], hint_ids: list[int] | None = None, salt: int = 0,
        target_seq: Sequence | None = None,
    ) -> Any:
        """Per-request state (returned to the caller, passed back on every call). `salt`: the
        request's tenant (engines/blocks.py), for a drafter that keeps prefix KV. `target_seq`:
        the request's sequence in the target engine, whose KV a drafter beside it may take over."""
        return None

    @abstractmethod
    def propose(
        self, state: Any, context: list[int], k: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens that may follow `context` (prompt + every token emitted so far)."""

    def end(self, state: Any) -> None:
        """Free per-request resources."""

    def catch_up(self, state: Any, context: list[int]) -> int:
        """Context tokens this drafter would have to ingest before it can propose."""
        return 0


# --------------------------------------------------------------------------- model draft


@dataclass
class _ModelState:
    seq: Sequence
    tokens: list[int] = field(default_factory=list)  # what the draft's KV cache holds
    kept: int | None = None  # context tokens the engine already keeps KV for (looked up once)
    target_seq: Sequence | None = None  # the request's in the target engine (a KV handoff's source)


# The target holds at least this many context tokens more than the draft: the draft takes its KV
# over instead of catching up (Engine.take_kv).
TAKE_OVER_MIN_TOKENS = 16


class ModelDraft(Proposer):
    name = "model"

    def __init__(self, engine: Engine, target: Engine | None = None) -> None:
        """`target`: the engine this drafter proposes for, in the same process; where the draft
        engine can take that engine's KV, a request's prompt is computed once, by the target."""
        self.engine = engine
        self.target = target if target is not None and engine.takes_kv_from(target) else None

    def begin(
        self, prompt_ids: list[int], hint_ids: list[int] | None = None, salt: int = 0,
        target_seq: Sequence | None = None,
    ) -> _ModelState:
        return _ModelState(self.engine.new_sequence(salt), target_seq=target_seq if self.target else None)

    def propose(self, state: _ModelState, context: list[int], k: int, params, rng) -> Proposal:
        if k <= 0:
            return Proposal([], None, self.name)
        engine = self.engine
        # Keep what the draft's cache shares with the context (its rejected guesses go).
        common = _common_prefix(state.tokens, context)
        if self._target_ahead(state, context, common):
            state.tokens = context[: engine.take_kv(state.seq, context, self.target, state.target_seq)]
            common = len(state.tokens)
        if common == len(context):
            common -= 1  # re-feed the last token: we need the logits after it
        engine.rollback(state.seq, common)
        room = engine.max_model_len - common - 1
        k = min(k, room - (len(context) - common))
        if k <= 0:
            return Proposal([], None, self.name)
        logits = self._catch_up(state, context, common)
        if logits is None:  # a prompt came meanwhile: a plain step this round, the rest later
            return Proposal([], None, self.name)
        start = time.perf_counter()
        tokens: list[int] = []
        dists: list[torch.Tensor] = []
        for i in range(k):
            if params.greedy:
                token = int(torch.argmax(logits))
            else:
                q = probabilities(logits, params)
                token = int(torch.multinomial(q, 1, generator=rng))
                dists.append(q)
            tokens.append(token)
            if i < k - 1:
                if self.prompt_waiting is not None and self.prompt_waiting():
                    break  # verify what is drafted; the prompt goes next
                logits = engine.decode_step(state.seq, token)
        state.tokens = list(context) + tokens[:-1]
        # Each drafted token costs one draft forward pass: k-1 timed here, plus the catch-up
        # pass, counted as one more of the same (a long catch-up is a one-off, not marginal).
        per_token = (time.perf_counter() - start) * 1000 / max(1, len(tokens) - 1)
        marginal = per_token * len(tokens) if len(tokens) > 1 else 0.0
        return Proposal(tokens, torch.stack(dists) if dists else None, self.name, marginal)

    def catch_up(self, state: _ModelState, context: list[int]) -> int:
        common = _common_prefix(state.tokens, context)
        if self._target_ahead(state, context, common):
            return len(context) - min(self.target.kv_tokens(state.target_seq), len(context))
        return len(context) - (common or self._kept(state, context))

    def _target_ahead(self, state: _ModelState, context: list[int], common: int) -> bool:
        """Whether the target holds enough more of the context than the draft for a handoff."""
        if state.target_seq is None or not self.engine.takes_kv_from(self.target):
            return False
        have = common or self._kept(state, context)
        return min(self.target.kv_tokens(state.target_seq), len(context)) - have >= TAKE_OVER_MIN_TOKENS

    def _kept(self, state: _ModelState, context: list[int]) -> int:
        """Leading context tokens the draft engine keeps KV for under this request's salt (a
        shared system prompt, the conversation's last turn): its first catch-up takes them
        over instead of computing them."""
        if state.kept is None:
            state.kept = min(self.engine.held_prefix(context, state.seq.salt), len(context) - 1)
        return state.kept

    CATCH_UP_CHUNK = 64  # tokens a catch-up runs between two looks for a waiting prompt (a tail
    # shorter than two chunks runs whole: at most 127 tokens between looks)

    def _catch_up(self, state: _ModelState, context: list[int], common: int) -> torch.Tensor | None:
        """Feed the draft `context[common:]` in chunks; None when a prompt started waiting for
        the worker before the end (what was fed stays: the next round goes on from there). A
        whole RAG prompt's catch-up as one job runs for a long prefill's time, and a prompt that
        came meanwhile would wait for all of it."""
        start = common
        kept = self._kept(state, context) if common == 0 else 0
        while True:
            # A fresh sequence's first chunk reaches past what the engine keeps, which the
            # engine takes over when it binds the sequence: a chunk ending inside it would
            # compute the rest of it again.
            first = max(start, kept)
            end = len(context) if len(context) - first < 2 * self.CATCH_UP_CHUNK else first + self.CATCH_UP_CHUNK
            logits = self.engine.prefill(state.seq, context[start:end])
            state.tokens = context[:end]
            if end == len(context):
                return logits
            if self.prompt_waiting is not None and self.prompt_waiting():
                return None
            start = end

    def end(self, state: _ModelState) -> None:
        self.engine.release(state.seq)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# --------------------------------------------------------------------------- n-gram / prompt lookup


class _NgramIndex:
    """Last position after each n-gram (n in [min_n, max_n]) of a growing token list."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            # Index n-grams that END just before this token, mapping them to this position.
            for n in range(self.min_n, self.max_n + 1):
                if end - 1 - n >= 0:
                    self.after[tuple(self.tokens[end - 1 - n : end - 1])] = end - 1

    def lookup(self, suffix_source: list[int], k: int, exclude_tail: bool) -> list[int]:
        """Longest n-gram suffix of `suffix_source` seen before -> the tokens that followed it."""
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(suffix_source) < n:
                continue
            pos = self.after.get(tuple(suffix_source[-n:]))
            if pos is None:
                continue
            if exclude_tail and pos >= len(self.tokens):
                continue
            return self.tokens[pos : pos + k]
        return []


class NgramDraft(Proposer):
    name = "ngram"
    free = True

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def begin(
        self, prompt_ids: list[int], hint_ids: list[int] | None = None, salt: int = 0,
        target_seq: Sequence | None = None,
    ) -> _NgramIndex:
        return _NgramIndex(self.min_n, self.max_n)

    def propose(self, state: _NgramIndex, context: list[int], k: int, params, rng) -> Proposal:
        # Index the context except its last n tokens' own occurrence, then look the suffix up.
        state.extend(context[len(state.tokens) :])
        return Proposal(state.lookup(context, k, exclude_tail=True) if k > 0 else [], None, self.name)


class HintDraft(Proposer):
    """Prompt lookup over a hint (a near-miss cached answer), not over the context."""

    name = "hint"
    free = True
    takes_hints = True

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    def begin(
        self, prompt_ids: list[int], hint_ids: list[int] | None = None, salt: int = 0,
        target_seq: Sequence | None = None,
    ) -> _NgramIndex | None:
        if not hint_ids:
            return None
        index = _NgramIndex(self.min_n, self.max_n)
        index.extend(list(hint_ids))
        return index

    def propose(self, state: _NgramIndex | None, context: list[int], k: int, params, rng) -> Proposal:
        if state is None or k <= 0:
            return Proposal([], None, self.name)
        return Proposal(state.lookup(context, k, exclude_tail=False), None, self.name)
