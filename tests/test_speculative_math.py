"""The rejection sampler reproduces the target distribution exactly (chi-square)."""

from __future__ import annotations

import math

import pytest
import torch

from engines.types import SamplingParams
from target.verify import verify

VOCAB = 6
TRIALS = 20_000


def _chi_square_p_value(observed: torch.Tensor, expected_probs: torch.Tensor) -> float:
    from scipy.stats import chisquare

    expected = expected_probs * observed.sum()
    mask = expected > 0
    assert observed[~mask].sum() == 0, "sampled a token the target gives zero probability"
    return float(chisquare(observed[mask].numpy(), expected[mask].numpy()).pvalue)


def _first_token_histogram(p_logits, draft_probs, point_mass: bool, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(max_tokens=1, temperature=1.0)
    counts = torch.zeros(VOCAB)
    target_logits = torch.stack([p_logits, p_logits])  # [k+1=2, vocab]
    for _ in range(TRIALS):
        if point_mass:
            draft = [2]
            q = None
        else:
            draft = [int(torch.multinomial(draft_probs, 1, generator=gen))]
            q = draft_probs.unsqueeze(0)
        verdict = verify(target_logits, draft, q, params, gen)
        first = verdict.accepted[0] if verdict.accepted else verdict.next_token
        counts[first] += 1
    return counts


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_matches_target_distribution(point_mass):
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.30])
    q = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.10, 0.10])  # a deliberately bad draft
    p_logits = torch.log(p)  # log(0) = -inf: a token the target never emits
    counts = _first_token_histogram(p_logits, q, point_mass, seed=0)
    assert _chi_square_p_value(counts, p) > 0.001


def test_rejection_sampling_detects_a_wrong_distribution():
    """The test above can fail: sampling from the draft itself is rejected by chi-square."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.0, 0.30])
    q = torch.tensor([0.40, 0.05, 0.30, 0.05, 0.10, 0.10])
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.multinomial(q, TRIALS, replacement=True, generator=gen), minlength=VOCAB).float()
    counts[4] = 0  # even ignoring the impossible token, the shape is wrong
    with pytest.raises(AssertionError):
        assert _chi_square_p_value(counts, p) > 0.001


def test_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, VOCAB), -10.0)
    for row, tok in enumerate([1, 2, 5, 3]):
        logits[row, tok] = 10.0
    params = SamplingParams(max_tokens=1, temperature=0.0)
    assert verify(logits, [1, 2, 4], None, params, None).accepted == [1, 2]
    assert verify(logits, [1, 2, 4], None, params, None).next_token == 5
    full = verify(logits, [1, 2, 5], None, params, None)
    assert full.accepted == [1, 2, 5] and full.next_token == 3  # bonus token
    assert verify(logits[:1], [], None, params, None).next_token == 1


def test_sampled_acceptance_rate_equals_overlap():
    """Expected acceptance of one draft is sum_x min(p, q): a check on the acceptance rule."""
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    q = torch.tensor([0.25, 0.25, 0.5, 0.0, 0.0, 0.0])
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=1, temperature=1.0)
    logits = torch.log(torch.stack([p, p]))
    accepted = 0
    for _ in range(5000):
        draft = [int(torch.multinomial(q, 1, generator=gen))]
        accepted += len(verify(logits, draft, q.unsqueeze(0), params, gen).accepted)
    assert math.isclose(accepted / 5000, 0.5, abs_tol=0.03)
