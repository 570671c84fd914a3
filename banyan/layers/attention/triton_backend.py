"""Paged attention with Triton kernels (NVIDIA GPUs; on CPU only under TRITON_INTERPRET=1, for tests).

Same contract as the torch backend (see base.py): store the new K/V, then attend. A decode-only step
(every request has one new row) runs the split-K decode kernel; any other step runs the prefill
kernel over all rows, which handles one-row requests as well.

The decode path is CUDA-graph safe: no host sync, no allocation or launch shaped by a host length.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from banyan.forward_batch import ForwardBatch
from banyan.layers.attention.base import FP8, AttentionBackend

MIN_CAPABILITY = (8, 0)  # Triton 3 supports NVIDIA GPUs from Ampere on
FP8_MIN_CAPABILITY = (8, 9)  # Triton converts to float8_e4m3fn only on Ada and Hopper
NOT_INSTALLED = "backend 'triton' needs the 'triton' package: pip install 'banyan[gpu]'"


def import_problem() -> str | None:
    """Why triton's kernels cannot be imported here (None: they can): not installed, or failing to load (a missing
    libcuda, a broken install)."""
    if importlib.util.find_spec("triton") is None:
        return NOT_INSTALLED
    try:
        importlib.import_module("banyan.kernels.decode_attention")
    except (ImportError, RuntimeError) as e:
        return f"triton fails to import ({e})"
    return None


def capability_problem(capability: tuple[int, int], kv_dtype: torch.dtype | None = None) -> str | None:
    """Why triton's kernels cannot run on a GPU of this compute capability with a `kv_dtype` cache (None: they can)."""
    major, minor = capability
    if capability < MIN_CAPABILITY:
        return f"triton needs compute capability 8.0 or newer; this GPU has {major}.{minor}"
    if kv_dtype == FP8 and capability < FP8_MIN_CAPABILITY:
        return f"triton's fp8 KV cache needs compute capability 8.9 or newer; this GPU has {major}.{minor}"
    return None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    @classmethod
    def unavailable_reason(cls, device: torch.device | None = None, kv_dtype: torch.dtype | None = None) -> str | None:
        if device is not None and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            return "'triton' needs a CUDA device (on CPU: 'torch')"
        if importlib.util.find_spec("triton") is None:
            return NOT_INSTALLED
        if device is None or device.type != "cuda":
            return None
        return capability_problem(torch.cuda.get_device_capability(device), kv_dtype)

    def __init__(self, kv_scale: float = 1.0):
        super().__init__(kv_scale)
        from banyan.kernels import decode_attention, kv_store, prefill_attention  # triton: imported once built

        self._store_kv, self._decode = kv_store.store_kv, decode_attention.decode_attention
        self._prefill = prefill_attention.prefill_attention

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float, sliding_window=None,
                kv_stored=False):
        if not kv_stored:
            self._store_kv(k, v, k_cache, v_cache, batch.slot_mapping, self.kv_scale)
        if batch.is_decode_only:
            # The split grid is sized from the block table's width, not the host lengths: under a CUDA graph
            # the table is the static one (max_model_len wide) and the lengths change at every replay.
            max_keys = batch.block_tables.shape[1] * batch.page_size
            return self._decode(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                max_keys, scale, sliding_window, kv_scale=self.kv_scale)
        return self._prefill(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                             batch.max_query_len, scale, sliding_window, kv_scale=self.kv_scale)
