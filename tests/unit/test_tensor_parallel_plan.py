"""Tensor-parallel sharding arithmetic (no processes): which sizes split, which slice each rank reads, and the
frame a forward travels in."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from banyan.config import ModelArch, ParallelConfig
from banyan.distributed.pipeline import (
    MIN_MICRO_BATCH_TOKENS,
    check_stages,
    micro_batch_bounds,
    micro_batch_count,
    split,
    stage_ranges,
)
from banyan.distributed.tensor_parallel import ShardPlan, WeightShard, check_sizes, shard_arch
from banyan.errors import InvalidParameterError
from banyan.forward_batch import ForwardBatch
from banyan.quantization.formats import Int4Weight, Int8Weight
from banyan.runner.worker import decode_step, encode_step, encode_stop

SMOLLM2 = ModelArch("LlamaForCausalLM", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def test_the_default_model_splits_three_ways_only():
    check_sizes(SMOLLM2, 3)
    with pytest.raises(InvalidParameterError, match="tensor_parallel_size: 2 does not divide the model's 9 attention"):
        check_sizes(SMOLLM2, 2)
    with pytest.raises(InvalidParameterError, match="9 does not divide the model's intermediate size of 1536"):
        check_sizes(SMOLLM2, 9)  # the heads would split (3 KV heads, each on 3 ranks), the MLP not


def test_kv_heads_that_neither_split_nor_replicate_are_refused():
    arch = dataclasses.replace(SMOLLM2, num_attention_heads=12, num_key_value_heads=4, intermediate_size=48)
    with pytest.raises(InvalidParameterError, match="6 and the model's 4 KV heads: one must divide the other"):
        check_sizes(arch, 6)


def test_kv_heads_are_split_or_replicated():
    arch = dataclasses.replace(SMOLLM2, num_attention_heads=8, num_key_value_heads=2, intermediate_size=64)
    D = arch.head_dim
    # 2 ranks: one KV head each; 8 ranks: each KV head on the 4 ranks holding its query heads
    assert [ShardPlan(arch, 2, r)("model.layers.0.self_attn.k_proj.weight").start for r in range(2)] == [0, D]
    starts = [ShardPlan(arch, 8, r)("model.layers.0.self_attn.v_proj.weight").start // D for r in range(8)]
    assert starts == [0, 0, 0, 0, 1, 1, 1, 1]
    assert shard_arch(arch, 8).num_key_value_heads == 1
    q = ShardPlan(arch, 8, 5)("model.layers.3.self_attn.q_proj.weight")
    assert (q.dim, q.start, q.stop) == (0, 5 * D, 6 * D)


def test_row_parallel_layers_split_their_inputs_and_keep_one_bias():
    plan = ShardPlan(SMOLLM2, 3, 1)
    o = plan("model.layers.0.self_attn.o_proj.weight")
    assert (o.dim, o.start, o.stop) == (1, 3 * 64, 6 * 64)
    down = plan("model.layers.0.mlp.down_proj.weight")
    assert (down.dim, down.start, down.stop) == (1, 512, 1024)
    assert plan("model.layers.0.mlp.down_proj.bias").zero
    assert ShardPlan(SMOLLM2, 3, 0)("model.layers.0.mlp.down_proj.bias") is None
    assert plan("model.layers.0.input_layernorm.weight") is None
    assert ShardPlan(SMOLLM2, 1, 0)("model.layers.0.self_attn.q_proj.weight") is None


def test_the_last_vocabulary_shard_is_zero_padded():
    arch = dataclasses.replace(SMOLLM2, vocab_size=10)
    shards = [ShardPlan(arch, 4, r)("lm_head.weight") for r in range(4)]
    weight = torch.arange(10.0)[:, None].expand(10, 2)
    parts = [s.take(weight) for s in shards]
    assert all(p.shape == (3, 2) for p in parts)
    assert torch.equal(torch.cat(parts)[:10], weight) and not torch.cat(parts)[10:].any()
    assert WeightShard(0, zero=True).take(torch.ones(4)).eq(0).all()


def test_a_forward_travels_as_one_frame():
    fb = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([0, 1, 2, 9]),
        slot_mapping=torch.tensor([40, 41, 42, 13]), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([3, 10], dtype=torch.int32),
        block_tables=torch.tensor([[10, 0, 0], [1, 2, 3]], dtype=torch.int32), logits_indices=torch.tensor([2, 3]),
        query_lens=[3, 1], context_lens=[3, 10], page_size=4)
    got = decode_step(encode_step(fb), torch.device("cpu"))
    for f in dataclasses.fields(ForwardBatch):
        a, b = getattr(got, f.name), getattr(fb, f.name)
        assert torch.equal(a, b) and a.dtype == b.dtype if isinstance(b, torch.Tensor) else a == b, f.name
    assert decode_step(encode_stop(), torch.device("cpu")) is None


def test_stages_are_contiguous_and_balanced():
    assert [list(r) for r in stage_ranges(5, 3)] == [[0, 1], [2, 3], [4]]
    assert [len(r) for r in stage_ranges(30, 4)] == [8, 8, 7, 7]
    with pytest.raises(InvalidParameterError, match="3 stages for the model's 2 layers"):
        check_stages(dataclasses.replace(SMOLLM2, num_hidden_layers=2), 3)


def test_micro_batches_cut_whole_requests_of_about_equal_tokens():
    assert micro_batch_bounds([1, 1, 1, 1], 2) == [0, 2, 4]
    assert micro_batch_bounds([30, 1, 1, 1], 2) == [0, 1, 4]
    assert micro_batch_bounds([5], 2) == [0, 1]
    assert micro_batch_bounds([2, 2, 2, 2, 2, 2], 3) == [0, 2, 4, 6]  # --pipeline-micro-batches 3 on two stages


def test_a_step_is_cut_in_one_micro_batch_per_stage_only_when_each_gets_enough_tokens():
    assert micro_batch_count(1024, 8, stages=2) == 2  # prefill: stage 1 runs the first half while stage 0 the second
    assert micro_batch_count(16, 16, stages=2) == 1  # decode: one micro-batch costs about what the whole batch does
    assert micro_batch_count(2 * MIN_MICRO_BATCH_TOKENS, 2, stages=3) == 2
    assert micro_batch_count(16, 16, stages=2, requested=3) == 3  # --pipeline-micro-batches
    assert micro_batch_count(1024, 1, stages=2) == 1  # one request: whole requests only
    assert micro_batch_count(1024, 2, stages=2, requested=3) == 2  # never more than the requests
    with pytest.raises(InvalidParameterError, match="pipeline_micro_batches: must be >= 1, got 0"):
        ParallelConfig(pipeline_parallel_size=2, pipeline_micro_batches=0)
    fb = decode_step(encode_step(ForwardBatch(
        input_ids=torch.tensor([5, 6, 7, 8]), positions=torch.tensor([0, 1, 2, 9]),
        slot_mapping=torch.tensor([40, 41, 42, 13]), query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([3, 10], dtype=torch.int32),
        block_tables=torch.tensor([[10, 0, 0], [1, 2, 3]], dtype=torch.int32), logits_indices=torch.tensor([2, 3]),
        query_lens=[3, 1], context_lens=[3, 10], page_size=4)), torch.device("cpu"))
    second = split(fb, 1, 2)
    assert second.input_ids.tolist() == [8] and second.query_start_loc.tolist() == [0, 1]
    assert second.block_tables.tolist() == [[1, 2, 3]] and second.context_lens == [10] and second.query_lens == [1]


def test_compact_weights_split_by_rows_and_by_whole_groups():
    w = torch.randn(6, 64)
    int4, int8 = Int4Weight.quantize(w, 32), Int8Weight.quantize(w)
    for q in (int4, int8):
        full = q.dequantize()
        assert torch.equal(WeightShard(1, 32, 64, 32).take(q).dequantize(), full[:, 32:64])
        rows = WeightShard(0, 4, 8, 4).take(q).dequantize()  # the last vocabulary shard: 2 rows, 2 of padding
        assert torch.equal(rows[:2], full[4:6]) and not rows[2:].any()
    with pytest.raises(ValueError, match="32-input groups"):
        WeightShard(1, 16, 48, 32).take(int4)
