"""Turn next-token logits into a token: greedy, or temperature + top-p/top-k/min-p with a seeded RNG.

`LogitsAdjuster` applies what depends on the request and the tokens so far (penalties,
logit_bias, min_tokens, ignore_eos) before either. It works on several rows at once, row i being
the position after i draft tokens, so speculative verification judges each draft against
exactly the distribution the target alone would have chosen from there: lossless under all of
them.
"""

from __future__ import annotations

import torch

from engines.types import SamplingParams


class LogitsAdjuster:
    """One request's logits processing: OpenAI's presence/frequency penalties (on generated
    tokens), vLLM's repetition penalty (on prompt and generated tokens), logit_bias, and EOS
    held back until `min_tokens` (always, with `ignore_eos`)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_ids: frozenset[int]) -> None:
        self.params = params
        self.prompt_ids = prompt_ids
        self.eos_ids = sorted(eos_ids)
        self.generated = 0
        self._counts: torch.Tensor | None = None  # generated-token counts [vocab], made on first use
        self._prompt_seen: torch.Tensor | None = None
        self._pending: list[int] = []  # generated before the vocab size was known

    def accept(self, token: int) -> None:
        """A token was emitted."""
        self.generated += 1
        if not self.params.penalized:
            return
        if self._counts is None:
            self._pending.append(token)
        else:
            self._counts[token] += 1

    def _state(self, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._counts is None:
            self._counts = torch.zeros(vocab, dtype=torch.float32)
            for token in self._pending:
                self._counts[token] += 1
            self._pending = []
            self._prompt_seen = torch.zeros(vocab, dtype=torch.bool)
            ids = [t for t in self.prompt_ids if 0 <= t < vocab]
            if ids:
                self._prompt_seen[torch.tensor(ids)] = True
        assert self._prompt_seen is not None
        return self._counts, self._prompt_seen

    def __call__(self, logits: torch.Tensor, drafts: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
        """Adjusted logits. `logits` is [vocab] (the next position) or [rows, vocab], row i the
        position after `drafts[:i]`."""
        p = self.params
        if not p.adjusts_logits:
            return logits
        single = logits.dim() == 1
        x = (logits.unsqueeze(0) if single else logits).float().clone()
        rows, vocab = x.shape
        if p.penalized:
            counts, seen_prompt = self._state(vocab)
            counts = counts.unsqueeze(0).repeat(rows, 1)
            for i, token in enumerate(drafts[: rows - 1]):
                counts[i + 1:, token] += 1
            if p.repetition_penalty != 1.0:
                seen = seen_prompt.unsqueeze(0) | (counts > 0)
                penalized = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
                x = torch.where(seen, penalized, x)
            x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if 0 <= t < vocab], dtype=torch.long)
            bias = torch.tensor([b for t, b in p.logit_bias if 0 <= t < vocab], dtype=torch.float32)
            if len(ids):
                x[:, ids] += bias
        if p.penalized:  # a penalty that overflowed a logit must not make the row NaN
            x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
        if self.eos_ids and (p.ignore_eos or self.generated < p.min_tokens):
            held = rows if p.ignore_eos else min(rows, p.min_tokens - self.generated)
            x[:held, self.eos_ids] = float("-inf")
        return x[0] if single else x

def end_where_nothing_is_allowed(logits: torch.Tensor, eos_ids: frozenset[int]) -> torch.Tensor:
    """A row with no token left to choose (a grammar that allows only the end while min_tokens
    or ignore_eos holds the end back) ends the output there: the grammar wins, and no sampler
    meets a row of -inf. `logits` is [vocab] or [rows, vocab]."""
    dead = ~torch.isfinite(logits).any(dim=-1)
    if not bool(dead.any()):
        return logits
    logits = logits.clone()
    eos = torch.tensor(sorted(eos_ids))
    if logits.dim() == 1:
        logits[eos] = 0.0
    else:
        logits[dead.nonzero(as_tuple=True)[0].unsqueeze(1), eos.unsqueeze(0)] = 0.0
    return logits


# A token the distribution rules out (a grammar, a -100 bias) has log-probability -inf, which JSON
# cannot carry: every engine reports it as this finite floor, as OpenAI does.
LOGPROB_FLOOR = -9999.0
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
    """The distribution a sampled request draws from (after top-k, temperature, min-p and top-p).

    Speculative verification needs these exact probabilities, not just a sample, so keep
    this separate from `sample`.
    """
    logits = logits.float()
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / max(params.temperature, MIN_TEMPERATURE), dim=-1)
    if params.min_p > 0.0:
        floor = params.min_p * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
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
