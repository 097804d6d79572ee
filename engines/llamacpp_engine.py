"""llama.cpp engine over the GGUF file itself (llama-cpp-python's bindings to llama.cpp's C API).

The shipped fp32 target *is* the dequantized Q4_1 GGUF, so llama.cpp computes nearly the same
function on its quantized kernels, several times faster: the ideal draft, and a fast small-model
engine.

One llama.cpp context holds every sequence's KV cache, each in its own slot (a sequence id with
its own stream of cells), so the decode steps of several requests run as one batch
(`decode_batch`): the weights are read once per step for all of them, so tokens/s grows with
the sequences in a step. A sequence binds to a slot when it runs;
if another sequence took that slot meanwhile, it re-evaluates its tokens (always correct, only
slower). A released slot keeps its KV, so a new sequence that shares a prefix with it skips that
part of the prefill. `score` evaluates a run of tokens in one pass with logits at each, which
verifying a draft needs.

Running sequences are kept in the lowest slots, with no gaps (`_pack`): llama.cpp evaluates a
batch in one pass only over consecutive sequence ids, each run of them reading the weights
again. A stream per slot means a pass attends to its own sequences' cells only; in one shared
pool every pass would attend over (and mask) every slot's cells, and prefills and steps slow
down with every slot's length.

llama.cpp has no batched x86 kernels for Q4_1, so a long run of tokens (or a step of many
sequences) evaluates slower per token than in Q8_0 or F32. With `prefill_quant`, runs
of PREFILL_MIN_TOKENS or more go to one extra context on a requantized copy of the same weights;
its KV is then copied into the sequence's slot, which decodes on as before.

A draft engine beside its target takes each prompt's KV over from the target's context
(`take_kv`) instead of prefilling it again on its own copy of the same float32 weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from configs.schemas import EngineConfig
from engines.base import Engine, Sequence
from engines.cpu_features import cpu_has_amx, cpu_has_avx512
from engines.llamacpp_context import Context, load_model
from engines.model_store import package_dir, requantized_gguf, resolve_model_dir
from host_tuning.cores import CoreShare

log = logging.getLogger(__name__)

# Shorter runs (a catch-up): the KV copies would cost more than the faster kernels save.
PREFILL_MIN_TOKENS = 16
# A conversation's next turn (`_on_copy`): a slot holds this much of the prompt, and more than
# its last token but less than the next is new.
NEXT_TURN_HELD_TOKENS = 128
NEXT_TURN_NEW_TOKENS = 64
COPY_MIN_TOKENS = 16  # a prefix another slot holds is copied when it saves at least this many tokens
# A shorter KV handoff (`take_kv`) saves less than the export and re-lay cost.
TAKE_KV_MIN_TOKENS = 16


@dataclass
class SlotReuse:
    """Prompt tokens whose KV a slot already held: the counters `PrefixCache` keeps, for the
    replica's stats and the prefix-cache metrics."""

    lookups: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    copies: int = 0  # prompts that took their prefix from another slot's KV

    def stats(self) -> dict[str, float]:
        rate = self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
        return {"prefix_lookups": self.lookups, "prefix_query_tokens": self.query_tokens,
                "prefix_hit_tokens": self.hit_tokens, "prefix_hit_rate": round(rate, 4),
                "prefix_copies": self.copies}


@dataclass
class _SeqState:
    tokens: list[int] = field(default_factory=list)  # what this sequence logically holds
    slot: int | None = None
    salt: int = 0  # its tenant's: a slot's KV is reused only under the salt that filled it
    reused: int = 0  # tokens the last evaluation found already in its slot


