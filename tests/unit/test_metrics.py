"""Prometheus metrics named as vLLM's under `banyan:` (banyan.server.metrics)."""

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from banyan.ipc.messages import EngineStats
from banyan.server.metrics import ServerMetrics

MODEL = "tiny-llama"

EXPOSED_NAMES = [
    "banyan:num_requests_running",
    "banyan:num_requests_waiting",
    "banyan:kv_cache_usage_perc",
    "banyan:prefix_cache_queries_total",
    "banyan:prefix_cache_hits_total",
    "banyan:prompt_tokens_total",
    "banyan:generation_tokens_total",
    "banyan:request_success_total",
    "banyan:num_preemptions_total",
    "banyan:spec_decode_num_drafts_total",
    "banyan:spec_decode_num_draft_tokens_total",
    "banyan:spec_decode_num_accepted_tokens_total",
    "banyan:time_to_first_token_seconds_bucket",
    "banyan:inter_token_latency_seconds_bucket",
    "banyan:e2e_request_latency_seconds_bucket",
    "banyan:request_queue_time_seconds_bucket",
]


def make_stats(**overrides) -> EngineStats:
    fields = dict(
        time=0.0, num_steps=0, num_running=0, num_waiting=0, kv_usage=0.0, num_pages=100,
        num_free_pages=100, prefix_query_tokens=0, prefix_hit_tokens=0, num_preemptions=0,
    )
    return EngineStats(**(fields | overrides))


def samples(metrics: ServerMetrics) -> dict[tuple[str, frozenset], float]:
    """Every exposed sample as {(name, labels): value}, parsed back from the rendered text."""
    body, _ = metrics.render()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(metrics: ServerMetrics, name: str, **labels) -> float:
    return samples(metrics)[(name, frozenset({"model_name": MODEL, **labels}.items()))]


def test_every_metric_is_exposed_with_its_exact_name_and_model_label():
    body, content_type = ServerMetrics(MODEL).render()
    text = body.decode()
    assert content_type.startswith("text/plain")
    for name in EXPOSED_NAMES:
        assert f'{name}{{' in text, name
        assert any(
            line.startswith(name + "{") and f'model_name="{MODEL}"' in line
            for line in text.splitlines()
        ), name
    assert "_total_total" not in text
    assert 'finished_reason="stop"' in text


def test_metrics_live_in_their_own_registry():
    a, b = ServerMetrics("a"), ServerMetrics("b")  # a second instance must not collide
    assert a.registry is not b.registry is not REGISTRY
    assert b"banyan:" not in generate_latest(REGISTRY)
    assert 'model_name="b"' not in a.render()[0].decode()


def test_gauges_follow_the_latest_snapshot():
    m = ServerMetrics(MODEL)
    m.update_from_engine_stats(make_stats(num_running=5, num_waiting=2, kv_usage=0.25))
    m.update_from_engine_stats(make_stats(num_running=3, num_waiting=0, kv_usage=0.5))
    assert value(m, "banyan:num_requests_running") == 3
    assert value(m, "banyan:num_requests_waiting") == 0
    assert value(m, "banyan:kv_cache_usage_perc") == 0.5


def test_counters_advance_by_the_growth_of_the_cores_cumulative_counts():
    m = ServerMetrics(MODEL)
    m.update_from_engine_stats(make_stats(prefix_query_tokens=100, prefix_hit_tokens=40,
                                          num_preemptions=1))
    m.update_from_engine_stats(make_stats(prefix_query_tokens=100, prefix_hit_tokens=40,
                                          num_preemptions=1))  # idle heartbeat: no growth
    m.update_from_engine_stats(make_stats(prefix_query_tokens=250, prefix_hit_tokens=90,
                                          num_preemptions=3))
    assert value(m, "banyan:prefix_cache_queries_total") == 250
    assert value(m, "banyan:prefix_cache_hits_total") == 90
    assert value(m, "banyan:num_preemptions_total") == 3


