"""Remote drafting: the draft model runs in the DraftModel deployment, not in the target replica.

`DraftSessions` lives in the draft replica and keeps each request's draft KV state keyed by
request id. Every call carries the full context, so a request that lands on another draft
replica (or whose state was evicted) is recomputed: always correct, only slower.
`RemoteDraft` is the target-side proposer; it runs on the target's engine thread and blocks on
the handle call, which costs one Ray hop per round (co-located placement costs none).
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from typing import Any

import torch

from draft.proposers import ModelDraft, Proposal, Proposer
from engines.base import Engine, Sequence
from engines.types import SamplingParams


class DraftSessions:
    def __init__(self, engine: Engine, max_sessions: int = 256) -> None:
        self.drafter = ModelDraft(engine)
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[Any, torch.Generator]] = OrderedDict()
        self.recomputed = 0
        self.proposals = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def propose(
        self, session_id: str, context: list[int], k: int, params: SamplingParams, seed: int, salt: int = 0
    ) -> Proposal:
        self.proposals += 1
        if session_id not in self._sessions:
            self.recomputed += 1
            rng = torch.Generator().manual_seed(seed)
            self._sessions[session_id] = (self.drafter.begin(context, salt=salt), rng)
            while len(self._sessions) > self.max_sessions:
                _, (old, _) = self._sessions.popitem(last=False)
                self.drafter.end(old)
        self._sessions.move_to_end(session_id)
        state, rng = self._sessions[session_id]
        return self.drafter.propose(state, context, k, params, rng)

    def end(self, session_id: str) -> None:
        entry = self._sessions.pop(session_id, None)
        if entry is not None:
            self.drafter.end(entry[0])


class RemoteDraft(Proposer):
    name = "remote"

    def __init__(self, handle: Any, timeout_s: float = 5.0) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def begin(
        self, prompt_ids: list[int], hint_ids: list[int] | None = None, salt: int = 0,
        target_seq: Sequence | None = None,
    ) -> dict:
        return {"id": uuid.uuid4().hex, "seed": int(torch.randint(0, 2**31 - 1, (1,))), "salt": salt}

    def propose(self, state: dict, context: list[int], k: int, params: SamplingParams, rng) -> Proposal:
        if k <= 0:
            return Proposal([], None, self.name)
        start = time.perf_counter()
        try:
            tokens, probs, marginal = self.handle.propose.remote(state["id"], context, k, params, state["seed"], state["salt"]).result(
                timeout_s=self.timeout_s
            )
        except Exception:
            return Proposal([], None, self.name)  # draft down or slow: decode without it, never fail
        hop_ms = (time.perf_counter() - start) * 1000
        # The hop is part of what a remote draft costs per round: charge it to the tokens.
        return Proposal(tokens, probs, self.name, max(marginal, hop_ms))

    def end(self, state: dict) -> None:
        try:
            self.handle.end.remote(state["id"])  # fire and forget
        except Exception:
            pass
