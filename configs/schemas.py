"""Pydantic schemas for every deployment's arguments.

`serve_config.yaml` -> applications[].args is validated by `AppArgs`; each deployment
re-validates its own slice on start, so a bad value fails loudly at deploy time with the
field's path, not at the first request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator


from configs.model_stages import (  # noqa: F401  (re-exported: every schema is importable from here)
    EngineConfig, ModelSource, ModelStageConfig, PrefixCacheConfig, SamplingDefaults, SpeculativeConfig,
    Strict as _Strict, VLLMConfig, VLLMSpeculativeConfig,
)


class ClassifierConfig(_Strict):
    """The learned router: logistic regression on the request's MiniLM embedding."""

    weights: str | None = Field(None, description="weights JSON; default router/weights/difficulty.json (router.train)")
    threshold: float = Field(0.5, gt=0, lt=1, description="p_hard at or above this goes to the large model")
    min_threshold: float = Field(0.15, gt=0, lt=1, description="lowest the load shift may move it (small model busy)")
    max_threshold: float = Field(0.9, gt=0, lt=1, description="highest the load shift may move it (large model busy)")

    @model_validator(mode="after")
    def _ordered(self) -> "ClassifierConfig":
        if not self.min_threshold <= self.threshold <= self.max_threshold:
            raise ValueError("need min_threshold <= threshold <= max_threshold")
        if self.weights is not None and not Path(self.weights).is_file():
            raise ValueError(f"no weights file at {self.weights!r}; make one with `python -m router.train --out PATH`")
        return self


class LoadAwareConfig(_Strict):
    """Live load moves the classifier's threshold: a busy large model sends borderline requests small."""

    enabled: bool = True
    gain: float = Field(0.3, ge=0, le=1, description="threshold shift at full pressure difference")
    ttft_slo_ms: float = Field(1000.0, gt=0, description="a stage whose recent TTFT reaches this is at pressure 1")
    large_capacity: int = Field(2, ge=1, description="requests in flight at which the large model is at pressure 1")
    small_capacity: int = Field(4, ge=1, description="requests in flight at which the small model is at pressure 1")
    ttft_half_life_s: float = Field(5.0, gt=0, description="how fast an old TTFT reading fades")


class RouterConfig(_Strict):
    """Which model answers a request sent to `auto_model_id`; an explicit model is always honored."""

    kind: Literal["rules", "classifier"] = Field(
        "classifier", description="classifier: learned on the shared embedding; rules: length/depth/keywords"
    )
    placement: Literal["inline", "remote"] = Field(
        "inline",
        description="inline: the ingress routes in-process (microseconds, no hop); remote: ask the Router deployment",
    )
    auto_model_id: str = "auto"
    small_max_prompt_tokens: int = Field(
        256, ge=0, description="longer prompts go to the large model (counted without a system prompt seen "
        "before: an app's standing instructions, which the engines keep as a cached prefix)")
    small_max_output_tokens: int = Field(128, ge=0, description="a requested max_tokens above this goes large")
    small_max_turns: int = Field(4, ge=0, description="user turns in the conversation")
    hard_keywords: list[str] = Field(
        default_factory=lambda: ["prove", "step by step", "explain why", "derive", "code", "analyze", "compare"],
        description="kind: rules only",
    )
    classifier: ClassifierConfig = ClassifierConfig()
    load_aware: LoadAwareConfig = LoadAwareConfig()


class VectorStoreConfig(_Strict):
    kind: Literal["edge", "qdrant"] = Field(
        "edge", description="edge: Qdrant's engine embedded in the replica (HNSW); qdrant: qdrant-client"
    )
    location: str | None = Field(
        None, description="edge: a directory (default: a temporary one); qdrant: ':memory:', a path or a server URL"
    )
    collection: str = "semantic_cache"
    index_every: int = Field(1000, ge=1, description="edge: rebuild the HNSW index after this many new entries")


