"""llama.cpp engine over the GGUF file itself (llama-cpp-python).

The shipped fp32 target *is* the dequantized Q4_1 GGUF, so llama.cpp computes nearly the same
function ~5x faster on this CPU: the ideal draft, and a fast small-model engine.

One llama.cpp context holds one sequence's KV cache, so the engine keeps a small pool of
contexts (the weights are mmap'd once and shared). A sequence binds to a context when it runs;
if another sequence took that context meanwhile, it re-evaluates its tokens (always correct,
only slower). A released context keeps its KV, so a new sequence that shares a prefix with it
skips that part of the prefill.

llama.cpp has no batched x86 kernels for Q4_1, so a long run of tokens evaluates ~2x slower per
token than in Q8_0, whose single-token decode is in turn ~20% slower. With `prefill_quant`, runs
of PREFILL_MIN_TOKENS or more go to one extra context on a requantized copy of the same weights;
its KV is then copied into the sequence's own context, which decodes on as before.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from configs.schemas import EngineConfig
from engines.base import Engine, Sequence
from engines.cpu_features import cpu_has_amx
from engines.model_store import package_dir, requantized_gguf, resolve_model_dir
from host_tuning.cores import CoreShare

log = logging.getLogger(__name__)

PREFILL_MIN_TOKENS = 16  # shorter runs: the KV copies would cost more than the faster kernels save


@contextmanager
def _extra_buffer_types(enabled: bool) -> Iterator[None]:
    """Load a model with or without ggml's extra CPU buffer types. `Llama()` takes no argument
    for llama.cpp's `use_extra_bufts`, so its model-parameter defaults are swapped meanwhile."""
    if enabled:
        yield
        return
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def without() -> lib.llama_model_params:
        params = defaults()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = without
    try:
        yield
    finally:
        lib.llama_model_default_params = defaults


@dataclass
class _SeqState:
    tokens: list[int] = field(default_factory=list)  # what this sequence logically holds
    slot: int | None = None
    salt: int = 0  # its tenant's: a context's KV is reused only under the salt that filled it


