"""Resolve a model source to a local HF-format directory, converting GGUF once.

transformers dequantizes GGUF on every load, slowly. The first replica to start converts it
to safetensors under a cache dir; every later start loads that, much faster.
A file lock makes concurrent replicas wait for one conversion instead of racing.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

from filelock import FileLock

from configs.schemas import ModelSource

log = logging.getLogger(__name__)

_DONE_MARKER = "CONVERTED_OK"


def default_cache_dir() -> Path:
    root = os.environ.get("LATENCY_SERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "latency-serve")
    return Path(root) / "models"


def package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model package {package!r} is not installed; run scripts/setup.sh (it installs it with --no-deps)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def resolve_model_dir(source: ModelSource, cache_dir: str | None = None) -> Path:
    """Return a directory `from_pretrained` can load quickly, converting on first use."""
    if source.path:
        path = Path(source.path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"model path {path} does not exist")
        return path
    assert source.package and source.gguf_file
    gguf_path = package_dir(source.package) / source.gguf_file
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path} not found in package {source.package!r}")
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / f"{source.package}--{Path(source.gguf_file).stem}"
    if (target / _DONE_MARKER).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=600):
        if not (target / _DONE_MARKER).exists():  # another replica may have finished meanwhile
            _convert_gguf(gguf_path, target)
    return target


def _convert_gguf(gguf_path: Path, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    start = time.monotonic()
    log.info("converting %s to safetensors in %s (one time)", gguf_path.name, target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # save_pretrained refuses a model that remembers it came from GGUF: rebuild it clean.
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    clean.load_state_dict(model.state_dict(), strict=False)
    clean.tie_weights()
    clean.generation_config = model.generation_config
    clean.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _DONE_MARKER).write_text(f"{gguf_path}\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log.info("converted %s in %.1f s", gguf_path.name, time.monotonic() - start)


_GGUF_TYPES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "bf16": "LLAMA_FTYPE_MOSTLY_BF16", "f32": "LLAMA_FTYPE_ALL_F32"}


def requantized_gguf(gguf_path: Path, quant: str, cache_dir: str | None = None) -> Path:
    """A copy of a GGUF file requantized to `quant` (llama.cpp's own quantizer), made once under the cache dir; concurrent replicas wait on a file lock."""
    import ctypes

    import llama_cpp

    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    target = root / f"{gguf_path.stem}.{quant}.gguf"
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock", timeout=600):
        if target.is_file():
            return target
        start = time.monotonic()
        tmp = target.with_name(target.name + ".tmp")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, _GGUF_TYPES[quant])
        params.allow_requantize = True  # from the already-quantized weights: exactly what they hold
        params.nthread = 2
        if llama_cpp.llama_model_quantize(str(gguf_path).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"llama.cpp could not requantize {gguf_path.name} to {quant}")
        tmp.rename(target)
        log.info("requantized %s to %s in %.1f s", gguf_path.name, quant, time.monotonic() - start)
    return target
