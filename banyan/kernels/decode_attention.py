"""Decode kernel: one query row per request over its paged context, split along the context (split-K).

A decode step has few rows, so one program per (request, head) would leave most of a GPU idle on
long contexts. The visible keys of each request are cut into S spans, one program each; each writes a
partial output and its log-sum-exp, and a reduce step merges them:

    visible keys [lo, c)   (lo = 0, or c - w with a sliding window w)
    split:         |   0   |   1   |  ...  | S-1 |      span = ceil((c - lo) / S), rounded up to BLOCK_N
    partial:       o_0, lse_0   o_1, lse_1  ...         (an empty span writes lse = -inf)
    merge:         o = sum_s 2^(lse_s - m) o_s / sum_s 2^(lse_s - m),   m = max_s lse_s

S is the request's own: splits_for(c - lo), about two key tiles a split up to MAX_SPLITS, and the merge
always reduces over MAX_SPLITS lanes (the empty ones weigh 0). So a request's output has the same bits
whatever else is in the batch and whatever bound on the lengths sizes the grid: a CUDA graph (its grid as
wide as max_model_len, its batch padded to a bucket) replays what an eager step computes. (Splits chosen
from the batch, fewer as the grid filled, made greedy outputs of graphs and eager steps part in float32
beyond 128 tokens.) The grid has splits_for(the longest visible length) programs a (request, KV head);
those past a request's own S exit at once. A test may fix S for every request (num_splits).

A program serves all query heads of one KV head (GQA): the group's rows share each K/V tile load.

Reference: `banyan.layers.attention.torch_backend.paged_attention` with query_lens all 1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from banyan.kernels.prefill_attention import (
    LOG2E,
    NO_WINDOW,
    attend_tile,
    check_attention_inputs,
    dot_types,
    load_kv_tile,
)

MAX_SPLITS = 32
SPLIT_TILES = 2  # key tiles a split covers at least, where the request has that many


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    part_out_ptr, part_lse_ptr,  # [num_seqs, num_heads, num_splits, BLOCK_D], [num_seqs, num_heads, num_splits] fp32
    qk_scale, v_scale,  # see prefill_attention: an fp8 cache's scale is folded into both
    stride_qt, stride_qh,
    stride_cp, stride_cs, stride_ch, stride_bt,
    page_size, window, num_splits, split_keys,  # split_keys > 0: each request's own splits, one per split_keys
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq)
    lo = tl.maximum(0, ctx - window)
    own = tl.minimum(num_splits, tl.maximum(1, tl.cdiv(ctx - lo, tl.maximum(split_keys, 1))))  # splits_for's count
    splits = tl.where(split_keys > 0, own, num_splits)
    span = tl.cdiv(tl.cdiv(ctx - lo, splits), BLOCK_N) * BLOCK_N
    split_lo = lo + split * span
    split_hi = tl.minimum(ctx, split_lo + span)

    g = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + g  # [BLOCK_G] query heads of this KV head
    d = tl.arange(0, BLOCK_D)
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(split_lo, split_hi, BLOCK_N):
        kv_pos = start + tl.arange(0, BLOCK_N)
        kv_ok = kv_pos < split_hi
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, kv_pos, kv_ok, kv_head, d,
                            stride_cp, stride_cs, stride_ch, page_size, HEAD_DIM)
        m_i, l_i, acc = attend_tile(q, k, v, kv_ok[None, :], m_i, l_i, acc, qk_scale,
                                    q_ptr.dtype.element_ty, DOT_DTYPE, PRECISION)

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale
    lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BLOCK_G] flat (seq, head, split)
    tl.store(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], out, mask=(g < GROUP)[:, None])
    tl.store(part_lse_ptr + part, lse, mask=g < GROUP)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    part = (seq * tl.num_programs(1) + head) * num_splits + tl.arange(0, BLOCK_S)  # [BLOCK_S]
    s_ok = tl.arange(0, BLOCK_S) < num_splits
    lse = tl.load(part_lse_ptr + part, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # a request with no keys at all (a padding row): output 0
    w = tl.math.exp2(lse - m)  # [BLOCK_S], 0 for empty splits
    d = tl.arange(0, BLOCK_D)
    o = tl.load(part_out_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]: one new row per request
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    max_seq_len: int,  # host bound on seq_lens (a block table's width in tokens will do): sizes the split grid
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    kv_scale: float = 1.0,  # an fp8 cache's scale
    num_splits: int | None = None,  # every request cut into this many spans (tests); None: each its own (splits_for)
    block_n: int = 64,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_attention_inputs(q, k_cache, v_cache, num_heads, num_kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if num_seqs == 0:
        return out
    visible = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window)
    split_keys = 0 if num_splits is not None else SPLIT_TILES * block_n
    if num_splits is None:
        num_splits = splits_for(visible, block_n)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out = torch.empty(num_seqs, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    group = num_heads // num_kv_heads
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        part_out, part_lse,
        scale * LOG2E * kv_scale, kv_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_cache.shape[1], NO_WINDOW if sliding_window is None else sliding_window, num_splits, split_keys,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        **dot_types(q.dtype),
    )
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out,
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=MAX_SPLITS,  # one reduction shape for every grid: the merge's order never depends on the batch
        BLOCK_D=block_d,
    )
    return out


def splits_for(visible_keys: int, block_n: int) -> int:
    """The spans a request with this many visible keys is cut into: about SPLIT_TILES key tiles each, at most
    MAX_SPLITS (the kernel computes the same per request from its own length)."""
    return max(1, min(triton.cdiv(visible_keys, SPLIT_TILES * block_n), MAX_SPLITS))
