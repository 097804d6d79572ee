"""Turn next-token logits into a token: greedy, or temperature + top-p with a seeded RNG."""

from __future__ import annotations

import torch

from engines.types import SamplingParams

# Below this, logits / temperature overflows float32 and softmax returns NaN; a temperature this
# small is greedy in all but name, so it is computed as this one.
MIN_TEMPERATURE = 1e-4


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """A per-request RNG, so a request with a `seed` is reproducible whatever else runs."""
    if params.greedy:
        return None
    gen = torch.Generator(device="cpu")
    if params.seed is not None:
        gen.manual_seed(params.seed)
    else:
        gen.seed()
    return gen


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request draws from (after temperature and top-p).

    Speculative verification needs these exact probabilities, not just a sample, so keep
    this separate from `sample`.
    """
    probs = torch.softmax(logits.float() / max(params.temperature, MIN_TEMPERATURE), dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, dim=-1)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (cumulative - sorted_probs) >= params.top_p
        drop[..., 0] = False  # a top_p below float32's resolution still keeps the top token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Pick the next token from a 1-D logits vector."""
    if params.greedy:
        return int(torch.argmax(logits).item())
    probs = probabilities(logits, params)
    return int(torch.multinomial(probs, 1, generator=generator).item())
