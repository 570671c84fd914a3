"""banyan's metrics under vLLM's names too (`vllm:` prefix, the same labels), so the dashboards and alerts
written for vLLM (its published Grafana dashboard among them) read a banyan server unchanged.

Nothing is counted twice: at scrape time `VllmNames` re-emits the samples of the banyan families that
vLLM also has, renamed. Where vLLM has two names for one number over its versions, both are emitted:

    banyan:kv_cache_usage_perc          -> vllm:kv_cache_usage_perc, vllm:gpu_cache_usage_perc (before v1)
    banyan:inter_token_latency_seconds  -> vllm:inter_token_latency_seconds,
                                           vllm:time_per_output_token_seconds (its name until 0.11)

banyan-only families (grammar cache, rejections per tenant) keep their `banyan:` name alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_inference_time_seconds": ("request_inference_time_seconds",),
    "request_prefill_time_seconds": ("request_prefill_time_seconds",),
    "request_decode_time_seconds": ("request_decode_time_seconds",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "request_max_num_generation_tokens": ("request_max_num_generation_tokens",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}
"""banyan family (after `banyan:`) -> the vLLM families (after `vllm:`) that carry the same samples."""


class VllmNames(Collector):
    """Collects `source`'s banyan families under their vLLM names; register it in a registry of its own
    (collecting from the registry it sits in would recurse)."""

    def __init__(self, source: CollectorRegistry):
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            base = family.name.removeprefix("banyan:")
            for name in VLLM_NAMES.get(base, ()) if base != family.name else ():
                yield renamed(family, f"banyan:{base}", f"vllm:{name}")


def renamed(family: Metric, old: str, new: str) -> Metric:
    """A copy of `family` named `new`; each sample's name keeps its suffix (_total, _bucket, _sum, ...)."""
    twin = copy.copy(family)
    twin.name = new
    twin.samples = [s._replace(name=new + s.name[len(old):]) for s in family.samples]
    return twin


def vllm_registry(source: CollectorRegistry) -> CollectorRegistry:
    """A registry whose one collector mirrors `source` under vLLM's names."""
    registry = CollectorRegistry()
    registry.register(VllmNames(source))
    return registry
