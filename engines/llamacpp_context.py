"""A llama.cpp context and model as the llama.cpp engine uses them (llama-cpp-python's bindings
to llama.cpp's C API): weights loaded once, a context of one stream of KV cells per sequence,
evaluation of a batch of (sequence, position, token) items, and a sequence's KV moved between
contexts (engines/kv_state.py where their layouts differ)."""

from __future__ import annotations

import ctypes

import numpy as np

from engines.kv_state import relayout

N_BATCH = 256  # tokens per llama_decode call; longer runs go in several


def load_model(path: str, repack: bool):
    """The weights, mmap'd. `repack`: ggml's extra CPU buffer types (AMX / wide-SIMD layouts)."""
    import llama_cpp as lib
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's own load and context logs: errors only
    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.use_mmap = True
    params.use_extra_bufts = repack
    model = lib.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    return model


class Context:
    """One llama.cpp context over `model` with `n_seq` sequences of up to `n_ctx` tokens each."""

    def __init__(self, model, n_seq: int, n_ctx: int, threads: int, flash_attention: str) -> None:
        """`flash_attention`: "on" or "off" (the engine resolves a config's "auto")."""
        import llama_cpp as lib

        self.lib = lib
        params = lib.llama_context_default_params()
        # The setting decides whether V is stored transposed; a sequence's KV moves to a context
        # of the other layout through `restore(..., source=)` (engines/kv_state.py).
        params.flash_attn_type = {"off": lib.LLAMA_FLASH_ATTN_TYPE_DISABLED, "on": lib.LLAMA_FLASH_ATTN_TYPE_ENABLED}[
            flash_attention
        ]
        self.v_transposed = flash_attention == "off"
        params.n_ctx = n_ctx * n_seq
        params.n_batch = params.n_ubatch = N_BATCH
        params.n_seq_max = n_seq
        # A stream of cells per sequence (see the module docstring): a micro-batch holds only
        # consecutive sequence ids (scattered slots cost a pass each), so the engine keeps
        # running sequences in consecutive slots.
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = threads
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(N_BATCH, 0, 1)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.threads = threads

    def eval(self, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """Evaluate (seq, position, token, wants_logits) items; logits of those that want them, in order."""
        lib, batch, out = self.lib, self.batch, []
        for first in range(0, len(items), N_BATCH):
            chunk = items[first : first + N_BATCH]
            batch.n_tokens = len(chunk)
            for i, (seq, pos, token, wants) in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.logits[i] = token, pos, wants
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
            if lib.llama_decode(self.ctx, batch) != 0:
                raise RuntimeError("llama_decode failed (KV cache full?)")
            for i, (_, _, _, wants) in enumerate(chunk):
                if wants:
                    row = lib.llama_get_logits_ith(self.ctx, i)
                    out.append(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).copy())
        return out

    def drop(self, seq: int, start: int) -> None:
        """Forget `seq`'s KV from position `start` on."""
        self.lib.llama_memory_seq_rm(self.memory, seq, start, -1)

    def copy(self, src: int, dst: int, n: int | None = None) -> None:
        """`dst` holds `src`'s first `n` positions (all of them: None); whatever it held before
        is dropped. Through llama.cpp's per-sequence state (its cells, written at once): its
        `seq_cp` between streams copies only at the next pass, and an export before that pass
        (the prefill copy's) read the old data."""
        self.restore(self.export(src), dst)
        if n is not None:
            self.drop(dst, n)

    def set_threads(self, threads: int) -> None:
        if threads != self.threads:
            self.lib.llama_set_n_threads(self.ctx, threads, threads)
            self.threads = threads

    def export(self, seq: int) -> ctypes.Array:
        size = self.lib.llama_state_seq_get_size(self.ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        written = self.lib.llama_state_seq_get_data(self.ctx, buf, size, seq)
        return (ctypes.c_uint8 * written).from_buffer(buf) if written else buf

    def restore(self, buf: ctypes.Array, seq: int, source: "Context | None" = None) -> None:
        """`seq` holds the state `buf` exported, from this context or from `source`."""
        if source is not None and source.v_transposed != self.v_transposed:
            moved = relayout(buf, self.v_transposed)
            if moved is not None:
                buf = (ctypes.c_uint8 * len(moved)).from_buffer(moved)
        self.drop(seq, 0)
        if not len(buf) or self.lib.llama_state_seq_set_data(self.ctx, buf, len(buf), seq) == 0:
            raise RuntimeError("llama.cpp could not copy a sequence's KV cache between contexts")

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.ctx = None
