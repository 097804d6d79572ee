"""One request's decode loop as a step-wise state machine.

`Generation.prefill()` and `Generation.step()` each do one forward pass and return a chunk.
The async service calls them one at a time on the engine's worker thread, so between any
two forward passes the request can be cancelled, and several requests interleave fairly.
Target-only decoding for now; speculative rounds plug in as another `step` strategy.
"""

from __future__ import annotations

import time

from engines.base import Engine
from engines.detokenizer import IncrementalDetokenizer
from engines.sampling import make_generator, sample
from engines.types import GenerateChunk, GenerateRequest


class Generation:
    def __init__(self, engine: Engine, request: GenerateRequest) -> None:
        self.engine = engine
        self.request = request
        self.params = request.sampling
        self.seq = engine.new_sequence()
        self.detok = IncrementalDetokenizer(engine.tokenizer, self.params.stop)
        self.rng = make_generator(self.params)
        self.completion_tokens = 0
        self.finished = False
        self._next_logits = None
        # A request may not outgrow the context window, whatever max_tokens says.
        room = engine.max_model_len - len(request.prompt_token_ids)
        self.max_tokens = min(self.params.max_tokens, room)

    def prefill(self) -> GenerateChunk:
        start = time.perf_counter()
        self._next_logits = self.engine.prefill(self.seq, self.request.prompt_token_ids)
        chunk = self._emit_next_token()
        chunk.timings_ms["prefill"] = (time.perf_counter() - start) * 1000
        chunk.timings_ms["prompt_tokens"] = float(len(self.request.prompt_token_ids))
        return chunk

    def step(self) -> GenerateChunk:
        assert not self.finished and self._next_logits is not None
        self._next_logits = self.engine.decode_step(self.seq, self._last_token)
        return self._emit_next_token()

    def _emit_next_token(self) -> GenerateChunk:
        token = sample(self._next_logits, self.params, self.rng)
        self._last_token = token
        if token in self.engine.eos_token_ids:
            return self._finish("", 0, "stop")
        self.completion_tokens += 1
        text = self.detok.add(token)
        if self.detok.stopped:
            return self._finish(text, 1, "stop")
        if self.completion_tokens >= self.max_tokens:
            return self._finish(text, 1, "length")
        return GenerateChunk(text=text, num_tokens=1)

    def _finish(self, text: str, num_tokens: int, reason: str) -> GenerateChunk:
        self.finished = True
        self.seq = None  # free the KV cache now, not when the caller drops us
        return GenerateChunk(
            text=text + self.detok.flush(),
            num_tokens=num_tokens,
            finish_reason=reason,  # type: ignore[arg-type]
            prompt_tokens=len(self.request.prompt_token_ids),
            completion_tokens=self.completion_tokens,
        )
