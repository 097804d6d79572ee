"""The engine interface every model backend implements.

An engine owns weights and a tokenizer and runs forward passes over a per-sequence KV
cache. It knows nothing about requests, streaming or sampling: `target.decoding`
drives it. Speculative decoding needs exactly these four operations:

- `prefill`: run the prompt, return the next-token logits;
- `decode_step`: feed one token, return the next-token logits;
- `score`: feed k tokens in ONE forward pass, return the logits after each of them
  (verification of k draft tokens costs about one decode step on memory-bound hardware);
- `rollback`: forget everything past a length (rejected draft tokens).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from host_tuning.cores import CoreShare


class PassStopped(Exception):
    """A forward pass stopped midway (`Engine.stop_pass`): its sequence's KV is unusable."""


class Sequence:
    """Engine-side state of one sequence: its KV cache and how many tokens it holds."""

    __slots__ = ("kv", "length", "reused", "salt")

    def __init__(self, kv: Any, salt: int = 0) -> None:
        self.kv = kv
        self.length = 0
        self.reused = 0  # prompt tokens whose KV came from a prefix cache
        self.salt = salt  # its tenant's (engines/blocks.py: salt_root): it reuses only KV with the same


class Engine(ABC):
    model_id: str
    tokenizer: Any
    eos_token_ids: frozenset[int]
    max_model_len: int
    # Sequences it can hold at once without evicting one's KV (llama.cpp: its contexts); None:
    # no fixed limit. Past it, every step would recompute an evicted sequence's whole context.
    max_sequences: int | None = None
    # Whether `decode_batch(seqs, token_ids)` runs several sequences' decode steps in one pass.
    batches: bool = False
    cores: CoreShare | None = None  # how its passes share the box's cores with other engines (host tuning)

    @abstractmethod
    def new_sequence(self, salt: int = 0) -> Sequence:
        """A new, empty sequence. It may reuse the KV of earlier sequences' prefixes only under the
        same `salt` (a tenant's), so one tenant can't learn another's prompts by timing."""

    @abstractmethod
    def prefill(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Append tokens (a prompt, or a catch-up); return logits for the next token, shape [vocab]."""

    @abstractmethod
    def score(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        """Append tokens in one forward pass; return logits after each, shape [len(token_ids), vocab]."""

    def decode_step(self, seq: Sequence, token_id: int) -> torch.Tensor:
        """Append one token; return logits for the next one, shape [vocab]."""
        return self.score(seq, [token_id])[-1]

    @abstractmethod
    def rollback(self, seq: Sequence, length: int) -> None:
        """Drop KV entries past `length` tokens."""

    def remember(self, seq: Sequence, token_ids: list[int]) -> None:
        """A finished sequence's tokens (prompt + output, as far as its KV goes): an engine with a
        prefix cache keeps them, so the next turn of the conversation reuses the answer too."""

    def release(self, seq: Sequence | None) -> None:
        """The sequence is finished: free what it holds (a no-op where GC does it)."""

    def held_prefix(self, token_ids: list[int], salt: int = 0) -> int:
        """Leading tokens of `token_ids` whose KV the engine keeps under `salt` (another
        sequence's, or a finished one's kept for reuse): a new sequence given them in one
        `prefill` takes them over instead of computing them. 0 where it keeps none."""
        return 0

    def takes_kv_from(self, source: "Engine") -> bool:
        """Whether this engine can take over a sequence's KV from `source`, another engine of the
        same model in this process (`take_kv`)."""
        return False

    def kv_tokens(self, seq: Sequence) -> int:
        """Leading tokens of `seq` whose KV this engine holds now (0 once it was released or
        its KV went to another sequence)."""
        return seq.length

    def take_kv(self, seq: Sequence, tokens: list[int], source: "Engine", source_seq: Sequence) -> int:
        """`seq` (of this engine) drops what it holds and takes over, from `source_seq`'s KV in
        `source`, that of the leading `tokens` it holds: a draft starts from the target's prompt
        instead of computing it again. Returns the tokens `seq` now holds; 0 where it took nothing
        (and holds nothing)."""
        return 0

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Every pass inside runs with no other engine of the box in a pass (host tuning's pass
        lock, host_tuning/cores.py): what a start-up probe times. A no-op where the engine does
        not share the box's cores."""
        if self.cores is None:
            yield
            return
        with self.cores.alone():
            yield

    def stop_pass(self, stop: bool) -> None:
        """From another thread: True makes the pass under way raise `PassStopped` at its next
        layer (its request was cancelled: a cache hit beside it, a client gone), False clears
        that. A no-op where a pass can't be stopped midway: it then runs to its end."""
