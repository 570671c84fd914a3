"""vLLM's metric names beside banyan's (banyan.server.vllm_names), so vLLM's dashboards read banyan unchanged."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from banyan.ipc.messages import EngineStats
from banyan.server.metrics import ServerMetrics, token_buckets

MODEL = "tiny-llama"

# Every series vLLM's published Grafana dashboard (examples/online_serving/prometheus_grafana) queries, with
# the suffix it queries it by; the model_name label is its one template variable.
VLLM_DASHBOARD_SERIES = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count",
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count",
    "vllm:gpu_cache_usage_perc",
    "vllm:request_prompt_tokens_bucket", "vllm:request_generation_tokens_bucket",
    "vllm:request_success_total",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
]
# And vLLM v1's current names for the same numbers.
VLLM_V1_SERIES = [
    "vllm:kv_cache_usage_perc", "vllm:inter_token_latency_seconds_bucket", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "vllm:request_inference_time_seconds_bucket",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
]


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    body, _ = metrics.render()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def names(metrics: ServerMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


def stats(**overrides) -> EngineStats:
    fields = dict(time=0.0, num_steps=0, num_running=0, num_waiting=0, kv_usage=0.0, num_pages=100,
                  num_free_pages=100, prefix_query_tokens=0, prefix_hit_tokens=0, num_preemptions=0)
    return EngineStats(**(fields | overrides))


def busy_metrics(**kwargs) -> ServerMetrics:
    m = ServerMetrics(MODEL, max_model_len=2048, **kwargs)
    m.update_from_engine_stats(stats(num_running=3, num_waiting=2, kv_usage=0.75, prefix_query_tokens=64,
                                     prefix_hit_tokens=16, spec_num_drafts=2, spec_accepted_per_pos=[1]))
    m.observe_request(prompt_tokens=12, generation_tokens=4, finished_reason="stop", ttft=0.25,
                      itls=[0.02, 0.03, 0.05], e2e=0.35, queue_time=0.05)
    m.observe_max_generation_tokens(4)
    return m


def test_every_series_of_vllms_dashboard_is_exported_with_the_model_name_label():
    exported = samples(busy_metrics())
    for series in VLLM_DASHBOARD_SERIES + VLLM_V1_SERIES:
        assert any(name == series and ("model_name", MODEL) in labels for name, labels in exported), series


def test_vllm_names_carry_the_same_samples_and_labels_as_banyans():
    exported = samples(busy_metrics())
    mirrored = {(name.replace("vllm:", "banyan:", 1), labels): v for (name, labels), v in exported.items()
                if name.startswith("vllm:")}
    aliases = {"banyan:gpu_cache_usage_perc": "banyan:kv_cache_usage_perc",
               "banyan:time_per_output_token_seconds": "banyan:inter_token_latency_seconds"}
    for (name, labels), v in mirrored.items():
        for alias, original in aliases.items():
            name = name.replace(alias, original)
        assert exported[(name, labels)] == v, name
    assert exported[("vllm:gpu_cache_usage_perc", frozenset({("model_name", MODEL)}))] == 0.75
    assert exported[("vllm:request_success_total",
                     frozenset({("model_name", MODEL), ("finished_reason", "stop")}))] == 1


def test_banyan_only_families_stay_banyan_only():
    exported = names(busy_metrics())
    assert "banyan:grammar_cache_entries" in exported and "vllm:grammar_cache_entries" not in exported
    assert not any(n.startswith("vllm:request_rejections") for n in exported)


def test_the_flag_turns_vllm_names_off():
    exported = names(busy_metrics(vllm_names=False))
    assert "banyan:num_requests_running" in exported
    assert not any(n.startswith("vllm:") for n in exported)


def test_per_request_phases_come_from_queue_time_ttft_and_e2e():
    exported = samples(busy_metrics())
    model = frozenset({("model_name", MODEL)})
    assert exported[("banyan:request_prefill_time_seconds_sum", model)] == pytest.approx(0.20)  # ttft - queue
    assert exported[("banyan:request_decode_time_seconds_sum", model)] == pytest.approx(0.10)  # e2e - ttft
    assert exported[("banyan:request_inference_time_seconds_sum", model)] == pytest.approx(0.30)  # e2e - queue
    assert exported[("banyan:request_prompt_tokens_sum", model)] == 12
    assert exported[("banyan:request_max_num_generation_tokens_count", model)] == 1


def test_rejections_are_counted_per_tenant_and_status():
    m = ServerMetrics(MODEL)
    m.observe_rejection("key-a", 429, "rate_limit_exceeded")
    m.observe_rejection("key-a", 429, "rate_limit_exceeded")
    m.observe_rejection("key-b", 503, "server_overloaded")
    exported = samples(m)
    key = ("banyan:request_rejections_total",
           frozenset({("model_name", MODEL), ("tenant", "key-a"), ("status", "429"), ("code", "rate_limit_exceeded")}))
    assert exported[key] == 2


def test_token_buckets_are_1_2_5_up_to_the_context():
    assert token_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert token_buckets(8192)[-1] == 5000
