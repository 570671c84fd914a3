"""The prefill kernel against the torch backend on random ragged batches with cached prefixes."""

from __future__ import annotations

import random

import pytest
import torch

from banyan.kernels.kv_store import store_kv
from banyan.kernels.prefill_attention import prefill_attention
from tests.kernels.paged_batches import assert_matches, gpu, make_batch, poisoned, random_specs, reference_attention


def check_prefill(specs, *, page_size, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
                  sliding_window=None, seed=0, **blocks):
    batch, q, k, v, k_cache, v_cache = make_batch(
        specs, page_size=page_size, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, dtype=dtype, seed=seed
    )
    scale = head_dim**-0.5
    expected, _, _ = reference_attention(q, k, v, k_cache, v_cache, batch, scale, sliding_window)
    store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    out = prefill_attention(
        q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens, batch.max_query_len,
        scale, sliding_window, out=poisoned(q), **blocks,
    )
    assert_matches(out, expected)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_random_ragged_batches(page_size, group):
    specs = random_specs(random.Random(page_size * 10 + group), 4, max_prefix=40, max_new=20)
    check_prefill(specs, page_size=page_size, group=group, seed=group, block_m=16, block_n=16)


def test_edge_cases():
    # a lone first token, one-row chunks after a prefix, and a chunk ending exactly on a page edge
    check_prefill([(0, 1)], page_size=4, num_kv_heads=1, group=4)
    check_prefill([(5, 1), (0, 8), (3, 5), (40, 1)], page_size=4, block_m=16, block_n=16)


def test_long_context():
    check_prefill([(300, 40), (0, 3)], page_size=16, group=2, block_m=16, block_n=32)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_head_dims(head_dim):
    check_prefill([(9, 7), (0, 18)], page_size=16, head_dim=head_dim)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    check_prefill([(20, 13), (0, 30), (33, 1)], page_size=4, group=4, head_dim=64, dtype=dtype, block_m=16, block_n=16)


def test_sliding_window():
    specs = [(30, 1), (0, 20), (12, 9), (3, 1), (70, 24)]
    check_prefill(specs, page_size=4, sliding_window=7, block_m=16, block_n=16)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_full_size(dtype, group):
    specs = random_specs(random.Random(group), 24, max_prefix=2048, max_new=512)
    check_prefill(specs, page_size=16, num_kv_heads=8 // group * 2, group=group, head_dim=128, dtype=dtype, seed=group)


@gpu
def test_full_size_sliding_window():
    specs = random_specs(random.Random(7), 16, max_prefix=4096, max_new=300)
    check_prefill(specs, page_size=16, num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16, sliding_window=1024)
