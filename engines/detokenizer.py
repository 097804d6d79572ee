"""Incremental detokenization with stop strings, safe for streaming.

Two things must never reach the client: half of a multi-byte character (a token can end in
the middle of a UTF-8 sequence, which decodes to U+FFFD), and any part of a stop string.
We re-decode the generated ids and release only text that is final: no trailing U+FFFD,
and no tail that could still grow into a stop string.
"""

from __future__ import annotations

from typing import Any


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(s for s in stop if s)
        self._max_stop_len = max((len(s) for s in self._stop), default=0)
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already released
        self.stopped = False  # a stop string was found; the caller should finish

    def add(self, token_id: int) -> str:
        """Add one generated token; return the newly final text (maybe empty)."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if self._stop:
            cut = self._find_stop(text)
            if cut is not None:
                self.stopped = True
                return self._release(text[:cut])
        if text.endswith("\ufffd"):
            return ""  # an incomplete multi-byte character: wait for the next token
        safe_end = len(text)
        if self._max_stop_len:
            safe_end = self._end_before_partial_stop(text)
        return self._release(text[:safe_end])

    def flush(self) -> str:
        """At the end of generation, release whatever is held back (a partial stop is just text)."""
        if self.stopped or not self._ids:
            return ""
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        return self._release(text.rstrip("\ufffd"))

    def _release(self, final_text: str) -> str:
        if len(final_text) <= self._emitted:
            return ""
        out = final_text[self._emitted :]
        self._emitted = len(final_text)
        return out

    def _find_stop(self, text: str) -> int | None:
        # Only the unreleased tail (plus overlap) can contain a new stop string.
        start = max(0, self._emitted - self._max_stop_len)
        hits = [i for i in (text.find(s, start) for s in self._stop) if i != -1]
        return min(hits) if hits else None

    def _end_before_partial_stop(self, text: str) -> int:
        """Hold back a tail of `text` that is a proper prefix of some stop string."""
        for keep in range(min(self._max_stop_len - 1, len(text)), 0, -1):
            tail = text[-keep:]
            if any(s.startswith(tail) for s in self._stop):
                return len(text) - keep
        return len(text)
