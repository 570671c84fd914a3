"""KV pool sizing: the arithmetic with made-up GPU numbers, the profiling forward run on CPU, and the log line."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from banyan import LLM
from banyan.config import CacheConfig
from banyan.runner import model_runner
from banyan.runner.memory import GiB, KVCapacity, MemoryProfile, pages_for_budget, profile_batch
from tests.factories import write_model_dir

H200 = MemoryProfile(total=140 * GiB, weights=13 * GiB, activation_peak=2 * GiB, non_torch=1 * GiB)


def test_budget_is_what_the_model_leaves_of_the_utilization():
    assert H200.kv_budget(0.9) == int(140 * GiB * 0.9) - 16 * GiB
    assert H200.kv_budget(0.1) == 0  # the model alone needs more: never negative
    assert "= 110.00 GiB" in H200.describe(0.9)


def test_capacity_facts():
    per_token = 2 * 32 * 32 * 128 * 2  # Llama-2-7B in bf16: 512 KiB a token
    pages = pages_for_budget(H200.kv_budget(0.9), 16, per_token)
    capacity = KVCapacity(pages, 16, per_token, 4096, "bfloat16", "test")
    assert capacity.num_tokens == pages * 16 == 110 * 2048  # 110 GiB of 512 KiB tokens
    assert capacity.full_length_requests == 55.0
    line = capacity.describe()
    assert "225280 tokens (bfloat16, 110.00 GiB)" in line and "55.0 requests of the full 4096-token context" in line


def test_profile_batch_is_the_largest_step():
    fb = profile_batch(num_tokens=50, max_model_len=16, num_logits=8, page_size=4, device="cpu")
    assert fb.query_lens == fb.context_lens == [16, 16, 16, 2]
    assert fb.num_tokens == 50 and not fb.is_decode_only
    assert fb.slot_mapping.max() < 4 and fb.block_tables.eq(0).all()  # every K/V into page 0
    assert fb.logits_indices.tolist() == list(range(42, 50))
    assert fb.positions[16:32].tolist() == list(range(16))


def test_gpu_budget_comes_from_the_profile(monkeypatch):
    """The GPU branch of the runner's sizing, with a made-up profile in place of the device's."""
    monkeypatch.setattr(model_runner, "profile_cuda_forward", lambda run: H200)
    fake_runner = SimpleNamespace(device=torch.device("cuda"), profile_forward=None)
    budget, basis, param = model_runner.ModelRunner._kv_budget(fake_runner, CacheConfig(gpu_memory_utilization=0.9), 1)
    assert budget == H200.kv_budget(0.9)
    assert param == "gpu_memory_utilization" and "activation peak 2.00 GiB" in basis


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_sizing")
    write_model_dir(path, "llama", seed=0)
    return path


def test_cpu_log_reports_the_same_facts(tiny, caplog):
    with caplog.at_level(logging.INFO, logger=model_runner.__name__):
        llm = LLM(str(tiny), device="cpu", kv_cache_memory=1 << 20, block_size=4, num_threads=1)
    runner = llm.engine.runner
    tokens = runner.num_pages * 4
    assert runner.num_pages == (1 << 20) // (4 * runner.arch.kv_bytes_per_token(2))  # a CPU keeps float16 pages
    assert f"= {tokens} tokens (float16" in caplog.text
    assert f"{tokens / 512:.1f} requests of the full 512-token context fit; budget: --kv-cache-memory" in caplog.text


def test_fp8_cache_holds_four_times_the_fp32_tokens(tiny):
    fp32 = LLM(str(tiny), device="cpu", kv_cache_memory=1 << 20, block_size=4, num_threads=1,
               kv_cache_dtype="float32").engine.runner
    fp8 = LLM(str(tiny), device="cpu", kv_cache_memory=1 << 20, block_size=4, num_threads=1, kv_cache_dtype="fp8")
    assert fp8.engine.runner.num_pages == 4 * fp32.num_pages
    assert fp8.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn


def test_profiling_forward_runs_on_cpu(tiny):
    """The forward the GPU measures, at the largest step (over a one-page cache): one logits row per request."""
    runner = LLM(str(tiny), device="cpu", num_pages=8, max_num_batched_tokens=40, max_num_seqs=6,
                 max_model_len=16, num_threads=1).engine.runner
    logits = runner.profile_forward()
    assert logits.shape == (6, runner.arch.vocab_size) and logits.isfinite().all()
