"""The counters a model replica keeps (target/service.py's ModelService)."""

from __future__ import annotations


class EngineStats:
    """Counters a test, a benchmark or the admission controller can read off a replica."""

    def __init__(self) -> None:
        self.requests_started = 0
        self.requests_finished = 0
        self.requests_cancelled = 0
        self.tokens_generated = 0
        self.forward_passes = 0
        self.decode_batches = 0  # worker jobs that ran decode steps
        self.batched_steps = 0  # decode steps they ran (batched_steps / decode_batches = mean batch)
        self.max_batch = 0
        self.active = 0
        self.draft_tokens_proposed = 0
        self.draft_tokens_accepted = 0
        self.hint_tokens_proposed = 0  # from semantic-cache near misses
        self.hint_tokens_accepted = 0
        # Of the last cancelled request: rounds that still ran after the cancel (the one on the
        # worker thread at that moment finishes; no new one starts), and the ms until its KV was freed.
        self.last_cancel_rounds_after = 0
        self.max_cancel_rounds_after = 0
        self.last_cancel_free_ms = 0
        self.seat_waits = 0  # requests that waited for a free sequence slot (engine.max_sequences)
        self.prefills_stopped = 0  # cancelled midway (a cache hit beside it, a client gone): the rest not computed
        self.steps_run_ahead = 0  # a lone request's steps the worker claimed itself (target/run_ahead.py)

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))
