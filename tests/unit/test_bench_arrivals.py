"""Serving-style load on an in-process engine (banyan.bench.arrivals) and `banyan bench speculative --request-rate`."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from banyan.bench.arrivals import poisson_offsets, run_arrivals
from banyan.bench.workloads import random_prompts
from banyan.cli import main
from banyan.frontend.llm import LLM
from tests.factories import write_model_dir

TINY_ENGINE = ["--num-threads", "1", "--block-size", "4", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_arrivals")
    write_model_dir(path, "llama", seed=5)
    return path


def test_poisson_offsets_are_seeded_exponential_gaps_from_zero():
    offsets = poisson_offsets(4000, request_rate=5.0, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert offsets[0] == 0.0 and all(gap >= 0 for gap in gaps)
    assert offsets == poisson_offsets(4000, request_rate=5.0, seed=3) != poisson_offsets(4000, 5.0, seed=4)
    assert statistics.fmean(gaps) == pytest.approx(1 / 5.0, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 5.0, rel=0.1)  # exponential: sd = mean


def test_infinite_rate_sends_everything_at_once_and_a_rate_must_be_positive():
    assert poisson_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="request_rate"):
        poisson_offsets(3, 0.0)


def test_each_request_arrives_at_its_offset_and_is_timed_from_there(model_dir):
    llm = LLM(str(model_dir), num_threads=1, kv_cache_memory=16 << 20, max_model_len=256)
    try:
        prompts = random_prompts(3, 8, 5, llm.engine.arch.vocab_size, seed=1)
        timings, duration = run_arrivals(llm.engine, prompts, [0.0, 0.2, 0.4], temperature=0.0)
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.engine.close()
    assert all(t.success and t.output_tokens == 5 and t.prompt_tokens == 8 for t in timings)
    assert all(0 < t.ttft <= t.e2el and len(t.itl) == 4 for t in timings)
    assert duration >= 0.4 + timings[2].e2el * 0.99  # the last one was not sent before its time


def test_speculative_cli_with_arrivals_reports_latency_beside_throughput(model_dir, tmp_path):
    out = tmp_path / "speculative.json"
    argv = ["bench", "speculative", "--model", str(model_dir), *TINY_ENGINE, "--workload", "mixed", "--num-prompts", "4",
            "--output-len", "6", "--copy-sentences", "2", "--input-len", "12", "--rounds", "1", "--methods", "ngram",
            "--policies", "adaptive,fixed", "--request-rate", "50", "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert list(results) == ["off", "ngram-adaptive", "ngram-fixed"]
    assert report["config"]["bench"]["request_rate"] == "50.0"
    assert results["off"]["ratio"] == results["off"]["e2el_ratio"] == results["off"]["cpu_ratio"] == 1.0
    for label, r in results.items():
        assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] == 4 * 6, label
        assert r["e2el_ms"]["p99"] >= r["e2el_ms"]["median"] > 0 and r["tpot_ms"]["mean"] > 0, label
        assert 0 < r["cpu_s"] and r["output_per_cpu_s"] > 0, label