class SemanticConfig(_Strict):
    """Paraphrase matching on the last user turn, inside the scope of everything else."""

    enabled: bool = True
    mode: Literal["verify", "bounded", "trust"] = Field(
        "verify",
        description="verify: a semantic match is never served as is; the answering model checks the cached answer "
        "as a speculative draft, token by token, so the response is exactly the model's own (x-cache: verified); "
        "a wrong cached answer costs speed, never correctness. Needs a model that drafts from hints (the "
        "transformers target with speculation); elsewhere a match is generated as a miss. bounded: verify, and "
        "learn from every verification when a match may be served unverified (x-cache: hit) with the chance of "
        "a wrong answer under max_error_rate (semantic_cache/skip_policy.py). trust: a match that passes the "
        "threshold and the guards is served at once (x-cache: hit), and can be wrong",
    )
    max_error_rate: float = Field(
        0.01, gt=0, lt=0.5,
        description="mode bounded: the highest chance of serving a cached answer the model would not have given; "
        "nothing is served unverified until the verifications seen bound it (299 clean ones at 0.01)",
    )
    explore_rate: float = Field(
        0.05, ge=0, le=1, description="mode bounded: share of would-be unverified hits verified anyway, to keep learning",
    )
    threshold: float = Field(0.86, gt=0, le=1, description="cosine to serve a hit; tuned by `python -m bench cache`")
    hint_threshold: float = Field(0.7, gt=0, le=1, description="cosine to hand a near miss to the target as a draft")
    guards: bool = Field(True, description="negation / number / entity / contrast checks before serving a hit")
    max_query_chars: int = Field(
        2000, ge=1, description="a last user turn longer than this is looked up by exact match only: MiniLM "
        "reads its first 256 word pieces, so a longer question's meaning past them is not in its embedding",
    )
    embed_precision: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="MiniLM's one-text pass (cache lookups, the router): auto takes bfloat16 where, observed at "
        "load, it is faster and within cosine 0.9995 of float32 (CPUs with AVX512-BF16 or AMX)",
    )
    embed_runtime: Literal["auto", "onnxruntime", "torch"] = Field(
        "auto",
        description="what runs that pass: auto takes onnxruntime (float32) where, timed at load, it gives "
        "sentence-transformers' vector (cosine 0.99999) in at most 0.85x the time of torch's pick (AVX2-only "
        "CPUs, typically); onnxruntime runs float32 only",
    )
    store: VectorStoreConfig = VectorStoreConfig()

    @model_validator(mode="after")
    def _ordered(self) -> "SemanticConfig":
        if self.hint_threshold > self.threshold:
            raise ValueError("hint_threshold must not exceed threshold")
        if self.embed_runtime == "onnxruntime" and self.embed_precision == "bfloat16":
            raise ValueError("embed_runtime onnxruntime runs MiniLM in float32: embed_precision bfloat16 needs torch")
        return self


class CacheConfig(_Strict):
    """Response cache: an exact-match fast path, then a semantic (MiniLM + Qdrant) lookup."""

    enabled: bool = True
    max_entries: int = Field(10_000, ge=1)
    ttl_s: float = Field(3600.0, gt=0)
    sampled_opt_in: bool = Field(
        True, description="requests with temperature > 0 may use the cache with header `x-cache-sampled: allow`"
    )
    coalesce: bool = Field(True, description="identical cacheable requests in flight share one generation")
    replay_chunk_words: int = Field(4, ge=1, description="words per SSE chunk when a hit is replayed as a stream")
    near_entries: int = Field(
        1024, ge=0, description="per-ingress exact-answer cache (no hop on a repeat); 0 turns it off"
    )
    near_ttl_s: float = Field(
        30.0, gt=0, description="how long an ingress keeps a near copy: bounds staleness after another "
        "ingress replica's invalidate"
    )
    semantic: SemanticConfig = SemanticConfig()