def test_a_core_restart_never_makes_a_counter_go_down():
    m = ServerMetrics(MODEL)
    m.update_from_engine_stats(make_stats(prefix_query_tokens=500, num_preemptions=4))
    m.update_from_engine_stats(make_stats(prefix_query_tokens=30, num_preemptions=0))
    assert value(m, "banyan:prefix_cache_queries_total") == 530
    assert value(m, "banyan:num_preemptions_total") == 4
    m.update_from_engine_stats(make_stats(prefix_query_tokens=50, num_preemptions=1))
    assert value(m, "banyan:prefix_cache_queries_total") == 550
    assert value(m, "banyan:num_preemptions_total") == 5


def test_speculation_counters_advance_per_position_from_zero():
    m = ServerMetrics(MODEL)
    m.update_from_engine_stats(make_stats())  # speculation off: no position has a series yet
    assert not any(name.endswith("_per_pos_total") for name, _ in samples(m))
    m.update_from_engine_stats(make_stats(spec_num_drafts=4, spec_num_draft_tokens=12, spec_num_accepted_tokens=5,
                                          spec_accepted_per_pos=[3, 2, 0]))
    m.update_from_engine_stats(make_stats(spec_num_drafts=6, spec_num_draft_tokens=18, spec_num_accepted_tokens=8,
                                          spec_accepted_per_pos=[5, 2, 1]))
    assert value(m, "banyan:spec_decode_num_drafts_total") == 6
    assert value(m, "banyan:spec_decode_num_draft_tokens_total") == 18
    assert value(m, "banyan:spec_decode_num_accepted_tokens_total") == 8
    per_pos = [value(m, "banyan:spec_decode_num_accepted_tokens_per_pos_total", position=str(j)) for j in range(3)]
    assert per_pos == [5, 2, 1]


def test_finished_requests_feed_token_counters_and_histograms():
    m = ServerMetrics(MODEL)
    m.observe_request(prompt_tokens=12, generation_tokens=4, finished_reason="stop", ttft=0.03,
                      itls=[0.02, 0.02, 0.2], e2e=0.5, queue_time=0.01)
    m.observe_request(prompt_tokens=8, generation_tokens=16, finished_reason="length", ttft=0.5,
                      itls=[], e2e=3.0, queue_time=0.4)
    m.observe_request(prompt_tokens=5, generation_tokens=0, finished_reason="abort", ttft=None,
                      itls=[], e2e=0.1, queue_time=0.1)
    assert value(m, "banyan:prompt_tokens_total") == 25
    assert value(m, "banyan:generation_tokens_total") == 20
    for reason, count in [("stop", 1), ("length", 1), ("abort", 1), ("error", 0)]:
        assert value(m, "banyan:request_success_total", finished_reason=reason) == count

    assert value(m, "banyan:time_to_first_token_seconds_count") == 2
    assert value(m, "banyan:time_to_first_token_seconds_sum") == pytest.approx(0.53)
    assert value(m, "banyan:time_to_first_token_seconds_bucket", le="0.04") == 1
    assert value(m, "banyan:inter_token_latency_seconds_count") == 3
    assert value(m, "banyan:inter_token_latency_seconds_bucket", le="0.025") == 2
    assert value(m, "banyan:e2e_request_latency_seconds_count") == 3
    assert value(m, "banyan:e2e_request_latency_seconds_bucket", le="0.5") == 2
    assert value(m, "banyan:request_queue_time_seconds_sum") == pytest.approx(0.51)


def test_unknown_finished_reasons_do_not_grow_label_cardinality():
    m = ServerMetrics(MODEL)
    m.observe_request(1, 1, "weird-" + "x" * 50, 0.1, [], 0.1, 0.0)
    assert value(m, "banyan:request_success_total", finished_reason="error") == 1
    assert "weird-" not in m.render()[0].decode()
