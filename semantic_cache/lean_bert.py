"""A lean forward pass for one text through a BERT sentence encoder (MiniLM), same weights.

Why: a request embeds one short text (tens of tokens), where the work is 24 small matrix
products and everything else is overhead. Going through the transformers modules, and through
`F.linear` (which multiplies by a transposed weight on every call), costs clearly more than
products against weights transposed once at load time, with Q, K and V fused into one product.
The vector is the same (cosine to sentence-transformers' ≥ 0.99999, checked at load by
`Embedder`, which falls back to the module path if it ever is not).

In bfloat16 (`dtype`), on a CPU with native bf16 dot products (AVX512-BF16, AMX), the pass takes
less time than float32 and moves half the weight bytes (which matters beside a prefill that
fills the memory bus); the vector stays within cosine ≥ 0.9999 of the float32 one. `Embedder`
picks it only where it measures faster and that close (elsewhere bf16 is emulated, and slower).

The pass is traced once (TorchScript) and runs as one call that holds the GIL only at its
ends. Op by op, every one of the many small ops gives the GIL back and waits to take it again:
beside a busy Python thread (an ingress streaming tokens) one embedding takes many times its
time alone; traced, close to it.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class _Layer:
    qkv_w: torch.Tensor  # (hidden, 3*hidden), transposed once
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    up_w: torch.Tensor
    up_b: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor


def float_weights(bert: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The encoder's tensors in float32, once it is checked to be the plain BERT (absolute
    positions, GELU) that the lean passes implement; ValueError otherwise."""
    config = bert.config
    if config.model_type != "bert" or config.hidden_act != "gelu":
        raise ValueError(f"not a plain BERT encoder: {config.model_type}/{config.hidden_act}")
    return {k: v.detach().float().contiguous() for k, v in bert.state_dict().items()}


def token_ids(tokenizer, text: str, max_length: int) -> list[int]:
    return tokenizer(text, truncation=True, max_length=max_length)["input_ids"]


def unit(vector: np.ndarray) -> np.ndarray:
    """Unit length, so cosine similarity is a dot product."""
    return vector / max(float(np.linalg.norm(vector)), 1e-12)


def layer_weights(weights: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Encoder layer i's float32 tensors as the lean pass multiplies by them (`_Layer`'s
    fields): matrices transposed to (in, out), Q, K and V fused into one product."""
    p = f"encoder.layer.{i}."

    def t(name: str) -> torch.Tensor:
        return weights[p + name].t().contiguous()

    def fused(kind: str) -> torch.Tensor:
        return torch.cat([weights[f"{p}attention.self.{n}.{kind}"] for n in ("query", "key", "value")])

    return {
        "qkv_w": fused("weight").t().contiguous(), "qkv_b": fused("bias"),
        "out_w": t("attention.output.dense.weight"), "out_b": weights[p + "attention.output.dense.bias"],
        "ln1_w": weights[p + "attention.output.LayerNorm.weight"], "ln1_b": weights[p + "attention.output.LayerNorm.bias"],
        "up_w": t("intermediate.dense.weight"), "up_b": weights[p + "intermediate.dense.bias"],
        "down_w": t("output.dense.weight"), "down_b": weights[p + "output.dense.bias"],
        "ln2_w": weights[p + "output.LayerNorm.weight"], "ln2_b": weights[p + "output.LayerNorm.bias"],
    }


class LeanBertEncoder:
    """Mean-pooled, unit-length embedding of one text; BERT with absolute positions and GELU."""

    def __init__(self, bert: torch.nn.Module, tokenizer, max_length: int, dtype: torch.dtype = torch.float32) -> None:
        config = bert.config
        weights = float_weights(bert)
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.hidden = config.hidden_size
        self.heads = config.num_attention_heads
        self.eps = config.layer_norm_eps
        self.word = weights["embeddings.word_embeddings.weight"]
        self.position = weights["embeddings.position_embeddings.weight"]
        self.token_type = weights["embeddings.token_type_embeddings.weight"][0]
        self.ln_w = weights["embeddings.LayerNorm.weight"]
        self.ln_b = weights["embeddings.LayerNorm.bias"]

        self.layers = [
            _Layer(**{name: tensor.to(dtype) for name, tensor in layer_weights(weights, i).items()})
            for i in range(config.num_hidden_layers)
        ]

        self._traced = self._trace()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (n,) -> the unnormalised mean-pooled vector (d,)."""
        n, d = ids.size(0), self.hidden
        x = self.word.index_select(0, ids) + self.position.narrow(0, 0, n) + self.token_type
        x = F.layer_norm(x, (d,), self.ln_w, self.ln_b, self.eps).to(self.dtype)
        for layer in self.layers:
            # One text, no padding: attention needs no mask.
            q, k, v = torch.addmm(layer.qkv_b, x, layer.qkv_w).view(n, 3, self.heads, -1).permute(1, 2, 0, 3).unbind(0)
            attended = F.scaled_dot_product_attention(q, k, v).transpose(0, 1).reshape(n, d)
            x = F.layer_norm(torch.addmm(layer.out_b, attended, layer.out_w) + x, (d,), layer.ln1_w, layer.ln1_b, self.eps)
            up = F.gelu(torch.addmm(layer.up_b, x, layer.up_w))
            x = F.layer_norm(torch.addmm(layer.down_b, up, layer.down_w) + x, (d,), layer.ln2_w, layer.ln2_b, self.eps)
        return x.float().mean(0)

    def _trace(self):
        """The forward as one TorchScript call (any length: sizes are traced, not baked in),
        or None where tracing fails or disagrees with the eager pass (then: op by op)."""
        try:
            with torch.inference_mode(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                traced = torch.jit.trace(_Forward(self), torch.tensor(self._ids("trace me")), check_trace=False)
                for probe in ("short", "a longer text to check that the traced pass did not fix the length " * 3):
                    ids = torch.tensor(self._ids(probe))
                    if not _same(traced(ids), self.forward(ids), self.dtype):
                        raise ValueError(f"traced pass disagrees on {len(ids)} tokens")
            return traced
        except Exception as exc:  # eager works everywhere; tracing is only the faster way
            log.info("lean MiniLM runs eagerly: %s", exc)
            return None

    def _ids(self, text: str) -> list[int]:
        return token_ids(self.tokenizer, text, self.max_length)

    def embed(self, text: str) -> np.ndarray:
        ids = torch.tensor(self._ids(text))
        with torch.inference_mode():
            vector = (self._traced(ids) if self._traced is not None else self.forward(ids)).numpy().astype(np.float32)
        return unit(vector)


def _same(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    """The traced and the eager pass agree: to float32's rounding, or in bfloat16 (where the
    traced graph rounds in another order: cosine ~0.99995 apart) in direction, which is all a
    unit-length embedding keeps."""
    if dtype == torch.float32:
        return torch.allclose(a, b, atol=1e-5)
    return float(F.cosine_similarity(a, b, dim=0)) >= 0.9995


class _Forward(torch.nn.Module):
    """The lean pass as a module, for torch.jit.trace."""

    def __init__(self, encoder: LeanBertEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder.forward(ids)