class TierConfig(_Strict):
    """An SLO tier: its deadlines, its place in the queue and its token budgets."""

    priority: int = Field(0, ge=0, le=100, description="0 is served first; EDF (earliest deadline) within a tier")
    ttft_ms: float | None = Field(None, gt=0, description="time-to-first-token target; None: only e2e counts")
    tpot_ms: float | None = Field(
        None, gt=0, description="time-per-output-token target: a request starts only while the predicted time "
        "between tokens, its own and every running request's, stays within it, and waits in the queue meanwhile. "
        "None: concurrency is bounded by the deadlines and seats alone",
    )
    e2e_ms: float = Field(15_000, gt=0, description="default deadline (x-request-deadline-ms overrides it)")
    max_input_tokens: int | None = Field(
        None, ge=1, description="longer conversations are trimmed (system prompt + latest turns kept)"
    )
    max_output_tokens: int | None = Field(None, ge=1, description="max_tokens above this is lowered to it")
    downgrade: bool = Field(
        False, description="model=auto requests may go to the small model when only it can meet the deadline"
    )
    max_queue_ms: float | None = Field(
        None, ge=0, description="longest wait in the admission queue: queued only if a slot is predicted "
        "within it, shed (queue_timeout) when it passes; 0: start now or shed. None: until its latest useful start",
    )


class TenantLimits(_Strict):
    """Token buckets of one tenant, service-wide (each ingress replica enforces its share)."""

    tier: str | None = Field(None, description="the tier of this tenant's requests when no header names one")
    allowed_tiers: list[str] | None = Field(None, description="tiers its x-slo-tier header may pick; None: any")
    requests_per_s: float = Field(50.0, gt=0)
    request_burst: float = Field(100.0, ge=1)
    tokens_per_s: float = Field(100_000.0, gt=0, description="prompt + max_tokens, per second")
    token_burst: float = Field(200_000.0, ge=1)


def _default_tiers() -> dict[str, TierConfig]:
    return {
        # A client that names no tier: served whenever the answer can come within the deadline,
        # queued meanwhile; never refused for a first-token target it did not ask for.
        "standard": TierConfig(priority=0, e2e_ms=60_000, downgrade=True, tpot_ms=200),
        # Asked for (x-slo-tier, or a tenant's tier): a first token within 1 s, or a 503 before
        # it: it waits for a slot only while its first token can still come in time.
        "interactive": TierConfig(priority=0, ttft_ms=1000, e2e_ms=15_000, downgrade=True, tpot_ms=200),
        "batch": TierConfig(priority=1, e2e_ms=120_000),
    }


