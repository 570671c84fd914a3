"""Per-token fp8 quantization of a linear layer's input, in one kernel: fp8 weights' activations on CUDA.

    scale[t] = max(max_i |x[t, i]|, 1e-12) / 448            (float32, one per row)
    q[t, i]  = clamp(x[t, i] / scale[t], -448, 448) rounded to float8_e4m3fn

The torch ops for the same (abs, amax, clamp, two divisions, clamp, cast) are about eight kernels a linear layer;
at batch 1 each is a few microseconds of a GPU doing almost nothing, four linear layers a decoder layer. On an H200
the 7B shape's fp8 decode step took 8.4 ms against bf16's 6.7 (benchmarks/README.md), though it reads half the bytes.
One program per row: a pass for the row's maximum, a pass that scales, rounds and stores.

Reference: `banyan.quantization.linear.per_token_fp8_reference`; the same bits (IEEE quotients: div_rn).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from banyan.kernels.kv_store import _round_to_e4m3

MIN_AMAX = 1e-12  # a row of zeros keeps a positive scale (as the reference's clamp)
BLOCK = 1024


@triton.jit
def _per_token_fp8_kernel(
    x_ptr, q_ptr, scale_ptr,
    cols, stride_x, stride_q,
    FP8_MAX: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    PREROUND: tl.constexpr,  # the CPU interpreter: round to fp8's precision before its faulty narrowing (kv_store)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, cols, BLOCK):
        i = start + offsets
        x = tl.load(x_ptr + row * stride_x + i, mask=i < cols, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), MIN_AMAX), FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        i = start + offsets
        x = tl.load(x_ptr + row * stride_x + i, mask=i < cols, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        if PREROUND:
            q = _round_to_e4m3(q)
        tl.store(q_ptr + row * stride_q + i, q.to(q_ptr.dtype.element_ty), mask=i < cols)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] (a contiguous last dim) -> (float8_e4m3fn [rows, cols], float32 scales [rows, 1])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"per_token_fp8 needs [rows, cols] with a contiguous last dim, got {tuple(x.shape)}")
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _per_token_fp8_kernel[(rows,)](
            x, q, scale, cols, x.stride(0), q.stride(0),
            FP8_MAX=torch.finfo(torch.float8_e4m3fn).max, MIN_AMAX=MIN_AMAX,
            PREROUND=os.environ.get("TRITON_INTERPRET") == "1",
            BLOCK=min(BLOCK, triton.next_power_of_2(max(cols, 16))),
        )
    return q, scale
