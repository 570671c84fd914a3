"""Store kernel: write each new row's K/V into its slot of the paged cache.

    cache:  [num_pages, page_size, num_kv_heads, head_dim]; slot s = page * page_size + offset
    row t of k/v  ──►  k_cache[s // page_size, s % page_size] with s = slot_mapping[t]
    a negative slot means "padding row, write nothing" (for fixed-size batches)
    an fp8 cache stores clamp(row / kv_scale, -448, 448) rounded to float8_e4m3fn (no infinity to overflow to)

Reference: `banyan.layers.attention.base.write_kv_cache` (the torch backend's store).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # new rows: [num_tokens, num_kv_heads, head_dim]
    stride_cp, stride_cs, stride_ch,  # caches (same strides for k and v): [pages, page_size, heads, dim]
    page_size, inv_kv_scale,
    QUANTIZE: tl.constexpr,  # the cache is fp8: scale by 1 / kv_scale and clamp to its range
    FP8_MAX: tl.constexpr,
    PREROUND: tl.constexpr,  # the CPU interpreter: round to fp8's precision before its faulty narrowing
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
        dst = (slot // page_size) * stride_cp + (slot % page_size) * stride_cs + h * stride_ch + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        if QUANTIZE:
            k = tl.minimum(tl.maximum(k.to(tl.float32) * inv_kv_scale, -FP8_MAX), FP8_MAX)
            v = tl.minimum(tl.maximum(v.to(tl.float32) * inv_kv_scale, -FP8_MAX), FP8_MAX)
            if PREROUND:
                k, v = _round_to_e4m3(k), _round_to_e4m3(v)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _round_to_e4m3(x):
    """fp32 rounded (to nearest even) to e4m3's grid: 3 mantissa bits carrying into the exponent, and below its
    normal range (2^-6) multiples of its subnormal step 2^-9.

    Triton's interpreter narrows by adding the round bit to the mantissa without that carry
    (0.49 becomes 0.25, not 0.5), and truncates below the normal range; a value already on the fp8 grid narrows
    exactly. The GPU converts in hardware and skips this. The subnormal step comes from a sum: near 1.5 * 2^14
    fp32's own step is 2^-9, so adding and taking that away rounds to it, to nearest even.
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, bits.to(tl.float32, bitcast=True))


def store_kv(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64 (or int32); < 0 skips the row
    kv_scale: float = 1.0,  # an fp8 cache's scale
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("store_kv needs rows with a contiguous last dim and contiguous caches")
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], 1.0 / kv_scale,  # a product rounds the same in torch and triton (a quotient may not)
        QUANTIZE=k_cache.dtype == torch.float8_e4m3fn,
        FP8_MAX=torch.finfo(torch.float8_e4m3fn).max,
        PREROUND=os.environ.get("TRITON_INTERPRET") == "1",
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
