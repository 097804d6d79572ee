"""The embedded CPU engine: a transformers causal LM with a rollback-able DynamicCache."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from configs.schemas import EngineConfig
from engines.base import Engine, PassStopped, Sequence
from engines.model_store import resolve_model_dir
from engines.prefix_cache import PrefixCache
from host_tuning.cores import CoreShare

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}  # int8: quantized after load


class TransformersEngine(Engine):
    batches = True

    def __init__(self, config: EngineConfig, share_cores: bool = False) -> None:
        start = time.monotonic()
        torch.set_num_threads(config.num_threads)
        self.cores = CoreShare(config.num_threads, share_cores)  # off: every pass on all its threads
        self._threads = config.num_threads
        model_dir = resolve_model_dir(config.source, config.cache_dir)
        self.model_id = config.model_id
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_DTYPES[config.dtype]).eval()
        if config.dtype == "int8":
            # The decoder's Linear weights stored int8, activations quantized on the fly; the LM
            # head (tied to the embeddings) stays float32.
            torch.ao.quantization.quantize_dynamic(self.model.get_decoder(), {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
        self.max_model_len = min(config.max_model_len, getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        pc = config.prefix_cache
        self.prefix_cache = PrefixCache(pc.block_size, pc.max_mb << 20) if pc.enabled else None
        # A pass that leaves a core free until a moment (or until `ended` says so) goes back to
        # all its threads at the next check after it: before each decoder layer and before its
        # MLP (a check is far cheaper than the layer it precedes).
        self.one_core_released: tuple[float, str] | None = None  # (when, why) the last window ended
        self._one_core_until = 0.0
        self._one_core_ended: Callable[[], bool] | None = None
        self._pass_threads = config.num_threads
        self._stop = False  # set from the event loop's thread: the pass under way ends at its next layer
        for layer in getattr(self.model.get_decoder(), "layers", []):
            layer.register_forward_pre_hook(self._layer_threads)
            if isinstance(getattr(layer, "mlp", None), torch.nn.Module):
                layer.mlp.register_forward_pre_hook(self._window_check)
        self.load_seconds = time.monotonic() - start
        log.info("%s loaded from %s in %.1f s (%s)", self.model_id, model_dir, self.load_seconds, config.dtype)

    def new_sequence(self, salt: int = 0) -> Sequence:
        return Sequence(DynamicCache(config=self.model.config), salt)

    @torch.inference_mode()
    def prefill(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        cache = self.prefix_cache if seq.length == 0 else None  # a prompt, not a catch-up
        if cache is not None:
            reused, layers = cache.match(token_ids, seq.salt)
            for index, (keys, values) in enumerate(layers):
                seq.kv.update(keys, values, index)
            seq.length = seq.reused = reused
        # logits_to_keep=1: the LM head over every prompt position is wasted work.
        logits = self._forward(seq, token_ids[seq.reused :], logits_to_keep=1)[-1]
        if cache is not None:
            cache.insert(token_ids, [(layer.keys, layer.values) for layer in seq.kv.layers], seq.salt)
        return logits

    @torch.inference_mode()
    def score(self, seq: Sequence, token_ids: list[int]) -> torch.Tensor:
        return self._forward(seq, token_ids, logits_to_keep=0)

    @torch.inference_mode()
    def decode_batch(self, seqs: list[Sequence], token_ids: list[int]) -> torch.Tensor:
        """One decode step for several sequences in ONE forward pass; logits [len(seqs), vocab].

        The weights are read once for the whole batch, which is what a decode step on CPU (or
        GPU) is bound by. Each sequence keeps its own KV cache: for the step they are
        left-padded into one batch (the padding masked out), and each sequence's new KV entry is
        appended back to its own cache afterwards.
        """
        if len(seqs) == 1:
            return self.decode_step(seqs[0], token_ids[0]).unsqueeze(0)
        lengths = [seq.length for seq in seqs]
        if max(lengths) + 1 > self.max_model_len:
            raise ValueError(f"sequence would exceed max_model_len={self.max_model_len}")
        width = max(lengths)
        batch = DynamicCache(config=self.model.config)
        for index in range(len(seqs[0].kv.layers)):
            keys, values = [], []
            for seq, length in zip(seqs, lengths):
                layer = seq.kv.layers[index]
                pad = (0, 0, width - length, 0)  # left-pad the token axis
                keys.append(torch.nn.functional.pad(layer.keys, pad))
                values.append(torch.nn.functional.pad(layer.values, pad))
            batch.update(torch.cat(keys), torch.cat(values), index)
        self._pick_threads()
        mask = torch.zeros(len(seqs), width + 1, dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, width - length :] = 1
        out = self.model(
            input_ids=torch.tensor(token_ids, dtype=torch.long).unsqueeze(1),
            past_key_values=batch,
            attention_mask=mask,
            position_ids=torch.tensor(lengths, dtype=torch.long).unsqueeze(1),
            cache_position=torch.tensor([width]),
            use_cache=True,
            logits_to_keep=1,
        )
        for index, layer in enumerate(batch.layers):
            new_keys, new_values = layer.keys[:, :, width:], layer.values[:, :, width:]
            for row, seq in enumerate(seqs):
                seq.kv.update(new_keys[row : row + 1].clone(), new_values[row : row + 1].clone(), index)
        for seq in seqs:
            seq.length += 1
        return out.logits[:, -1].float()

    def remember(self, seq: Sequence, token_ids: list[int]) -> None:
        if self.prefix_cache is not None and seq.length:
            layers = [(layer.keys, layer.values) for layer in seq.kv.layers]
            self.prefix_cache.insert(token_ids[: seq.length], layers, seq.salt)

    def rollback(self, seq: Sequence, length: int) -> None:
        if length < seq.length:
            seq.kv.crop(length - seq.length)  # transformers 5.x: a negative count of tokens to drop
            seq.length = length

    def leave_one_core(self, until: float, ended: Callable[[], bool] | None = None) -> bool:
        """Until `until` (time.perf_counter), or until `ended()` says so first, passes keep to one
        thread: another process works for the same request meanwhile (host tuning's lookup
        window, host_tuning/lookup_window.py). 0 ends it; `one_core_released` says when and why
        the core came back."""
        self._one_core_until = until
        self._one_core_ended = ended
        self.one_core_released = None
        return True

    def stop_pass(self, stop: bool) -> None:
        self._stop = stop

    def _pick_threads(self) -> None:
        """On the thread that runs the pass: torch's thread count is that thread's setting."""
        self._pass_threads = self.cores.threads()
        self._window_check()
        self._set_threads(1 if self._one_core_until else self._pass_threads)

    def _layer_threads(self, module, args) -> None:
        """Before each decoder layer: stop if asked to; the window to leave a core free is
        over, take it back."""
        if self._stop:
            raise PassStopped
        self._window_check()

    def _window_check(self, *hook_args) -> None:
        if not self._one_core_until:
            return
        now = time.perf_counter()
        if now >= self._one_core_until:
            why = "estimate"
        elif self._one_core_ended is not None and self._one_core_ended():
            why = "signal"
        else:
            return
        self._one_core_until = 0.0
        self.one_core_released = (now, why)
        self._set_threads(self._pass_threads)

    def _set_threads(self, threads: int) -> None:
        if threads != self._threads:
            torch.set_num_threads(threads)
            self._threads = threads

    def _forward(self, seq: Sequence, token_ids: list[int], logits_to_keep: int) -> torch.Tensor:
        if seq.length + len(token_ids) > self.max_model_len:
            raise ValueError(f"sequence would exceed max_model_len={self.max_model_len}")
        self._pick_threads()
        ids = torch.tensor([token_ids], dtype=torch.long)
        positions = torch.arange(seq.length, seq.length + len(token_ids)).unsqueeze(0)
        out = self.model(
            input_ids=ids,
            past_key_values=seq.kv,
            position_ids=positions,
            cache_position=positions[0],
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        seq.length += len(token_ids)
        return out.logits[0].float()


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)

