"""The server's memory estimate counts every process a parallel model starts."""

from __future__ import annotations

from pathlib import Path

from banyan.config import CacheConfig, EngineConfig, ModelArch, ParallelConfig
from banyan.server.model_memory import estimate_memory

ARCH = ModelArch("LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_replicas_multiply_everything_and_ranks_their_kv_and_processes(tmp_path: Path):
    def estimate(tp: int, dp: int):
        config = EngineConfig(cache=CacheConfig(kv_cache_memory=1 << 20),
                              parallel=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=dp))
        return estimate_memory(config, ARCH, tmp_path, on_gpu=False)

    one, tp2, dp2 = estimate(1, 1), estimate(2, 1), estimate(2, 2)
    assert tp2.weights == one.weights and tp2.kv_cache == 2 * one.kv_cache and tp2.process == 2 * one.process
    assert dp2.total == 2 * tp2.total
