"""The server's memory estimate counts every process a parallel model starts on this host."""

from __future__ import annotations

from pathlib import Path

from banyan.config import CacheConfig, EngineConfig, ModelArch, ParallelConfig
from banyan.server.model_memory import estimate_memory

ARCH = ModelArch("LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def estimate(tmp_path: Path, tp: int = 1, dp: int = 1, pp: int = 1, replicas_on_host: int | None = None):
    parallel = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp,
                              replicas_on_host=replicas_on_host)
    config = EngineConfig(cache=CacheConfig(kv_cache_memory=1 << 20), parallel=parallel)
    return estimate_memory(config, ARCH, tmp_path, on_gpu=False)


def test_replicas_multiply_everything_and_ranks_their_kv_and_processes(tmp_path: Path):
    one, tp2, dp2 = estimate(tmp_path), estimate(tmp_path, tp=2), estimate(tmp_path, tp=2, dp=2)
    assert tp2.weights == one.weights and tp2.kv_cache == 2 * one.kv_cache and tp2.process == 2 * one.process
    assert dp2.total == 2 * tp2.total
    pp2, both = estimate(tmp_path, pp=2), estimate(tmp_path, tp=2, pp=2)  # a stage is a process with its own pool
    assert pp2 == tp2 and both.kv_cache == 4 * one.kv_cache and both.process == 4 * one.process


def test_only_the_replicas_ray_may_put_on_this_host_count(tmp_path: Path):
    """--data-parallel-backend ray: the server counts the most replicas one node may hold (replicas_on_host, which
    the cores' KV sizing uses too), not all of them."""
    spread = estimate(tmp_path, dp=4, replicas_on_host=1)
    assert spread == estimate(tmp_path) and estimate(tmp_path, dp=4, replicas_on_host=2).total == 2 * spread.total
