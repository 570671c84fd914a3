"""A decoder layer's small ops fused for float32 on AVX2 CPUs (cpu_decode.c, built into cpu_gemv's library).

A batch-1 decode step of a small model is mostly per-op cost: each of a layer's ~60 torch ops (RMSNorm's
pow/mean/rsqrt/mul, RoPE's index/cat/neg/mul/add, the K/V index_copy, the page gather and SDPA, SiLU and
the product) takes microseconds of dispatch for a few hundred floats of work. These kernels do each group
in one call: add + RMSNorm, RoPE + K/V store, paged attention read straight from the pages, SiLU * up.
Each row is computed alone, in a fixed order (tests/unit/test_cpu_decode.py checks each against torch).

`kernels_for(device, dtype)` answers None (callers keep their torch ops) off CPU, for other dtypes than
float32, without AVX2 or a compiler, with BANYAN_DISABLE_CPU_KERNELS=1, or with
BANYAN_DISABLE_FUSED_DECODE=1 (these fused ops only; the matmul kernels stay: for measuring them apart).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import os

import torch

from banyan.kernels import cpu_gemv
from banyan.kernels.cpu_features import cpu_flags

DISABLE_ENV = "BANYAN_DISABLE_FUSED_DECODE"

ATTENTION_TILE = 8
"""Query rows of one sequence paged_attention takes through the keys together (cpu_decode.c's Q_TILE)."""


WIDE_SCRATCH_FLOATS = 4 << 20
"""The most floats a thread's scores may take to hold every query head of a full tile at once (cpu_decode.c's)."""


def attention_scratch(threads: int, heads: int, kv_heads: int, max_keys: int) -> int:
    """Floats of scratch paged_attention needs: per thread, the scores of a tile's rows and query heads (every head
    where WIDE_SCRATCH_FLOATS holds them, else one KV head's: cpu_decode.c's score_rows), and the slots."""
    rows = ATTENTION_TILE * heads
    if (rows + 1) * max_keys > WIDE_SCRATCH_FLOATS:
        rows = ATTENTION_TILE * (heads // kv_heads)
    return threads * (rows + 1) * max_keys


class DecodeKernels:
    """Bindings of cpu_decode.c. Tensors are float32 (int64/int32 where said) and contiguous unless a row
    stride is taken; dims (hidden, head_dim / 2, intermediate) multiples of 8."""

    def __init__(self, lib: ctypes.CDLL, amx_bf16: bool = False):
        """amx_bf16: the library was built with AMX-BF16 and the CPU has it (flash_prefill serves)."""
        p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
        lib.rms_norm.argtypes = [p, p, p, p, p, i, i, f, i]
        lib.rope_store_kv.argtypes = [p, i, p, i, p, i, p, p, p, i, p, p, p, i, i, i, i, i, f, i]
        lib.paged_attention.argtypes = [p, i, p, p, p, i, p, p, p, p, i, i, i, i, i, i, f, p, p, i, i, f, i, i]
        lib.silu_mul.argtypes = lib.silu_mul_bf16.argtypes = [p, p, i, i, i]
        lib.gather_f16_as_bf16.argtypes = [p, p, i, i, p, i]
        lib.rms_norm.restype = lib.paged_attention.restype = lib.silu_mul.restype = lib.silu_mul_bf16.restype = None
        lib.gather_f16_as_bf16.restype = None
        lib.rope_store_kv.restype = ctypes.c_int
        lib.flash_prefill_bf16.argtypes = [p, i, p, p, p, i, i, i, i, i, i, f, p, i, i, f, i]
        lib.flash_prefill_bf16.restype = lib.flash_ready.restype = ctypes.c_int
        self._lib = lib
        self.amx_bf16 = amx_bf16 and lib.flash_ready() == 1  # Linux grants the tiles (asked once)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [..., dim] -> x / sqrt(mean(x^2) + eps) * weight."""
        y = torch.empty_like(x)
        self._lib.rms_norm(x.data_ptr(), None, None, weight.data_ptr(), y.data_ptr(), x.numel() // x.shape[-1],
                           x.shape[-1], eps, torch.get_num_threads())
        return y

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(s, rms_norm(s)) for s = x + residual, in one pass."""
        total, y = torch.empty_like(x), torch.empty_like(x)
        self._lib.rms_norm(x.data_ptr(), residual.data_ptr(), total.data_ptr(), weight.data_ptr(), y.data_ptr(),
                           x.numel() // x.shape[-1], x.shape[-1], eps, torch.get_num_threads())
        return total, y

    def rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scale: float = 1.0) -> None:
        """q [T, H, D] and k [T, KVH, D] rotated in place by positions [T] int64 (cos, sin [max_pos, D / 2]);
        k and v then stored at slot_mapping [T] int64 of the caches [pages, page_size, KVH, D] (-1: not stored)
        of KV_DTYPES, rounded as torch rounds them (float16: as .half() does; fp8: as base.to_cache_dtype does,
        times 1 / kv_scale in float32 and clamped to +-448).
        q, k, v may be row-strided views (of one qkv output): heads contiguous within a row."""
        (tokens, heads, dim), kv_heads = q.shape, k.shape[1]
        bad = self._lib.rope_store_kv(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), positions.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), cos.shape[0], k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), tokens, heads, kv_heads, dim, kv_kind(k_cache), 1.0 / kv_scale,
            torch.get_num_threads())
        if bad:
            raise ValueError(f"{bad} positions outside the rotary table's [0, {cos.shape[0]})")

    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                        rows: PagedRows, scale: float, sliding_window: int | None, kv_scale: float = 1.0,
                        bf16_tiles: bool = False) -> None:
        """out[rows.rows] = each row's causal attention over its pages (see PagedRows); q [T, H, D] (row-strided
        views allowed), out [T, H, D] contiguous, caches [pages, page_size, KVH, D] of KV_DTYPES (an fp8 cache
        holding K / kv_scale and V / kv_scale). bf16_tiles (batch invariance off): decode rows sharing a prompt's
        pages attend those keys on AMX-BF16 tiles where this build and CPU have them (q, K, V and the weights
        rounded to bf16, as flash_prefill's), head_dim a multiple of 32."""
        heads, dim = q.shape[1:]
        page_size, kv_heads = k_cache.shape[1:3]
        threads = torch.get_num_threads()
        room = attention_scratch(threads, heads, kv_heads, rows.max_keys)
        if rows.scratch is None or rows.scratch.numel() < room:
            rows.scratch = torch.empty(room, dtype=torch.float32)
        tables = rows.tables
        self._lib.paged_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.stride(0),
            rows.rows.data_ptr(), rows.seq_of_row.data_ptr(), rows.positions.data_ptr(), rows.shared_ptr(),
            rows.rows.numel(), heads, kv_heads, dim, page_size, sliding_window or 0, scale, out.data_ptr(),
            rows.scratch.data_ptr(), rows.max_keys, kv_kind(k_cache), kv_scale, threads,
            int(bf16_tiles and self.amx_bf16))

    def flash_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: torch.Tensor,
                      first: int, out: torch.Tensor, scale: float, kv_scale: float = 1.0) -> bool:
        """out = causal attention of one sequence's chunk in bf16 on AMX tiles (cpu_decode.c's flash_prefill_bf16):
        q [n, H, D] (a row-strided view allowed) at positions first .. first + n - 1, over keys 0 .. first + n - 1 in
        the pages table [pages] int32 lists; out [n, H, D] float32, row-strided allowed; caches of KV_DTYPES (an fp8
        one holding K / kv_scale and V / kv_scale), D a multiple of 32. False, with out untouched, where this build or
        CPU has no AMX-BF16."""
        if not self.amx_bf16 or k_cache.dtype not in KV_DTYPES:
            return False
        n, heads, dim = q.shape
        page_size, kv_heads = k_cache.shape[1:3]
        done = self._lib.flash_prefill_bf16(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), first, n, heads,
            kv_heads, dim, page_size, scale, out.data_ptr(), out.stride(0), kv_kind(k_cache), kv_scale,
            torch.get_num_threads())
        return done == 0

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [..., 2n] -> silu(gate) * up, [..., n]; float32, or bfloat16 (computed in float32, rounded once)."""
        n = gate_up.shape[-1] // 2
        y = gate_up.new_empty(*gate_up.shape[:-1], n)
        call = self._lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else self._lib.silu_mul
        call(gate_up.data_ptr(), y.data_ptr(), gate_up.numel() // (2 * n), n, torch.get_num_threads())
        return y

    def gather_as_bf16(self, cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """cache[index].to(bfloat16) in one pass, the same bits: cache float16 [pages, ...] contiguous, index int64 [n]
        -> [n, ...] bfloat16."""
        index = index.contiguous()
        out = torch.empty(index.numel(), *cache.shape[1:], dtype=torch.bfloat16)
        self._lib.gather_f16_as_bf16(cache.data_ptr(), index.data_ptr(), index.numel(), cache[0].numel(), out.data_ptr(),
                                     torch.get_num_threads())
        return out


KV_DTYPES = (torch.float32, torch.float16, torch.float8_e4m3fn)
"""Caches paged_attention reads and rope_store_kv writes (cpu_decode.c's KV_F32, KV_F16, KV_FP8): fewer bytes a
value, less time at a long context. fp8 is the cache of --kv-cache-dtype fp8 (layers/attention/base.py's FP8)."""


def kv_kind(cache: torch.Tensor) -> int:
    """cpu_decode.c's KV_* for a cache of one of KV_DTYPES."""
    if cache.dtype not in KV_DTYPES:
        raise TypeError(f"this fused CPU kernel takes caches of {', '.join(map(str, KV_DTYPES))}, not {cache.dtype}")
    return KV_DTYPES.index(cache.dtype)


class PagedRows:
    """Which rows of a step paged_attention computes, and where each looks (int32 tensors, built once a forward):

        rows[i]        the row of q and out
        seq_of_row[i]  its request: the row of `tables` [num_seqs, max_pages] that holds its pages
        positions[i]   its position p; it sees positions [0, p], or (p - w, p] with a sliding window w
        shared[i]      None, or the leading pages row i's table has alike with row i - 1's

    Decode rows whose tables begin with the same pages (a system prompt or few-shot examples the prefix cache serves
    every request, the prompt of n samples) are put side by side after the other rows, and `shared` says how far they
    agree, so the kernel reads those pages once for all of them (cpu_decode.c's plan_tiles); each row's numbers stay
    its own.
    """

    def __init__(self, rows: list[int], seq_of_row: list[int], positions: list[int], tables: torch.Tensor):
        self.tables = tables.to(torch.int32).contiguous()
        self.max_keys = max(positions, default=0) + 1
        order, shared = _side_by_side(seq_of_row, self.tables)
        if order is not None:
            rows, seq_of_row, positions = ([x[i] for i in order] for x in (rows, seq_of_row, positions))
        self.rows = torch.tensor(rows, dtype=torch.int32)
        self.seq_of_row = torch.tensor(seq_of_row, dtype=torch.int32)
        self.positions = torch.tensor(positions, dtype=torch.int32)
        self.shared = None if shared is None else torch.tensor(shared, dtype=torch.int32)
        self.scratch: torch.Tensor | None = None  # scores and slots, allocated by the first layer

    def shared_ptr(self) -> int | None:
        return None if self.shared is None else self.shared.data_ptr()


def _side_by_side(seq_of_row: list[int], tables: torch.Tensor) -> tuple[list[int] | None, list[int] | None]:
    """(An order of the rows, shared per row in that order) where two decode rows (each its request's only row) have
    tables beginning with the same page, else (None, None): the other rows first in their order (the dearer tiles,
    taken first by the threads), then the decode rows by first page and, among those, by how many leading pages they
    have alike with the first of them, most first (a request sharing less of a prompt goes to the edge of its run);
    shared[i]: the leading pages the i-th row's table has alike with the one before's (0 for the others)."""
    counts = collections.Counter(seq_of_row)
    decode = [i for i, seq in enumerate(seq_of_row) if counts[seq] == 1]
    if len(decode) < 2:
        return None, None
    seqs = torch.tensor([seq_of_row[i] for i in decode])
    first_page = tables[seqs, 0]
    by_first = torch.argsort(first_page, stable=True)
    _, run = torch.unique_consecutive(first_page[by_first], return_counts=True)
    if len(run) == len(decode):  # no two alike
        return None, None
    leader = by_first[torch.repeat_interleave(torch.cumsum(run, 0) - run, run)]
    depth = _leading_alike(tables[seqs[by_first]], tables[seqs[leader]])
    width = tables.shape[1] + 1
    group = torch.repeat_interleave(torch.arange(len(run)), run)
    order = by_first[torch.argsort(group * width + (width - 1 - depth), stable=True)]
    ordered = tables[seqs[order]]
    others = [i for i, seq in enumerate(seq_of_row) if counts[seq] > 1]
    alike = _leading_alike(ordered[1:], ordered[:-1]).tolist()
    return others + [decode[i] for i in order.tolist()], [0] * (len(others) + 1) + alike


def _leading_alike(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row, how many leading entries a and b have alike."""
    return (a == b).to(torch.int32).cumprod(1).sum(1)


def kernels_for(device: torch.device, dtype: torch.dtype) -> DecodeKernels | None:
    """The fused kernels where they serve a layer computing in `dtype` on `device`, else None."""
    if device.type != "cpu" or dtype != torch.float32 or os.environ.get(DISABLE_ENV) == "1":
        return None
    return _load()


@functools.cache  # one binding per process, over cpu_gemv's one library
def _load() -> DecodeKernels | None:
    if not cpu_gemv.vector_cpu():
        return None
    gemv = cpu_gemv.load()
    if gemv is None:
        return None
    return DecodeKernels(gemv._lib, gemv.amx_allowed and {"amx_bf16", "avx512_bf16"} <= cpu_flags())
