"""`banyan bench`: the latency math on synthetic timings, and each bench run small on a tiny model."""

from __future__ import annotations

import json

import pytest

from banyan.bench.metrics import RequestTiming, meets_slos, parse_goodput, percentile, summarize
from banyan.bench.workloads import random_prompts, shared_prefix_prompts
from banyan.cli import main
from tests.factories import write_model_dir
from tests.server_process import start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bench")
    write_model_dir(path, "llama", seed=5)
    return path


TINY_ENGINE = ["--num-threads", "1", "--block-size", "4", "--kv-cache-memory", "16MiB", "--max-model-len", "256"]


# -- metric math ----------------------------------------------------------------------------------
def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0, 5.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_tpot_excludes_the_first_token():
    timing = RequestTiming(success=True, output_tokens=11, ttft=0.5, e2el=1.5, itl=[0.1] * 10)
    assert timing.tpot == pytest.approx(0.1)
    assert RequestTiming(success=True, output_tokens=1, ttft=0.5, e2el=0.5).tpot is None


def test_summary_distributions_and_goodput():
    fast = RequestTiming(success=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2el=0.3, itl=[0.05] * 4)
    slow = RequestTiming(success=True, prompt_tokens=10, output_tokens=5, ttft=0.9, e2el=1.3, itl=[0.1] * 4)
    failed = RequestTiming(success=False, error="HTTP 500")
    summary = summarize([fast, slow, failed], duration=2.0, slos=parse_goodput(["ttft:500", "tpot:60"]))
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["output_throughput"] == 5.0  # 10 tokens / 2 s
    assert summary["ttft_ms"]["mean"] == pytest.approx(500.0)
    assert summary["ttft_ms"]["median"] == pytest.approx(500.0)
    assert summary["tpot_ms"]["p99"] == pytest.approx(99.5)  # tpots 50 and 100 ms
    assert summary["itl_ms"]["mean"] == pytest.approx(75.0)
    assert summary["goodput"] == 0.5  # only `fast` meets both SLOs: 1 request / 2 s
    assert not meets_slos(failed, {})


def test_goodput_spec_is_checked():
    with pytest.raises(ValueError):
        parse_goodput(["latency:5"])


def test_shared_prefix_groups_share_their_system_prompt():
    prompts = shared_prefix_prompts(2, 3, system_len=16, question_len=4, output_len=2, vocab_size=100)
    assert len(prompts) == 6 and all(len(p.prompt_token_ids) == 20 for p in prompts)
    groups = {tuple(p.prompt_token_ids[:16]) for p in prompts}
    assert len(groups) == 2
    assert len({tuple(p.prompt_token_ids) for p in random_prompts(4, 8, 2, 100)}) == 4


# -- the benches, small ---------------------------------------------------------------------------
def test_overhead_reports_positive_tokens_per_second(model_dir, tmp_path, capsys):
    out = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--model", str(model_dir), *TINY_ENGINE, "--batch-size", "8", "--input-len", "4",
            "--output-len", "3", "--no-progress", "--output-json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert report["schema_version"] == 1 and report["bench"] == "overhead"
    assert report["results"]["total_output_tokens"] == 24
    assert report["results"]["output_throughput"] > 0
    assert "| output_throughput |" in capsys.readouterr().out


def test_throughput_cli_on_a_tiny_model(model_dir, tmp_path):
    out = tmp_path / "throughput.json"
    argv = ["bench", "throughput", "--model", str(model_dir), *TINY_ENGINE, "--input-len", "8", "--output-len", "4",
            "--num-prompts", "4", "--no-progress", "--output-json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["total_input_tokens"] == 32 and results["total_output_tokens"] == 16
    assert results["request_throughput"] > 0 and results["peak_rss_bytes"] > 0


def test_latency_cli_on_a_tiny_model(model_dir, tmp_path):
    out = tmp_path / "latency.json"
    argv = ["bench", "latency", "--model", str(model_dir), *TINY_ENGINE, "--input-len", "8", "--output-len", "4",
            "--num-iters", "1", "--output-json", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert results["ttft_ms"]["mean"] > 0 and results["decode_tokens_per_s"]["mean"] > 0


def test_serve_against_a_real_server(model_dir, tmp_path):
    server = start_server(model_dir, "--kv-cache-memory", "16MiB", "--max-model-len", "256")
    try:
        out = tmp_path / "serve.json"
        argv = ["bench", "serve", "--base-url", server.base_url, "--vocab-size", "300", "--input-len", "8",
                "--output-len", "4", "--num-prompts", "4", "--concurrency", "2", "--goodput", "ttft:60000",
                "--output-json", str(out)]
        assert main(argv) == 0, server.log()
        results = json.loads(out.read_text())["results"]
    finally:
        server.stop()
    assert results["failed"] == 0 and results["completed"] == 4, results["errors"]
    assert results["total_output_tokens"] == 16  # from the server's usage
    assert results["ttft_ms"]["p99"] > 0 and results["goodput"] > 0