class AdmissionConfig(_Strict):
    """Deadline-aware admission, decided in each ingress replica; the controller shares out the
    service-wide limits and the fleet's load, off the request path."""

    mode: Literal["predictive", "fifo"] = Field(
        "predictive", description="predictive: shed requests whose deadline can't be met, EDF queue; "
        "fifo: no deadlines, first come first served (what plain Ray Serve / vLLM do)"
    )
    allow_mode_header: bool = Field(
        False, description="let `x-admission-mode: fifo|predictive` pick the mode per request (benchmarks only)"
    )
    max_inflight: int = Field(32, ge=1, description="requests generating at once, whole service")
    max_queued: int = Field(64, ge=0, description="requests waiting for a slot, whole service")
    tenant_share: float = Field(
        0.75, gt=0, le=1, description="while more than one API key is active (seen in the last minute), the most "
        "of max_inflight, of each model's seats and of max_queued that one key's requests (n choices count as n) "
        "may hold, so another tenant always finds room; a key alone has it all; 1: no cap. Within a priority the "
        "queue is served fairly by tokens (docs/admission.md)",
    )
    sync_interval_s: float = Field(1.0, gt=0, description="how often ingress replicas sync with the controller")
    retry_after_s: int = Field(1, ge=0, description="Retry-After floor; sheds add the predicted wait")
    default_tier: str = Field(
        "standard", description="the tier of a request whose header and tenant name none: standard queues "
        "rather than sheds, within its end-to-end deadline"
    )
    tiers: dict[str, TierConfig] = Field(default_factory=_default_tiers)
    tenants: dict[str, TenantLimits] = Field(
        default_factory=dict, description="by tenant id (`python -m admission.tenant KEY` prints a key's id); "
        "`default` applies to every tenant not listed"
    )
    prior_itl_ms: float = Field(60.0, gt=0, description="decode ms/token assumed until observed")
    prior_prefill_ms_per_token: float = Field(
        0.5, gt=0, description="prefill ms/token assumed until observed, for a model whose replica does not measure "
        "its own at its start (the CPU engines do; vLLM does not)",
    )
    safety: float = Field(
        1.1, ge=1.0, description="predicted decode times (the end-to-end part, which no feedback calibrates) are "
        "multiplied by this; a first token's prediction is calibrated at the median per model, and its margin is "
        "the recent tail of lateness (ttft_tail_quantile)",
    )
    ttft_tail_quantile: float | None = Field(
        0.95, gt=0, lt=1, description="a first token must be predicted in time even as many ms late, against "
        "its prediction, as this quantile of the last 30 s of first tokens came (a TTFT target is a tail bound); "
        "null: the mean bias only",
    )
    verdict_wait_ms: float = Field(
        30.0, ge=0, description="on a busy box a model=auto request waits this long for the router's verdict (its "
        "embedding, slower under load), then commits against the load now: to the large model without the "
        "verdict ('router_late'; admission may still downgrade it), to the small one, or shed; an idle box waits on",
    )
    estimate_max_age_s: float = Field(
        30.0, gt=0, description="a concurrency level's service-time estimate not refreshed for this long starts "
        "to fade toward the extrapolation from fresher levels, so one slow spell can't keep admission shut for good",
    )
    estimate_half_life_s: float = Field(
        90.0, gt=0, description="how fast a stale estimate fades: its log-distance from the extrapolation "
        "halves this often (short: a slow spell is forgotten sooner; long: a burst after a quiet spell is "
        "priced by what the last burst observed)",
    )

    @model_validator(mode="after")
    def _tiers_known(self) -> "AdmissionConfig":
        if self.default_tier not in self.tiers:
            raise ValueError(f"default_tier {self.default_tier!r} is not in tiers {sorted(self.tiers)}")
        for name, tenant in self.tenants.items():
            named = ([tenant.tier] if tenant.tier else []) + (tenant.allowed_tiers or [])
            unknown = set(named) - set(self.tiers)
            if unknown:
                raise ValueError(f"tenants.{name} names unknown tiers {sorted(unknown)}")
        return self

    def tenant(self, tenant_id: str) -> TenantLimits:
        return self.tenants.get(tenant_id) or self.tenants.get("default") or TenantLimits()


class InputLimits(_Strict):
    """What one request may ask of a replica; past any of these it gets a 400 that names the limit."""

    max_messages: int = Field(1024, ge=1, description="messages in one chat request")
    max_prompt_chars: int = Field(
        400_000, ge=1, description="characters of message content (or of the prompt) in one request"
    )
    max_stop_chars: int = Field(256, ge=1, description="characters in one stop sequence")
    max_tools_chars: int = Field(
        100_000, ge=1, description="characters of tool definitions (as JSON) in one chat request"
    )
    grammar_timeout_s: float = Field(
        1.0, gt=0, description="a structured output's or tools' grammar must convert within this; "
        "past it the request gets a 400 (grammar_too_complex)",
    )
    max_embedding_inputs: int = Field(64, ge=1, description="texts in one /v1/embeddings request")
    max_embedding_tokens: int = Field(
        4096, ge=1, description="MiniLM word pieces in one /v1/embeddings request, all its texts together: "
        "a request's work is bounded so it is served in well under a second on a small CPU box",
    )


