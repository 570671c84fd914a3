"""The store kernel writes exactly what the torch backend's store writes, and nothing else."""

from __future__ import annotations

import pytest
import torch

from banyan.kernels.kv_store import store_kv
from banyan.layers.attention.base import FP8, write_kv_cache
from tests.kernels.paged_batches import DEVICE, INTERPRET, gpu, make_batch


def check_store(specs, *, page_size, num_kv_heads, head_dim, dtype=torch.float32, cache_dtype=None, kv_scale=1.0,
                seed=0):
    batch, _, k, v, k_cache, v_cache = make_batch(
        specs, page_size=page_size, num_kv_heads=num_kv_heads, group=1, head_dim=head_dim, dtype=dtype, seed=seed
    )
    k_cache, v_cache = k_cache.to(cache_dtype or dtype), v_cache.to(cache_dtype or dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_ref, v_ref, batch.slot_mapping, kv_scale)
    store_kv(k, v, k_cache, v_cache, batch.slot_mapping, kv_scale)
    if k_cache.dtype == FP8:  # the interpreter truncates below fp8's normal range: 2^-9 at most
        torch.testing.assert_close(k_cache.float(), k_ref.float(), atol=2**-9 if INTERPRET else 0, rtol=0)
        torch.testing.assert_close(v_cache.float(), v_ref.float(), atol=2**-9 if INTERPRET else 0, rtol=0)
    elif INTERPRET and k.dtype != k_cache.dtype:  # the interpreter's narrowing may round to the other neighbour
        torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=2**-7)
        torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=2**-7)
    else:
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
def test_matches_reference(page_size, num_kv_heads):
    check_store([(0, 5), (7, 1), (30, 12)], page_size=page_size, num_kv_heads=num_kv_heads, head_dim=16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision(dtype):
    check_store([(3, 9), (17, 1)], page_size=4, num_kv_heads=2, head_dim=64, dtype=dtype)


def test_casts_to_the_cache_dtype_and_odd_head_dim():
    check_store([(0, 6), (5, 3)], page_size=4, num_kv_heads=2, head_dim=40, cache_dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_scale", [1.0, 0.3])
def test_fp8_cache_quantizes_like_the_torch_store(dtype, kv_scale):
    check_store([(3, 9), (17, 1)], page_size=4, num_kv_heads=2, head_dim=16, dtype=dtype, cache_dtype=FP8,
                kv_scale=kv_scale)


def test_fp8_clamps_to_its_range():
    k = torch.tensor([[[1000.0, -1000.0, 0.5, 447.0]]], device=DEVICE)
    k_cache = torch.zeros(1, 2, 1, 4, dtype=FP8, device=DEVICE)
    store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([1], device=DEVICE))
    assert k_cache[0, 1, 0].float().tolist() == [448.0, -448.0, 0.5, 448.0]


def test_negative_slot_writes_nothing():
    k = torch.randn(2, 2, 16, device=DEVICE)
    k_cache = torch.zeros(4, 4, 2, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    store_kv(k, k, k_cache, v_cache, torch.tensor([5, -1], device=DEVICE))
    assert torch.equal(k_cache.view(-1, 2, 16)[5], k[0])
    assert k_cache.count_nonzero() == k[0].count_nonzero()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_full_size(dtype):
    specs = [(i * 97 % 2000, 1 + i * 131 % 700) for i in range(64)]
    check_store(specs, page_size=16, num_kv_heads=8, head_dim=128, dtype=dtype)
