"""Prefill/extend kernel: causal attention of each request's new rows over its whole paged context.

The new K/V are already in the cache (the store runs first), so every key is read from pages:

    request i: context of c tokens, q new rows (its last q positions), prefix = c - q cached
    key position:   0 ......... prefix-1 | prefix ........ c-1
                    (cached pages)       | (new rows, just stored)
    new row j (position prefix + j) sees keys [0, prefix + j], or only (prefix + j - w, prefix + j]
    with a sliding window w.

One program per (request, query head, tile of BLOCK_M new rows); it walks the visible keys in tiles
of BLOCK_N with an online softmax (flash attention), so nothing of size [q, c] is ever built.
Query head h reads KV head h // group (GQA). Rows of a ragged batch are found from query_start_loc.

An fp8 cache holds K/V divided by kv_scale: the scale is folded into qk_scale for the scores and
multiplied into the output (o = sum p v, linear in v), so tiles are only widened, never rescaled.

Reference: `banyan.layers.attention.torch_backend.paged_attention`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # a window wider than any context: no key is ever out of it


@triton.jit
def load_kv_tile(
    k_cache_ptr, v_cache_ptr, table_ptr, kv_pos, kv_ok, kv_head, d,
    stride_cp, stride_cs, stride_ch, page_size,
    HEAD_DIM: tl.constexpr,
):
    """K and V rows [BLOCK_N, BLOCK_D] of one request's positions kv_pos (table_ptr: its block table)."""
    page = tl.load(table_ptr + kv_pos // page_size, mask=kv_ok, other=0)
    offset = page.to(tl.int64) * stride_cp + (kv_pos % page_size) * stride_cs + kv_head * stride_ch
    mask = kv_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + offset[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + offset[:, None] + d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def attend_tile(
    q, k, v, visible, m_i, l_i, acc, qk_scale,
    P_DTYPE: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """One online-softmax step: fold a tile of keys into the running max m_i, sum l_i and output acc.

    Scores are in base 2 (qk_scale holds log2 e). A row that has seen no visible key yet keeps
    m_i = -inf; its terms are computed against 0 instead, so that no inf - inf appears.
    """
    s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * qk_scale  # [rows, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    # p is rounded to the activations' dtype, as the tensor cores take it
    acc = acc * alpha[:, None] + tl.dot(p.to(P_DTYPE).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    block_tables_ptr, query_start_ptr, seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e) * k scale: the softmax runs in base 2
    v_scale,  # an fp8 cache's scale (1.0 otherwise)
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cp, stride_cs, stride_ch, stride_bt,
    page_size, window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx = tl.load(seq_lens_ptr + seq)
        prefix = ctx - q_len
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] new-row index within the request
        q_pos = prefix + rows
        d = tl.arange(0, BLOCK_D)
        row_mask = (rows < q_len)[:, None] & (d < HEAD_DIM)[None, :]
        q_ptrs = q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_ptrs, mask=row_mask, other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

        kv_head = head // GROUP
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 logits)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # keys visible to any row of this tile: [lo, hi)
        hi = tl.minimum(ctx, prefix + (tile + 1) * BLOCK_M)
        lo = tl.maximum(0, prefix + tile * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N
        for start in range(lo, hi, BLOCK_N):
            kv_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
            kv_ok = kv_pos < hi
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_pos, kv_ok, kv_head, d,
                                stride_cp, stride_cs, stride_ch, page_size, HEAD_DIM)
            visible = (
                kv_ok[None, :] & (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] > q_pos[:, None] - window)
            )  # [BLOCK_M, BLOCK_N]
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale,
                                        q_ptr.dtype.element_ty, DOT_DTYPE, PRECISION)

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
        o_ptrs = out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_query_len: int,  # host copy: the launch grid never waits on the device
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    kv_scale: float = 1.0,  # an fp8 cache's scale
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_attention_inputs(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = max(16, min(block_m, triton.next_power_of_2(max_query_len)))
    grid = (num_seqs, num_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out,
        block_tables, query_start_loc, seq_lens,
        scale * LOG2E * kv_scale, kv_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1], NO_WINDOW if sliding_window is None else sliding_window,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        **dot_types(q.dtype),
    )
    return out


def dot_types(dtype: torch.dtype) -> dict:
    """Operand type and precision of the kernels' tl.dot for activations of `dtype`.

    fp32 gets exact fp32 products (not TF32), so fp32 runs match the torch reference; fp16/bf16 get
    the default (tensor-core products, fp32 accumulation). The CPU interpreter has no bf16 arithmetic
    (triton-lang/triton#11584: its tl.dot multiplies the raw bits), so there bf16 operands are widened
    to fp32 after the same rounding as on a GPU.
    """
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        dtype = torch.float32
    dot_dtype = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]
    return dict(DOT_DTYPE=dot_dtype, PRECISION="ieee" if dtype == torch.float32 else None)


def check_attention_inputs(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim) -> None:
    if k_cache.shape != v_cache.shape or k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.stride(-1) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attention kernels need q with a contiguous last dim and contiguous caches")
