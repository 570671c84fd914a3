"""Greedy sampling's argmax on AVX2 CPUs (cpu_argmax.c, built into cpu_gemv's library).

At batch 256 the step's logits are 256 x 49,152 float32, 50 MB: more than the L3, so an all-greedy step's
sampler is one memory-bound pass. The kernel reads every logit once, its rows split over the threads, and
answers what `torch.argmax(x, dim=-1)` answers, bit for bit (first index of the max, NaN the max);
tests/unit/test_sampler.py checks it against torch on ties, NaN and -inf rows.

`argmax_rows(x)` takes the kernel where `argmax_for(x)` has one: not off CPU, for other dtypes than float32,
without AVX2 or a compiler, or with BANYAN_DISABLE_CPU_KERNELS=1; there torch (on the CPU in blocks: a block
max, then the argmax inside the best block, since torch's CPU argmax is several times slower than its max).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from banyan.kernels import cpu_gemv

BLOCK = 128
"""Tokens per block of the torch fallback on the CPU."""


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of x [rows, n]: the first index of each row's max, a NaN counting as the max."""
    kernel = argmax_for(x)
    return kernel(x) if kernel is not None else argmax_in_blocks(x)


def argmax_in_blocks(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) in torch; on the CPU in two short passes: each block's max, then the argmax inside the best."""
    rows, n = x.shape
    if x.device.type != "cpu" or n % BLOCK:
        return x.argmax(dim=-1)
    blocks = x.unflatten(1, (n // BLOCK, BLOCK))  # [rows, n / BLOCK, BLOCK]
    block = blocks.amax(dim=-1).argmax(dim=-1)  # [rows]
    inside = blocks[torch.arange(rows, device=x.device), block].argmax(dim=-1)
    return block * BLOCK + inside


def argmax_for(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The kernel's argmax over the last dim of 2-D tensors like x, or None where it cannot serve x."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        return None
    if not 0 < x.shape[1] < 1 << 31 or x.shape[0] >= 1 << 31:  # torch refuses an empty row: so does it
        return None
    return _load()


@functools.cache  # one binding per process, over cpu_gemv's one library
def _load() -> Callable[[torch.Tensor], torch.Tensor] | None:
    if not cpu_gemv.vector_cpu():
        return None
    gemv = cpu_gemv.load()
    if gemv is None:
        return None
    lib = gemv._lib
    lib.argmax_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                ctypes.c_int]
    lib.argmax_rows.restype = None
    return functools.partial(_argmax_rows, lib.argmax_rows)


def _argmax_rows(kernel, x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] float32, last dim contiguous -> [rows] int64."""
    rows, n = x.shape
    out = torch.empty(rows, dtype=torch.long)
    if rows and n:
        kernel(x.data_ptr(), out.data_ptr(), rows, n, x.stride(0), torch.get_num_threads())
    return out
