"""AttentionBackend: paged causal attention over a ragged batch (see banyan/forward_batch.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from banyan.forward_batch import ForwardBatch

FP8 = torch.float8_e4m3fn  # the fp8 KV cache's dtype (--kv-cache-dtype fp8)
FP8_MAX = torch.finfo(FP8).max  # 448: e4m3fn has no infinity, so larger values are clamped rather than lost


def kv_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The cache's dtype for CacheConfig.kv_cache_dtype. auto: the model's, except that a float32 model on a CPU
    keeps float16 pages (llama.cpp's default): long-context decode there is bound by memory bandwidth, and the
    fused kernels read and write float16 at float32's accuracy (docs/quantization.md, "Long contexts")."""
    if kv_cache_dtype == "auto":
        return torch.float16 if device.type == "cpu" and model_dtype == torch.float32 else model_dtype
    return FP8 if kv_cache_dtype == "fp8" else getattr(torch, kv_cache_dtype)


class AttentionBackend(ABC):
    """One stateless instance serves every layer; the layer passes its own cache pages.

    Contract of `forward`:
      1. write the new k/v rows into k_cache/v_cache at batch.slot_mapping (unless kv_stored: the caller
         wrote them already, fused with RoPE on CPUs);
      2. each new row of request i attends causally to its context: the first
         `context_lens[i] - query_lens[i] + j + 1` tokens for its j-th new row, read from the pages
         in batch.block_tables[i] (cached prefix and new tokens alike);
      3. with `sliding_window` w, a row at position p sees only positions > p - w (Mistral).
      4. an fp8 cache (dtype FP8) holds K/V divided by kv_scale: quantize on write, multiply back on read.
    Any mix of decode rows (query_len 1) and prefill chunks with a cached prefix is allowed.
    A backend with supports_cuda_graphs reads no host length (context_lens, query_lens) in a decode-only
    step, so that step can be captured once per batch size and replayed (runner/cuda_graphs.py).
    """

    name: str
    supports_cuda_graphs = False  # a decode step launches the same work whatever the lengths: no host-shaped code

    def __init__(self, kv_scale: float = 1.0):
        self.kv_scale = kv_scale  # fp8 caches hold K/V divided by this (one scale for the whole cache)

    @classmethod
    def unavailable_reason(cls, device: torch.device | None = None, kv_dtype: torch.dtype | None = None) -> str | None:
        """Why this backend cannot run on `device` with a `kv_dtype` cache (None: it can; a None argument: not
        asked), without importing its kernels."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
        batch: ForwardBatch,
        scale: float,
        sliding_window: int | None = None,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scale: float = 1.0,
) -> None:
    """Store each new row's K/V at its slot (page * page_size + offset), quantized for an fp8 cache."""
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = to_cache_dtype(new, cache.dtype, kv_scale)
        if cache.dtype == FP8:  # fp8 has no index_copy_ on CPU: copy the bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(-1, *cache.shape[-2:]).index_copy_(0, slot_mapping, rows)


def read_pages(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype, kv_scale: float = 1.0) -> torch.Tensor:
    """cache[pages] in `dtype`; fp8 pages are gathered as bytes (fp8 indexing is missing on some devices) and scaled."""
    if cache.dtype != FP8:
        return _gather(cache, pages).to(dtype)
    rows = _gather(cache.view(torch.uint8), pages).view(FP8)
    return rows.to(dtype) if kv_scale == 1.0 else (rows.float() * kv_scale).to(dtype)


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache[pages] through index_select (3x faster than advanced indexing on CPU for a few pages)."""
    return cache.index_select(0, pages.reshape(-1)).view(*pages.shape, *cache.shape[1:])


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, kv_scale: float = 1.0) -> torch.Tensor:
    """K/V rows as a cache of `dtype` stores them: fp8 ones divided by the scale and clamped to its range
    (rounded to nearest even)."""
    if dtype != FP8:
        return x.to(dtype)
    return (x.float() * (1.0 / kv_scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # as the triton store computes it
