"""Request and engine metrics, exported through Ray's metrics agent to Prometheus.

Ray's agent on every node serves them in Prometheus text (prefixed `ray_`; Ray writes the
scrape targets to /tmp/ray/prom_metrics_service_discovery.json), summed across replicas and
nodes by Prometheus, so an ingress or model replica that dies or scales out loses nothing.
Recording one value is cheap enough to do for every token.

Names follow vLLM's (`vllm:time_to_first_token_seconds` ...) under our own namespace (Ray drops a `:`), with
seconds and `_total` as OpenTelemetry's Prometheus conventions have them; the Grafana dashboard
(telemetry/grafana_dashboard.json) reads exactly these.
"""

from __future__ import annotations

from configs.schemas import MetricsConfig
from telemetry.clock import StageClock

NAMESPACE = "latency_serve"

# name -> (kind, description, tag keys). Histograms use MetricsConfig.latency_buckets_s.
REQUEST_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "time_to_first_token_seconds": ("histogram", "Arrival at the ingress to the first token", ("model_name", "tier")),
    "inter_token_latency_seconds": ("histogram", "Time between output tokens, per token", ("model_name",)),
    "e2e_request_latency_seconds": ("histogram", "Arrival to the last token", ("model_name", "tier")),
    "request_queue_time_seconds": ("histogram", "Admission queue plus the model replica's queue", ("model_name",)),
    "stage_duration_seconds": ("histogram", "Time in each stage of the request path (Server-Timing)", ("stage",)),
    "requests": ("counter", "Finished requests by model, route reason, cache result and HTTP status",
                 ("model_name", "route", "cache", "status")),
    "requests_shed": ("counter", "Requests refused by admission (429/503), by reason", ("reason", "tier")),
    "prompt_tokens": ("counter", "Prompt tokens of generated requests", ("model_name",)),
    "generation_tokens": ("counter", "Generated tokens", ("model_name",)),
    "num_requests_running": ("gauge", "Requests generating, admitted by this ingress replica", ("model_name",)),
    "num_requests_waiting": ("gauge", "Requests in this ingress replica's admission queue", ("model_name",)),
}
ENGINE_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "spec_decode_num_draft_tokens": ("counter", "Draft tokens proposed to the target", ("model_name",)),
    "spec_decode_num_accepted_tokens": ("counter", "Draft tokens the target accepted", ("model_name",)),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix KV cache", ("model_name",)),
    "prefix_cache_hits": ("counter", "Prompt tokens whose KV came from the prefix cache", ("model_name",)),
}
CONTROLLER_METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "replicas": ("gauge", "Running replicas per deployment", ("deployment",)),
}
# Admission's refusals: these count as shed (the rest of the 4xx/5xx are errors).
SHED_REASONS = {
    "deadline_unmeetable", "deadline_in_queue", "queue_full", "queue_wait_limit", "queue_timeout",
    "rate_limit_requests", "rate_limit_tokens",
}


def metric_name(short: str) -> str:
    return f"{NAMESPACE}_{short}"


def exported_names() -> list[str]:
    """Every series name as Prometheus sees it on Ray's endpoint (counters gain `_total`)."""
    out = []
    for table in (REQUEST_METRICS, ENGINE_METRICS, CONTROLLER_METRICS):
        for short, (kind, _, _) in table.items():
            out.append(f"ray_{metric_name(short)}" + ("_total" if kind == "counter" else ""))
    return out


class _Metrics:
    """Ray metric objects for one table, made once per process."""

    def __init__(self, table: dict[str, tuple[str, str, tuple[str, ...]]], buckets: list[float]) -> None:
        from ray.util import metrics

        self._m = {}
        for short, (kind, text, tags) in table.items():
            name = metric_name(short)
            if kind == "histogram":
                self._m[short] = metrics.Histogram(name, description=text, boundaries=buckets, tag_keys=tags)
            elif kind == "counter":
                self._m[short] = metrics.Counter(name, description=text, tag_keys=tags)
            else:
                self._m[short] = metrics.Gauge(name, description=text, tag_keys=tags)

    def __getitem__(self, short: str):
        return self._m[short]


class RequestMetrics:
    """What the ingress records: one call per event, never raising into the request path."""

    def __init__(self, config: MetricsConfig, models: list[str] = ()) -> None:
        self._m = _Metrics(REQUEST_METRICS, config.latency_buckets_s)
        self._models = set(models)  # their queue gauges exist from the start, at 0

    def first_token(self, model: str, tier: str, ttft_s: float) -> None:
        self._m["time_to_first_token_seconds"].observe(ttft_s, tags={"model_name": model, "tier": tier})

    def tokens(self, model: str, gap_s: float, n: int) -> None:
        """A chunk of `n` tokens arrived `gap_s` after the previous one: n gaps of gap_s / n."""
        if n <= 0:
            return
        hist, tags = self._m["inter_token_latency_seconds"], {"model_name": model}
        per = gap_s / n
        for _ in range(min(n, 64)):
            hist.observe(per, tags=tags)

    def finished(self, model: str, tier: str, e2e_s: float, queue_s: float, prompt: int, generated: int) -> None:
        tags = {"model_name": model}
        self._m["e2e_request_latency_seconds"].observe(e2e_s, tags={"model_name": model, "tier": tier})
        self._m["request_queue_time_seconds"].observe(queue_s, tags=tags)
        if prompt:
            self._m["prompt_tokens"].inc(prompt, tags=tags)
        if generated:
            self._m["generation_tokens"].inc(generated, tags=tags)

    def stages(self, clock: StageClock) -> None:
        hist = self._m["stage_duration_seconds"]
        for name, ms in clock.stage_ms().items():
            hist.observe(ms / 1000, tags={"stage": name})

    def request(self, model: str, route: str, cache: str, status: int, shed_reason: str | None, tier: str) -> None:
        self._m["requests"].inc(tags={"model_name": model, "route": route, "cache": cache, "status": str(status)})
        if shed_reason is not None:
            self._m["requests_shed"].inc(tags={"reason": shed_reason, "tier": tier})

    def queues(self, running: dict[str, int], waiting: dict[str, int]) -> None:
        """Set the gauges; a model that went idle reads 0, not its last value."""
        self._models |= set(running) | set(waiting)
        for model in self._models:
            self._m["num_requests_running"].set(running.get(model, 0), tags={"model_name": model})
            self._m["num_requests_waiting"].set(waiting.get(model, 0), tags={"model_name": model})


class EngineMetrics:
    """What a model replica records when a generation ends."""

    def __init__(self, config: MetricsConfig, model: str) -> None:
        self._m = _Metrics(ENGINE_METRICS, config.latency_buckets_s)
        self._tags = {"model_name": model}

    def speculation(self, proposed: int, accepted: int) -> None:
        if proposed:
            self._m["spec_decode_num_draft_tokens"].inc(proposed, tags=self._tags)
        if accepted:
            self._m["spec_decode_num_accepted_tokens"].inc(accepted, tags=self._tags)

    def prefix_cache(self, queried: int, hit: int) -> None:
        if queried:
            self._m["prefix_cache_queries"].inc(queried, tags=self._tags)
        if hit:
            self._m["prefix_cache_hits"].inc(hit, tags=self._tags)


class ControllerMetrics:
    def __init__(self) -> None:
        self._m = _Metrics(CONTROLLER_METRICS, [])

    def replicas(self, counts: dict[str, int]) -> None:
        for deployment, n in counts.items():
            self._m["replicas"].set(n, tags={"deployment": deployment})