class IngressConfig(_Strict):
    served_model_ids: list[str] | None = Field(None, description="default: auto + every engine's model_id")
    max_body_bytes: int = Field(1_048_576, ge=1024, description="request body size (413 above it)")
    limits: InputLimits = Field(InputLimits(), description="what one request may ask of a replica (400s past it)")
    sampling: SamplingDefaults = SamplingDefaults()
    stage_timeout_s: float = Field(2.0, gt=0, description="cache/router call timeout; on expiry degrade, never fail")
    overlap_cache_lookup: bool | Literal["idle"] = Field(
        "idle",
        description="start the model while the cache lookup is in flight: a miss pays no lookup wait (its CPU "
        "prefill keeps to one thread until the lookup's embedding is done), a hit cancels the call, a near miss "
        "follows as a late draft hint; idle: only while no model is running anything (a hit's wasted prefill "
        "delays no one)",
    )
    request_timeout_s: float = Field(300.0, gt=0, description="ceiling for a request without a deadline")
    over_limit_hold_s: float = Field(
        1.0, ge=0, le=10,
        description="a refusal for the tenant's own limit (429 over its rate, 503 over its share of the queue) is "
        "sent after up to this long, taken out of its Retry-After: a client that retries without pausing gets "
        "one refusal a hold per connection instead of hundreds a second; 0: at once",
    )
    body_timeout_s: float = Field(30.0, gt=0, description="the whole request body must arrive within this (408)")
    warmup_wait_s: float = Field(
        30.0, ge=0, description="a request that arrives before every stage is warm waits this long for it, "
        "then gets 503 warming_up with Retry-After",
    )
    log_prompts: bool = Field(
        False, description="log each request's body, and error messages (which may quote it); API keys never are"
    )
    direct_port: int | None = Field(
        None, ge=1, le=65535,
        description="each ingress replica also serves the API on this port itself (SO_REUSEPORT), skipping Ray "
        "Serve's proxy hop; None: only the proxy's port",
    )
    direct_host: str = Field("127.0.0.1", description="the direct listener's address (loopback unless fronted)")
    send_timeout_s: float = Field(
        30.0, gt=0, description="direct listener: a client that reads none of its response for this long is cut "
        "(its model slot is already free once the model finished)",
    )
    drain_s: float = Field(
        15.0, ge=0, description="direct listener: at a replica's graceful shutdown, how long requests under way "
        "may take to finish (new connections go to the other replicas on the port)",
    )
    debug_timings: bool = Field(
        False, description="every response's Server-Timing carries the engine's inner counts (prefix tokens "
        "reused, jobs queued ahead); off: only admin keys see them, since they tell one tenant about another's prompts",
    )


class HostTuningConfig(_Strict):
    """Mechanisms for a small CPU box whose cores every stage shares (docs/small-cpu-tuning.md,
    host_tuning/). Off by default, and in the GPU profiles: then none of them runs."""

    enabled: bool = Field(False, description="turn on the mechanisms below (each can then be turned off alone)")
    front_nice: int | None = Field(
        0, ge=-20, le=19, description="OS niceness of the ingress's and the cache's processes, every thread (Ray "
        "starts workers at 15): below the models' level their small, latency-critical work runs ahead of the "
        "compute; going under 15 needs CAP_SYS_NICE (else a warning); null: leave Ray's",
    )
    model_nice: int = Field(
        19, ge=0, le=19, description="OS niceness of the model replicas' compute threads, a level (not an increment)"
    )
    share_cores: bool = Field(
        True, description="the CPU engines on a box take turns for its cores: a prompt's pass runs alone on all "
        "its threads, a decode step on all of them only while no other engine is in a pass, else on one (two "
        "threads beside a busy model stall at every barrier); engines without the pass lock (torch) go by the "
        "others' load (under 0.35 cores: all threads)",
    )
    side_channels: bool = Field(
        True, description="an ingress calls the cache and model replicas on its node over Unix sockets "
        "(deployments/channel.py) while a deployment has one replica and no autoscaling",
    )
    lookup_window: bool = Field(
        True, description="a prefill that starts beside the cache lookup keeps to one thread until the lookup's "
        "embedding is done (host_tuning/lookup_window.py)",
    )
    engine_own_session: bool = Field(
        True, description="a vLLM engine's processes take a session, so a scheduling group, of their own "
        "instead of sharing Ray's (host_tuning/engine_group.py): with the kernel's autogroup on, the engine's "
        "compute in Ray's group can hold a small box's cores for long stretches",
    )
    busy_box_small_from: int = Field(
        1, ge=0, description="requests running on the box's models, or about to (waiting for their verdicts), "
        "from which an auto request whose tier may downgrade goes to the small model while it has a free seat "
        "and is predicted to finish no later there: two CPU engines side by side slow each other's batched steps (admission/model_choice.py); 0: route by "
        "difficulty at any load",
    )

    @property
    def front_level(self) -> int | None:
        return self.front_nice if self.enabled else None

    @property
    def model_level(self) -> int | None:
        return self.model_nice if self.enabled else None

    @property
    def cores_shared(self) -> bool:
        return self.enabled and self.share_cores

    @property
    def channels(self) -> bool:
        return self.enabled and self.side_channels

    @property
    def window(self) -> bool:
        return self.enabled and self.lookup_window

    @property
    def small_from(self) -> int | None:
        return self.busy_box_small_from if self.enabled and self.busy_box_small_from > 0 else None


