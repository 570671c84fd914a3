"""The split-K decode kernel against the torch backend: one new row per request."""

from __future__ import annotations

import random

import pytest
import torch

from banyan.kernels.decode_attention import MAX_SPLITS, decode_attention, splits_for
from banyan.kernels.kv_store import store_kv
from tests.kernels.paged_batches import DEVICE, assert_matches, gpu, make_batch, poisoned, reference_attention


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


def test_a_requests_splits_follow_its_own_length():
    assert splits_for(32_000, block_n=64) == MAX_SPLITS  # capped
    assert splits_for(300, block_n=64) == 3  # about 2 tiles each
    assert splits_for(0, block_n=64) == splits_for(100, block_n=64) == 1
    with pytest.raises(ValueError, match="num_splits"):
        check_decode([5], page_size=4, num_splits=MAX_SPLITS + 1)


def test_a_requests_output_has_the_same_bits_whatever_the_batch():
    """A request's splits come from its own length and the merge always reduces over MAX_SPLITS lanes, so neither
    the other requests nor the bound that sizes the grid (a CUDA graph's is max_model_len) change its bits."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    page_size, kv_heads, group, head_dim = 4, 2, 2, 16
    k_cache, v_cache = (torch.randn(600, page_size, kv_heads, head_dim, generator=gen, device=DEVICE) for _ in "kv")
    q = torch.randn(48, kv_heads * group, head_dim, generator=gen, device=DEVICE)

    def first_row(lengths, bound):
        """Request 0 (71 keys on pages 0-17) with others of these lengths on the pages after, row 0 of the output."""
        tables, next_page = [], 0
        for length in lengths:
            pages = -(-length // page_size)
            tables.append(list(range(next_page, next_page + pages)))
            next_page += pages
        width = max(map(len, tables))
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        rows = q[: len(lengths)].contiguous()
        return decode_attention(rows, k_cache, v_cache, block_tables, seq_lens, bound, 0.25, block_n=16)[0]

    alone = first_row([71], 71)  # 3 splits of its own
    for lengths, bound in (([71], 2_000), ([71, 500, 3], 500), ([71] + [9] * 40, 71), ([71, 1_400], 4_096)):
        assert torch.equal(first_row(lengths, bound), alone), (lengths, bound)


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