class LlamaCppEngine(Engine):
    batches = True

    def __init__(self, config: EngineConfig, share_cores: bool = False) -> None:
        import llama_cpp as lib
        from transformers import AutoTokenizer

        start = time.monotonic()
        source = config.source
        if not (source.package and source.gguf_file):
            raise ValueError("the llama_cpp engine needs a GGUF source (package + gguf_file)")
        shipped = package_dir(source.package) / source.gguf_file
        gguf = str(shipped)
        if config.weights != "gguf":
            gguf = str(requantized_gguf(shipped, config.weights, config.cache_dir))
        self.model_id = config.model_id
        # The HF tokenizer converted from the same GGUF: same ids, and it detokenizes for streaming.
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(source, config.cache_dir))
        self.max_model_len = config.max_model_len
        repack = config.cpu_repack == "on" or (config.cpu_repack == "auto" and not cpu_has_amx())
        if not repack:
            log.info("%s: llama.cpp's extra CPU buffer types off (cpu_repack: %s)", config.model_id, config.cpu_repack)
        self.cores = CoreShare(config.num_threads, share_cores)
        self.max_sequences = config.max_sequences
        self._models = [load_model(gguf, repack)]
        self.flash_attention = decode_attention(config.flash_attention)
        self._ctx = Context(
            self._models[0], self.max_sequences, config.max_model_len, config.num_threads, self.flash_attention
        )
        model = self._models[0]
        # What a sequence's KV depends on besides the weights' values (`takes_kv_from`).
        self.shape = (lib.llama_model_n_layer(model), lib.llama_model_n_embd(model),
                      lib.llama_model_n_head_kv(model), self._ctx.n_vocab)
        self._prefill: Context | None = None
        if config.prefill_quant:
            # From the shipped file, not from `weights`' copy: an f32 prefill then holds the same
            # weights as an f32 target, and the two share one file.
            quant = str(requantized_gguf(shipped, config.prefill_quant, config.cache_dir))
            self._models.append(load_model(quant, repack))
            # As many streams as the decoding context: llama.cpp moves a sequence's KV only
            # between contexts of the same stream count. Only its first is used; the others
            # cost their KV memory.
            # Prompts on flash attention, its faster prefill; their KV is re-laid on its way to the
            # decoding context where that one runs without it.
            self._prefill = Context(self._models[1], self.max_sequences, config.max_model_len, config.num_threads, "on")
        self.evictions = 0  # a slot taken from a live sequence, which must recompute its KV
        self.moves = 0  # running sequences moved down a slot to keep the running ones consecutive
        self.copy_passes = 0  # runs of tokens evaluated on the prefill copy
        self.kv_taken = 0  # sequences that took their KV over from another engine (`take_kv`)
        self._kv_refused = False  # a handoff failed once: llama.cpp refused the other engine's state
        # A next turn stays where it decodes only off the kernel there (`_on_copy`); with the
        # kernel in both contexts nothing is re-laid, and a few tokens cost less on the copy.
        self._next_turn_here = self._prefill is not None and self._ctx.v_transposed is True
        self.prefix_cache = SlotReuse()
        self._held: list[list[int]] = [[] for _ in range(self.max_sequences)]  # tokens whose KV each slot holds
        self._owner: list[_SeqState | None] = [None] * self.max_sequences
        self._last_used = [0.0] * self.max_sequences
        self._salt = [0] * self.max_sequences  # the salt of the sequence whose KV each slot holds
        eos = lib.llama_vocab_eos(lib.llama_model_get_vocab(self._models[0]))
        self.eos_token_ids = frozenset({eos} | ({self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()))
        self.load_seconds = time.monotonic() - start
        log.info("%s (llama.cpp, %d sequences) loaded in %.1f s", self.model_id, self.max_sequences, self.load_seconds)

    def __del__(self) -> None:
        try:
            for ctx in (self._ctx, self._prefill):
                if ctx is not None:
                    ctx.close()
            import llama_cpp as lib

            for model in self._models:
                lib.llama_model_free(model)
            self._models = []
        except Exception:  # interpreter shutdown
            pass

    # ------------------------------------------------------------------ Engine

    def new_sequence(self, salt: int = 0) -> Sequence:
        return Sequence(_SeqState(salt=salt), salt)

    def prefill(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        prompt = seq.length == 0  # not a catch-up
        self._append(seq, token_ids)
        logits = self._run([seq.kv], 1, prompt=prompt)[0]
        if prompt:
            seq.reused = seq.kv.reused  # prompt tokens whose KV a slot already held
            self.prefix_cache.lookups += 1
            self.prefix_cache.query_tokens += len(token_ids)
            self.prefix_cache.hit_tokens += seq.reused
        return torch.from_numpy(logits)

    def score(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        self._append(seq, token_ids)
        return torch.from_numpy(np.stack(self._run([seq.kv], len(token_ids))))

    def decode_step(self, seq: Sequence, token_id: int) -> torch.Tensor:
        return self.prefill(seq, [token_id])

    def decode_batch(self, seqs: list[Sequence], token_ids: list[int]) -> torch.Tensor:
        """One pass: each sequence takes its token; logits for each one's next, shape [n, vocab]."""
        for seq, token in zip(seqs, token_ids):
            self._append(seq, [token])
        if len(seqs) > self.max_sequences:  # more than the slots: in turns, each recomputing
            return torch.from_numpy(np.stack([self._run([seq.kv], 1)[0] for seq in seqs]))
        return torch.from_numpy(np.stack(self._run([seq.kv for seq in seqs], 1)))

    def rollback(self, seq: Sequence, length: int) -> None:
        state: _SeqState = seq.kv
        if length < len(state.tokens):
            del state.tokens[length:]
            seq.length = length
            if state.slot is not None and self._owner[state.slot] is state and len(self._held[state.slot]) > length:
                self._ctx.drop(state.slot, length)
                del self._held[state.slot][length:]

    def release(self, seq: Sequence | None) -> None:
        if seq is None:
            return
        state: _SeqState = seq.kv
        if state.slot is not None and self._owner[state.slot] is state:
            self._owner[state.slot] = None  # its KV stays: a later prompt may share the prefix
            self._pack(state.slot)
        state.slot = None

    def held_prefix(self, token_ids: list[int], salt: int = 0) -> int:
        return max(self._shared_prefix(slot, token_ids, salt) for slot in range(self.max_sequences))

    def forget_prefixes(self) -> None:
        """Drop the KV every free slot keeps for prefix reuse (benchmarks start cold)."""
        for i, owner in enumerate(self._owner):
            if owner is None:
                self._ctx.drop(i, 0)
                self._held[i] = []

    def takes_kv_from(self, source: Engine) -> bool:
        """Another llama.cpp engine over a model of the same shape, whose contexts hold as many
        streams (llama.cpp moves a sequence's state only between such contexts); V is re-laid
        where their attention settings differ (engines/kv_state.py). The weights may differ: the
        KV is the source's, computed on its weights (a Q4_1 draft takes the float32 target's
        prompt, which its own float32 prefill copy would have computed alike)."""
        if self._kv_refused or not isinstance(source, LlamaCppEngine) or source is self:
            return False
        return source.max_sequences == self.max_sequences and source.shape == self.shape

    def kv_tokens(self, seq: Sequence) -> int:
        state: _SeqState = seq.kv
        if state.slot is None or self._owner[state.slot] is not state:
            return 0
        return min(len(self._held[state.slot]), len(state.tokens))  # a slot holds a prefix of its owner's tokens

    def take_kv(self, seq: Sequence, tokens: list[int], source: Engine, source_seq: Sequence) -> int:
        state: _SeqState = seq.kv
        if not self.takes_kv_from(source):
            return 0
        assert isinstance(source, LlamaCppEngine)
        src: _SeqState = source_seq.kv
        if src.salt != state.salt or not source.kv_tokens(source_seq):
            return 0  # another tenant's, or released or evicted there
        n = min(_common_prefix(source._held[src.slot], tokens), self.max_model_len)
        if n < TAKE_KV_MIN_TOKENS:
            return 0
        state.tokens = list(tokens[:n])
        seq.length = n
        slot = state.slot if state.slot is not None and self._owner[state.slot] is state else self._claim(state)
        try:
            self._ctx.restore(source._ctx.export(src.slot), slot, source=source._ctx)
        except RuntimeError as exc:  # KVStateFormatError included: refused for good, not retried
            log.warning("%s: could not take a sequence's KV from %s (%s); drafts compute their own",
                        self.model_id, source.model_id, exc)
            self._kv_refused = True
            self._ctx.drop(slot, 0)
            self._held[slot], state.tokens, seq.length = [], [], 0
            return 0
        if len(source._held[src.slot]) > n:
            self._ctx.drop(slot, n)
        self._held[slot] = list(state.tokens)
        self._salt[slot] = state.salt
        self._last_used[slot] = time.monotonic()
        self.kv_taken += 1
        return n

    # ------------------------------------------------------------------ slots

    def _append(self, seq: Sequence, token_ids: list[int]) -> None:
        state: _SeqState = seq.kv
        if len(state.tokens) + len(token_ids) > self.max_model_len:
            raise ValueError(f"sequence would exceed max_model_len={self.max_model_len}")
        state.tokens.extend(token_ids)
        seq.length = len(state.tokens)

    def _run(self, states: list[_SeqState], want: int, prompt: bool = False) -> list[np.ndarray]:
        """Evaluate what each sequence's slot lacks, in one pass; logits after each one's last
        `want` tokens, in order."""
        slots = [self._bind(state) for state in states]
        if len(states) > 1:  # in slot order: consecutive ids make one pass (module docstring)
            order = sorted(range(len(states)), key=slots.__getitem__)
            logits = self._run_in_order([states[i] for i in order], [slots[i] for i in order], want)
            out: list[np.ndarray] = [None] * len(logits)  # type: ignore[list-item]
            for rank, i in enumerate(order):
                out[i * want : (i + 1) * want] = logits[rank * want : (rank + 1) * want]
            return out
        return self._run_in_order(states, slots, want, prompt)

    def _run_in_order(
        self, states: list[_SeqState], slots: list[int], want: int, prompt: bool = False
    ) -> list[np.ndarray]:
        items: list[tuple[int, int, int, bool]] = []
        for state, slot in zip(states, slots):
            held = self._held[slot]
            start = min(len(held), len(state.tokens) - want)  # the wanted logits are computed anew
            if start < len(held):
                self._ctx.drop(slot, start)
                del held[start:]
            state.reused = start
            todo = state.tokens[start:]
            if len(states) == 1 and want == 1 and self._on_copy(start, len(todo), prompt):
                return [self._eval_on_prefill_context(slot, state.tokens, start)]
            items += [(slot, start + i, t, i >= len(todo) - want) for i, t in enumerate(todo)]
            held.extend(todo)
        return self._eval(self._ctx, items)

    def _on_copy(self, held: int, new: int, prompt: bool) -> bool:
        """Whether a lone sequence's `new` tokens, after `held` its slot holds, run on the prefill
        copy. A prompt does, whatever its length, so that the logits picking its first token come
        from the copy's (float32) weights, and a repeated prompt (all of it held but the last
        token, whose logits are computed anew) gets the same answer whether or not a slot held
        it. Except a conversation's next turn, a few new tokens after a long held prefix, where
        the decoding context attends without the flash-attention kernel: the round trip of the
        held KV through the copy (re-laid both ways) and the kernel's pass of a few tokens over
        the held context cost several times the pass where it decodes, so its first token comes
        from the decoding weights. A catch-up goes there from PREFILL_MIN_TOKENS on."""
        if self._prefill is None:
            return False
        if prompt:
            next_turn = held >= NEXT_TURN_HELD_TOKENS and 1 < new < NEXT_TURN_NEW_TOKENS
            return not (next_turn and self._next_turn_here)
        return new >= PREFILL_MIN_TOKENS

    def _bind(self, state: _SeqState) -> int:
        if state.slot is not None and self._owner[state.slot] is state:
            slot = state.slot
        else:
            slot = self._claim(state)
            # Whatever this slot still holds is valid up to the common prefix, for the same tenant.
            held = self._held[slot] if self._salt[slot] == state.salt else []
            self._salt[slot] = state.salt
            common = _common_prefix(held, state.tokens)
            self._ctx.drop(slot, common)
            del self._held[slot][common:]
            self._copy_prefix(slot, state, common)
        self._last_used[slot] = time.monotonic()
        return slot

    def _claim(self, state: _SeqState) -> int:
        """A slot for `state`, which holds none: taken from a live sequence if none is free."""
        slot = self._pick_slot(state)
        previous = self._owner[slot]
        if previous is not None:
            previous.slot = None  # it will recompute when it runs again
            self.evictions += 1
        self._owner[slot] = state
        state.slot = slot
        return slot

    def _shared_prefix(self, slot: int, tokens: list[int], salt: int) -> int:
        """Leading `tokens` whose KV `slot` holds, for the same tenant (`salt`) only."""
        return _common_prefix(self._held[slot], tokens) if self._salt[slot] == salt else 0

    def _copy_prefix(self, slot: int, state: _SeqState, common: int) -> None:
        """Take a longer prefix of the prompt from another slot of the same tenant, running or
        not, instead of computing it again: a shared system prompt is prefilled once, not once per
        slot that serves it."""
        best, source = common + COPY_MIN_TOKENS, None
        for other in range(self.max_sequences):
            if other != slot and len(self._held[other]) >= best:
                n = self._shared_prefix(other, state.tokens, state.salt)
                if n >= best:
                    best, source = n, other
        if source is None:
            return
        self._ctx.copy(source, slot, best)
        self._held[slot] = self._held[source][:best]
        self.prefix_cache.copies += 1

    def _pick_slot(self, state: _SeqState) -> int:
        """The lowest free slot, so that running sequences stay consecutive: it takes over the
        longest prefix of the prompt that another slot holds (`_copy_prefix` in `_bind`). The KV
        it kept for reuse, where the prompt would overwrite it, moves to the free slot that is
        empty or least recently used, if that one is older (a copy, far cheaper than a prefill): a tenant's next turn or
        prompt finds it there. With every slot running, the one sharing the longest prefix,
        then the least recently used."""
        free = [i for i, owner in enumerate(self._owner) if owner is None]
        if free:
            lowest = free[0]
            if len(free) > 1 and len(self._held[lowest]) > self._shared_prefix(lowest, state.tokens, state.salt):
                spare = min(free[1:], key=lambda i: (len(self._held[i]) > 0, self._last_used[i]))
                if not self._held[spare] or self._last_used[spare] < self._last_used[lowest]:
                    self._move_kv(lowest, spare)
            return lowest
        best, best_common = 0, -1
        for i in range(self.max_sequences):
            common = self._shared_prefix(i, state.tokens, state.salt)
            if common > best_common or (common == best_common and self._last_used[i] < self._last_used[best]):
                best, best_common = i, common
        return best

    def _pack(self, freed: int) -> None:
        """A slot below a running sequence fell free: the highest running sequence moves into
        it (a KV copy), so the running ones stay consecutive. The freed slot's own
        KV is lost for reuse; the moved sequence's stays behind in its old slot for it."""
        high = max((i for i, owner in enumerate(self._owner) if owner is not None), default=-1)
        if high <= freed:
            return
        mover = self._owner[high]
        assert mover is not None
        self._move_kv(high, freed)
        self._owner[freed], self._owner[high] = mover, None
        mover.slot = freed
        self.moves += 1

    def _move_kv(self, src: int, dst: int) -> None:
        """`dst` holds what `src` holds (`src` keeps it too)."""
        self._ctx.copy(src, dst)
        self._held[dst] = list(self._held[src])
        self._salt[dst] = self._salt[src]
        self._last_used[dst] = self._last_used[src]

    def _eval_on_prefill_context(self, slot: int, tokens: list[int], start: int) -> np.ndarray:
        """Evaluate tokens[start:] on the requantized copy, then move the KV into `slot`."""
        pre = self._prefill
        self.copy_passes += 1
        pre.drop(0, 0)
        if start:
            pre.restore(self._ctx.export(slot), 0, source=self._ctx)
        last = len(tokens) - start - 1
        logits = self._eval(pre, [(0, start + i, t, i == last) for i, t in enumerate(tokens[start:])])[0]
        self._ctx.restore(pre.export(0), slot, source=pre)
        self._held[slot] = list(tokens)
        return logits

    def _eval(self, ctx: Context, items: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        """One pass, on the threads the box can give it (host_tuning/cores.py): all of them on an
        idle box or for a long run of tokens, one beside a busy box."""
        with self.cores.forward_pass(len(items)) as threads:
            ctx.set_threads(threads)
            return ctx.eval(items)


def decode_attention(setting: str) -> str:
    """The decoding context's attention for a config's `flash_attention`: "auto" is off where the
    CPU has AVX-512, whose matrix products make a step over a long context faster than the
    kernel's, and on elsewhere, where steps cost about the same either way and the kernel
    computes prompts faster (docs/engines.md)."""
    if setting != "auto":
        return setting
    return "off" if cpu_has_avx512() else "on"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if not n:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n