class AuthConfig(_Strict):
    """API keys. A key is named by its hash (`python -m admission.tenant KEY` prints it); the
    keys themselves need not be written anywhere the config goes."""

    required: bool = Field(
        False, description="every /v1 request needs a listed key (401 otherwise); off: any key or none is "
        "served, and keys not listed here or in admission.tenants share one rate-limit bucket",
    )
    api_keys: list[str] = Field(
        default_factory=list, description="accepted keys, each `sha256:<hex>` (the key's hash) or the key itself"
    )
    admin_keys: list[str] = Field(
        default_factory=list, description="keys that may also use admin routes (DELETE /v1/cache for any tenant) "
        "and see engine-internal counts in Server-Timing; same forms as api_keys",
    )
    keys_env: str = Field(
        "LATENCY_SERVE_API_KEYS", description="an environment variable of the ingress replicas: more api_keys, "
        "comma-separated",
    )
    admin_keys_env: str = Field(
        "LATENCY_SERVE_ADMIN_KEYS", description="an environment variable: more admin_keys, comma-separated"
    )
    keys_file: str | None = Field(
        None, description="a file of more api_keys, one a line; `admin` after one (space-separated) makes it an "
        "admin key; # starts a comment",
    )


class TracingConfig(_Strict):
    exporter: Literal["none", "console", "otlp"] = Field(
        "none", description="none: no spans are made (free); console: stdout; otlp: OTLP/HTTP to `endpoint`"
    )
    endpoint: str = Field("http://127.0.0.1:4318/v1/traces", description="the OTLP/HTTP traces URL (otlp only)")
    sample_ratio: float = Field(1.0, ge=0, le=1, description="new traces kept; a client's traceparent decides for its own")
    export_interval_ms: int = Field(2000, ge=10, description="how often finished spans leave in a batch")
    service_name: str = "latency-serve"


class MetricsConfig(_Strict):
    enabled: bool = Field(True, description="request and engine metrics on Ray's Prometheus endpoint")
    # Seconds. Covers a 2-core box (hundreds of ms) and a GPU (a few ms) alike.
    latency_buckets_s: list[float] = [
        0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
        1.0, 1.5, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
    ]


class TelemetryConfig(_Strict):
    tracing: TracingConfig = TracingConfig()
    metrics: MetricsConfig = MetricsConfig()


class AppArgs(_Strict):
    """Everything under `applications[].args` in serve_config.yaml."""

    target: ModelStageConfig
    draft: ModelStageConfig
    router: RouterConfig = RouterConfig()
    cache: CacheConfig = CacheConfig()
    admission: AdmissionConfig = AdmissionConfig()
    ingress: IngressConfig = IngressConfig()
    auth: AuthConfig = Field(AuthConfig(), description="API keys: required or not, who is listed, who is an admin")
    telemetry: TelemetryConfig = TelemetryConfig()
    host_tuning: HostTuningConfig = Field(
        HostTuningConfig(), description="mechanisms for a small shared CPU box; off by default (docs/small-cpu-tuning.md)"
    )
    handle_transport: Literal["grpc", "actor"] = Field(
        "grpc",
        description="how one deployment calls another (ingress -> cache/router/models, target -> remote draft): "
        "grpc, Serve's direct gRPC channel to the replica; actor, a Ray actor call (Serve's default). "
        "`python -m bench hops` measures both side by side",
    )

    @model_validator(mode="after")
    def _distinct_models(self) -> "AppArgs":
        ids = {self.target.engine.model_id, self.draft.engine.model_id, self.router.auto_model_id}
        if len(ids) != 3:
            raise ValueError("target, draft and router.auto_model_id must be three different model ids")
        unknown = set(self.ingress.served_model_ids or ()) - ids
        if unknown:
            raise ValueError(f"ingress.served_model_ids names models this app does not serve: {sorted(unknown)}")
        return self