class LlamaCppEngine(Engine):
    def __init__(self, config: EngineConfig, share_cores: bool = False) -> None:
        from llama_cpp import Llama
        from transformers import AutoTokenizer

        start = time.monotonic()
        source = config.source
        if not (source.package and source.gguf_file):
            raise ValueError("the llama_cpp engine needs a GGUF source (package + gguf_file)")
        gguf = str(package_dir(source.package) / source.gguf_file)
        self.model_id = config.model_id
        # The HF tokenizer converted from the same GGUF: same ids, and it detokenizes for streaming.
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(source, config.cache_dir))
        self.max_model_len = config.max_model_len
        repack = config.cpu_repack == "on" or (config.cpu_repack == "auto" and not cpu_has_amx())
        if not repack:
            log.info("%s: llama.cpp's extra CPU buffer types off (cpu_repack: %s)", config.model_id, config.cpu_repack)

        def context(path: str) -> Llama:
            with _extra_buffer_types(repack):
                return Llama(
                    model_path=path,
                    n_ctx=config.max_model_len,
                    n_batch=256,
                    n_threads=config.num_threads,
                    n_threads_batch=config.num_threads,
                    logits_all=False,
                    use_mmap=True,
                    verbose=False,
                )

        self.cores = CoreShare(config.num_threads, share_cores)
        self._threads: dict[int, int] = {}  # context id -> the threads it was last set to
        self._slots = [context(gguf) for _ in range(config.max_sequences)]
        self._prefill = None
        if config.prefill_quant:
            self._prefill = context(str(requantized_gguf(Path(gguf), config.prefill_quant, config.cache_dir)))
        self.max_sequences = len(self._slots)
        self.evictions = 0  # a context taken from a live sequence, which must recompute its KV
        self._n_vocab = self._slots[0].n_vocab()
        self._owner: list[_SeqState | None] = [None] * len(self._slots)
        self._last_used = [0.0] * len(self._slots)
        self._salt = [0] * len(self._slots)  # the salt of the sequence whose KV each context holds
        eos = self._slots[0].token_eos()
        self.eos_token_ids = frozenset({eos} | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()))
        self.load_seconds = time.monotonic() - start
        log.info("%s (llama.cpp, %d contexts) loaded in %.1f s", self.model_id, len(self._slots), self.load_seconds)

    # ------------------------------------------------------------------ Engine

    def new_sequence(self, salt: int = 0) -> Sequence:
        return Sequence(_SeqState(salt=salt), salt)

    def prefill(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        state: _SeqState = seq.kv
        self._check_room(state, len(token_ids))
        state.tokens.extend(token_ids)
        seq.length = len(state.tokens)
        return self._eval_pending(state)

    def score(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        # Logits at every position would need logits_all (n_ctx x vocab floats per context);
        # the draft never needs them, so score one token at a time.
        rows = [self.prefill(seq, [t]) for t in token_ids]
        return torch.stack(rows)

    def rollback(self, seq: Sequence, length: int) -> None:
        state: _SeqState = seq.kv
        if length < len(state.tokens):
            del state.tokens[length:]
            seq.length = length
            if state.slot is not None and self._owner[state.slot] is state:
                llm = self._slots[state.slot]
                llm.n_tokens = min(llm.n_tokens, length)  # eval() trims the KV past n_tokens

    def release(self, seq: Sequence | None) -> None:
        if seq is None:
            return
        state: _SeqState = seq.kv
        if state.slot is not None and self._owner[state.slot] is state:
            self._owner[state.slot] = None  # its KV stays: a later prompt may share the prefix
        state.slot = None

    def forget_prefixes(self) -> None:
        """Drop the KV every free context keeps for prefix reuse (benchmarks start cold)."""
        for i, owner in enumerate(self._owner):
            if owner is None:
                self._slots[i].n_tokens = 0
                self._slots[i].input_ids[:] = 0

    # ------------------------------------------------------------------ contexts

    def _check_room(self, state: _SeqState, extra: int) -> None:
        if len(state.tokens) + extra > self.max_model_len:
            raise ValueError(f"sequence would exceed max_model_len={self.max_model_len}")

    def _bind(self, state: _SeqState):
        if state.slot is not None and self._owner[state.slot] is state:
            slot = state.slot
        else:
            slot = self._pick_slot(state)
            previous = self._owner[slot]
            if previous is not None:
                previous.slot = None  # it will recompute when it runs again
                self.evictions += 1
            self._owner[slot] = state
            state.slot = slot
            llm = self._slots[slot]
            # Whatever this context still holds is valid up to the common prefix, for the same tenant.
            held = llm.input_ids[: llm.n_tokens].tolist() if self._salt[slot] == state.salt else []
            self._salt[slot] = state.salt
            common = 0
            limit = min(len(held), len(state.tokens))
            while common < limit and held[common] == state.tokens[common]:
                common += 1
            llm.n_tokens = common
        self._last_used[slot] = time.monotonic()
        return self._slots[slot]

    def _pick_slot(self, state: _SeqState) -> int:
        free = [i for i, owner in enumerate(self._owner) if owner is None]
        candidates = free or list(range(len(self._slots)))
        best, best_common = candidates[0], -1
        for i in candidates:  # prefer the context sharing the longest prefix, then the LRU one
            llm = self._slots[i]
            held = llm.input_ids[: llm.n_tokens]
            n = min(len(held), len(state.tokens)) if self._salt[i] == state.salt else 0
            common = int(np.argmin(np.append(held[:n] == np.asarray(state.tokens[:n]), False)))
            if common > best_common or (common == best_common and self._last_used[i] < self._last_used[best]):
                best, best_common = i, common
        return best

    def _eval_pending(self, state: _SeqState) -> torch.Tensor:
        llm = self._bind(state)
        if llm.n_tokens >= len(state.tokens):
            llm.n_tokens = len(state.tokens) - 1  # re-run the last token to get its logits
        if self._prefill is not None and len(state.tokens) - llm.n_tokens >= PREFILL_MIN_TOKENS:
            return self._eval_on_prefill_context(llm, state.tokens)
        self._pick_threads(llm)
        llm.eval(state.tokens[llm.n_tokens :])
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(self._n_vocab,))
        return torch.from_numpy(logits.copy())

    def _eval_on_prefill_context(self, llm, tokens: list[int]) -> torch.Tensor:
        """Evaluate tokens[llm.n_tokens:] on the requantized copy, then move the KV to `llm`."""
        held, pre = llm.n_tokens, self._prefill
        if held:
            _copy_kv(llm, pre, held)
        pre.n_tokens = held
        self._pick_threads(pre)
        pre.eval(tokens[held:])
        logits = np.ctypeslib.as_array(pre._ctx.get_logits(), shape=(self._n_vocab,)).copy()
        _copy_kv(pre, llm, len(tokens))
        llm.input_ids[: len(tokens)] = tokens
        llm.n_tokens = len(tokens)
        return torch.from_numpy(logits)

    def _pick_threads(self, llm) -> None:
        """All threads on an idle box, one beside a busy one (host_tuning/cores.py)."""
        if not self.cores.enabled:
            return
        import llama_cpp

        threads = self.cores.threads()
        if self._threads.get(id(llm)) != threads:
            llama_cpp.llama_set_n_threads(llm._ctx.ctx, threads, threads)
            self._threads[id(llm)] = threads


def _copy_kv(src, dst, length: int) -> None:
    """Replace dst's KV cache with src's first `length` positions (same architecture)."""
    import llama_cpp

    src._ctx.kv_cache_seq_rm(0, length, -1)  # Llama trims lazily: drop what it no longer holds
    src.n_tokens = min(src.n_tokens, length)
    size = llama_cpp.llama_state_seq_get_size(src._ctx.ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    written = llama_cpp.llama_state_seq_get_data(src._ctx.ctx, buf, size, 0)
    dst._ctx.kv_cache_seq_rm(0, 0, -1)
    if not written or llama_cpp.llama_state_seq_set_data(dst._ctx.ctx, buf, written, 0) == 0:
        raise RuntimeError("llama.cpp could not copy a sequence's KV cache between contexts")
