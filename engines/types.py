"""Plain data passed between the ingress and the model deployments.

Dataclasses rather than pydantic: they cross a Ray hop on every request and token chunk,
so they should be cheap to pickle. Validation happens once, at the HTTP edge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from host_tuning.lookup_window import LookupOverlap

FinishReason = Literal["stop", "length", "abort"]
GrammarKind = Literal["json", "json_schema", "regex", "choice", "structural_tag"]

# Counts a prompt's first chunk carries beside its engine_queue ms (engines/worker_clock.py):
# the worker's jobs that ran while it queued, and the longest one (ms, sequences, CPU per second).
ENGINE_QUEUE_COUNTS = ("engine_queue_jobs", "engine_queue_longest_ms", "engine_queue_longest_seqs",
                       "engine_queue_longest_cpu")


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match (engines/grammar.py). `spec`: a JSON schema, a regex, a JSON
    list of choices, or an xgrammar structural tag (JSON); empty for any JSON object."""

    kind: GrammarKind
    spec: str = ""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # OpenAI's penalties (on the tokens generated so far) and logit_bias ((token id, bias), ...);
    # vLLM's repetition_penalty (on prompt and output tokens), top_k (0: off), min_p,
    # min_tokens and ignore_eos.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; N: each token's log-probability and the N likeliest
    structured: StructuredOutput | None = None  # a grammar every chosen token must keep to

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Do the logits depend on the tokens so far (penalties), so need a per-row pass?"""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts_logits(self) -> bool:
        """Is anything applied to the logits before choosing (beyond temperature, top-p/k, min-p)?"""
        return self.penalized or bool(self.logit_bias) or self.min_tokens > 0 or self.ignore_eos


@dataclass(slots=True)
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    deadline_unix: float | None = None  # absolute wall-clock deadline, if the client set one
    draft_hint_ids: list[int] | None = None  # e.g. a near-miss cached answer, for the hint drafter
    trace: dict[str, str] | None = None  # W3C traceparent of the ingress's model-call span, when traced
    # Host tuning: the ingress's cache lookup runs beside this request's prefill, which leaves
    # it a core meanwhile (host_tuning/lookup_window.py); None elsewhere.
    lookup_overlap: LookupOverlap | None = None
    sent_unix: float | None = None  # when the ingress sent it (time.time): the replica times the hop in
    # Its tenant, hashed: prefix KV is reused only between requests with the same salt (vLLM's
    # cache_salt), so a tenant can't probe another's prompts by reuse or timing.
    cache_salt: str | None = None


@dataclass(slots=True)
class GenerateChunk:
    """One streamed piece of output. The last chunk has `finish_reason` set."""

    text: str
    num_tokens: int  # tokens generated since the previous chunk
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)  # engine-side stage times, first/last chunk
    replica: str = ""  # the model replica that made it (first chunk): x-model-replica, for debugging and bench
    # With SamplingParams.logprobs: per token, (its text, its log-probability, [(text, logprob)
    # of the likeliest tokens at that position]), from the distribution it was chosen from.
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] | None = None
