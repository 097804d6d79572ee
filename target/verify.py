"""Verify draft tokens against the target's logits, losslessly.

Greedy requests accept the longest prefix of drafts equal to the target's argmax. Sampled
requests use the modified rejection sampling of Leviathan et al. (2023) / Chen et al. (2023):
accept draft token x with probability min(1, p(x)/q(x)); on the first rejection draw the
replacement from norm(max(0, p - q)); if every draft is accepted, draw a bonus token from p.
The emitted tokens are then distributed exactly as if the target had sampled them alone.

A proposer that is deterministic (n-gram, prompt lookup, cache hints) is a point mass:
q(x) = 1 for its token, so acceptance is p(x) and the residual is p with x removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.sampling import probabilities
from engines.types import SamplingParams


@dataclass(slots=True)
class Verdict:
    accepted: list[int]  # the accepted prefix of the draft
    next_token: int  # the correction (on rejection) or bonus (all accepted) token


def verify(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    rng: torch.Generator | None,
) -> Verdict:
    """`target_logits[i]` is the target's prediction for position i (row k: after every draft).

    Shapes: target_logits [k+1, vocab], draft_probs [k, vocab] or None (point-mass drafts).
    """
    k = len(draft_tokens)
    assert target_logits.shape[0] == k + 1
    if params.greedy:
        choices = torch.argmax(target_logits, dim=-1).tolist()
        n = 0
        while n < k and choices[n] == draft_tokens[n]:
            n += 1
        return Verdict(draft_tokens[:n], int(choices[n]))

    p = probabilities(target_logits, params)  # [k+1, vocab]
    uniforms = torch.rand(k, generator=rng) if k else torch.empty(0)
    for i, token in enumerate(draft_tokens):
        p_x = float(p[i, token])
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, token])
        if q_x > 0 and float(uniforms[i]) < min(1.0, p_x / q_x):
            continue
        residual = p[i].clone()
        if draft_probs is None:
            residual[token] = 0.0
        else:
            residual = torch.clamp(residual - draft_probs[i], min=0.0)
        total = float(residual.sum())
        if total <= 0.0:  # p == q exactly: any rejection is measure-zero; fall back to p
            residual, total = p[i], 1.0
        token_out = int(torch.multinomial(residual / total, 1, generator=rng))
        return Verdict(draft_tokens[:i], token_out)
    bonus = int(torch.multinomial(p[k], 1, generator=rng))
    return Verdict(list(draft_tokens), bonus)
