"""The split-K decode kernel against the torch backend: one new row per request."""

from __future__ import annotations

import random

import pytest
import torch

from banyan.kernels.decode_attention import choose_num_splits, decode_attention
from banyan.kernels.kv_store import store_kv
from tests.kernels.paged_batches import assert_matches, gpu, make_batch, poisoned, reference_attention


def check_decode(prefixes, *, page_size, num_kv_heads=2, group=2, head_dim=16, dtype=torch.float32,
                 sliding_window=None, seed=0, **launch):
    batch, q, k, v, k_cache, v_cache = make_batch(
        [(p, 1) for p in prefixes], page_size=page_size, num_kv_heads=num_kv_heads, group=group,
        head_dim=head_dim, dtype=dtype, seed=seed,
    )
    scale = head_dim**-0.5
    expected, _, _ = reference_attention(q, k, v, k_cache, v_cache, batch, scale, sliding_window)
    store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
    out = decode_attention(
        q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.max_context_len, scale, sliding_window,
        out=poisoned(q), **launch,
    )
    assert_matches(out, expected)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_random_batches(page_size, group):
    rng = random.Random(page_size * 10 + group)
    check_decode([rng.randint(0, 60) for _ in range(4)], page_size=page_size, group=group, seed=group, block_n=16)


@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_splits_agree(num_splits):
    # 7 splits of a 40-token context leave some splits empty: their partials must weigh nothing
    check_decode([39, 0, 12], page_size=4, num_splits=num_splits, block_n=16)


def test_long_context():
    check_decode([400, 5], page_size=16, group=4, block_n=32)  # splits chosen by the heuristic


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    check_decode([50, 3, 17], page_size=16, group=4, head_dim=64, dtype=dtype, num_splits=2, block_n=16)


def test_head_dim_128_and_sliding_window():
    check_decode([60, 4, 33], page_size=4, head_dim=128, sliding_window=9, num_splits=2, block_n=16)


def test_num_splits_fill_the_grid_but_keep_work_per_split():
    assert choose_num_splits(num_programs=8, max_keys=32_000, block_n=64) == 32  # capped
    assert choose_num_splits(num_programs=8, max_keys=300, block_n=64) == 3  # >= 2 tiles each
    assert choose_num_splits(num_programs=2048, max_keys=32_000, block_n=64) == 1  # grid already full


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_full_size(dtype, group):
    rng = random.Random(group)
    prefixes = [rng.randint(0, 4096) for _ in range(128)]
    check_decode(prefixes, page_size=16, num_kv_heads=16 // group, group=group, head_dim=128, dtype=dtype, seed=group)


@gpu
def test_full_size_few_long_requests():
    check_decode([32_000, 17_000], page_size=16, num_kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16)
