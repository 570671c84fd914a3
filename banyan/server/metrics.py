"""Prometheus metrics for `/metrics`, named as vLLM's with the `banyan:` prefix so dashboards port.

Each ServerMetrics owns its CollectorRegistry (never prometheus_client's global one), so two apps
or two tests in one process never share or collide on a metric. Engine-wide numbers arrive in
EngineStats snapshots; per-request numbers arrive once, when the request finishes.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import Metric

from banyan.ipc.messages import EngineStats
from banyan.server.vllm_names import vllm_registry

# Bucket bounds as vLLM's, so the same histogram_quantile panels read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error")  # as banyan.text.outputs


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_model_len (as vLLM's token-count histograms)."""
    bounds, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(step * scale))
        scale *= 10


class ServerMetrics:
    """The server's metrics for one served model; `render()` is the `/metrics` response."""

    def __init__(self, model_name: str, *, max_model_len: int = 8192, vllm_names: bool = True):
        self.registry = CollectorRegistry()
        self._vllm = vllm_registry(self.registry) if vllm_names else None
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"banyan:{name}", doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            # prometheus_client appends `_total` itself: `banyan:x` is exposed as `banyan:x_total`.
            return Counter(f"banyan:{name}", doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                f"banyan:{name}", doc, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in model execution.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to run.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.")
        self.engine_healthy = gauge("engine_healthy", "1 while the engine core runs and makes progress (/health), else 0.")
        self.grammar_cache_entries = gauge("grammar_cache_entries", "Compiled grammars held for reuse.")
        self.grammar_cache_bytes = gauge("grammar_cache_bytes", "Memory held by compiled grammars (estimate).")
        self.lora_resident_adapters = gauge("lora_resident_adapters", "LoRA adapters holding a weight slot.")

        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.grammar_cache_evictions = counter("grammar_cache_evictions", "Compiled grammars dropped from the cache.")
        self.lora_adapter_loads = counter("lora_adapter_loads", "LoRA adapters copied into a slot (loads and reloads).")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.spec_num_drafts = counter("spec_decode_num_drafts", "Speculative verifications (request-steps with drafts).")
        self.spec_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            "banyan:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, per position in the draft.",
            labels + ["position"], registry=self.registry,
        )
        self.model_name = model_name

        success = Counter(
            "banyan:request_success", "Successfully processed requests.",
            labels + ["finished_reason"], registry=self.registry,
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}

        self.ttft = histogram(
            "time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram(
            "inter_token_latency_seconds", "Time between output tokens in seconds.", ITL_BUCKETS)
        self.e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency in seconds.",
            LATENCY_BUCKETS)
        self.queue_time = histogram(
            "request_queue_time_seconds", "Time spent waiting in the queue in seconds.",
            LATENCY_BUCKETS)
        # a request's phases, as vLLM splits them: queued | prefill (to the first token) | decode (to the last)
        phase = {"inference": "first scheduled to last token", "prefill": "first scheduled to first token",
                 "decode": "first to last token"}
        self.inference_time, self.prefill_time, self.decode_time = (
            histogram(f"request_{name}_time_seconds", f"Time from {span} in seconds.", LATENCY_BUCKETS)
            for name, span in phase.items())
        lengths = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per request.", lengths)
        self.request_generation_tokens = histogram("request_generation_tokens", "Generated tokens per request.", lengths)
        self.max_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Most tokens any choice of one HTTP request generated.", lengths)
        self._rejections = Counter(
            "banyan:request_rejections", "Requests refused at admission (429 rate limit, 503 at capacity), per tenant.",
            labels + ["tenant", "status", "code"], registry=self.registry,
        )

        self._last_stats: EngineStats | None = None

    def update_from_engine_stats(self, stats: EngineStats) -> None:
        """Set the gauges; advance the counters by what the core's cumulative counts grew by (`growth`)."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_usage)
        self.grammar_cache_entries.set(stats.grammar_cache_entries)
        self.grammar_cache_bytes.set(stats.grammar_cache_bytes)
        self.lora_resident_adapters.set(stats.lora_resident_adapters)
        last = self._last_stats
        for counter, field in [
            (self.prefix_cache_queries, "prefix_query_tokens"),
            (self.prefix_cache_hits, "prefix_hit_tokens"),
            (self.num_preemptions, "num_preemptions"),
            (self.grammar_cache_evictions, "grammar_cache_evictions"),
            (self.lora_adapter_loads, "lora_adapter_loads"),
            (self.spec_num_drafts, "spec_num_drafts"),
            (self.spec_num_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_num_accepted_tokens, "spec_num_accepted_tokens"),
        ]:
            counter.inc(growth(getattr(stats, field), getattr(last, field) if last is not None else 0))
        before_per_pos = last.spec_accepted_per_pos if last is not None else []
        for position, now in enumerate(stats.spec_accepted_per_pos):
            before = before_per_pos[position] if position < len(before_per_pos) else 0
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(growth(now, before))
        self._last_stats = stats

    def observe_request(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        finished_reason: str,
        ttft: float | None,
        itls: list[float],
        e2e: float,
        queue_time: float | None,
    ) -> None:
        """Record one finished request (ttft is None when it produced no token; queue_time is None when
        it was never scheduled: its grammar forced the whole output)."""
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generation_tokens.inc(max(0, generation_tokens))
        success = self.request_success.get(finished_reason)
        if success is None:  # keep label cardinality bounded: only known reasons get a series
            success = self.request_success["error"]
        success.inc()
        if ttft is not None:
            self.ttft.observe(ttft)
        for itl in itls:
            self.itl.observe(itl)
        self.e2e.observe(e2e)
        self.request_prompt_tokens.observe(max(0, prompt_tokens))
        self.request_generation_tokens.observe(max(0, generation_tokens))
        if queue_time is not None:
            self.queue_time.observe(queue_time)
            self.inference_time.observe(max(0.0, e2e - queue_time))
            if ttft is not None:
                self.prefill_time.observe(max(0.0, ttft - queue_time))
        if ttft is not None:
            self.decode_time.observe(max(0.0, e2e - ttft))

    def observe_max_generation_tokens(self, num_tokens: int) -> None:
        """Once per HTTP request: the most tokens any of its choices generated (vLLM's n > 1 view)."""
        self.max_generation_tokens.observe(max(0, num_tokens))

    def observe_rejection(self, tenant_id: str, status: int, code: str) -> None:
        """A request refused at admission; tenant ids are the configured keys' ids (bounded)."""
        self._rejections.labels(self.model_name, tenant_id, str(status), code).inc()

    def render(self) -> tuple[bytes, str]:
        """The `/metrics` body and its content type: banyan's names, then vLLM's (unless turned off)."""
        return render_all([self])

    @property
    def registries(self) -> list[CollectorRegistry]:
        """banyan's names, then vLLM's."""
        return [self.registry] + ([self._vllm] if self._vllm is not None else [])


def render_all(models: list[ServerMetrics], *extra: CollectorRegistry) -> tuple[bytes, str]:
    """One `/metrics` body for several models (each family once, every model's samples under it), then `extra`."""
    return generate_latest(_Merged([*models], list(extra))), CONTENT_TYPE_LATEST


class _Merged:
    """Collects the models' registries as one: a family the models share is emitted once with all their series."""

    def __init__(self, models: list[ServerMetrics], extra: list[CollectorRegistry]):
        self.models = models
        self.extra = extra

    def collect(self) -> Iterator[Metric]:
        for layer in range(2):  # banyan's names first, then vLLM's, as one model's render has them
            families: dict[str, Metric] = {}
            for model in self.models:
                registries = model.registries
                for family in registries[layer].collect() if layer < len(registries) else ():
                    if family.name in families:
                        families[family.name].samples.extend(family.samples)
                    else:
                        families[family.name] = family
            yield from families.values()
        for registry in self.extra:
            yield from registry.collect()


def growth(now: int, before: int) -> int:
    """What a core's cumulative count grew by; one that went down means the core restarted from zero."""
    return now - before if now >= before else max(0, now)
