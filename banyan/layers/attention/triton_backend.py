"""Paged attention with Triton kernels (NVIDIA GPUs; on CPU only under TRITON_INTERPRET=1, for tests).

Same contract as the torch backend (see base.py): store the new K/V, then attend. A decode-only step
(every request has one new row) runs the split-K decode kernel; any other step runs the prefill
kernel over all rows, which handles one-row requests as well.

The decode path is CUDA-graph safe: no host sync, no allocation or launch shaped by a host length.
"""

from __future__ import annotations

from banyan.kernels.decode_attention import decode_attention
from banyan.kernels.kv_store import store_kv
from banyan.kernels.prefill_attention import prefill_attention
from banyan.layers.attention.base import AttentionBackend
from banyan.forward_batch import ForwardBatch


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float, sliding_window=None):
        store_kv(k, v, k_cache, v_cache, batch.slot_mapping, self.kv_scale)
        if batch.is_decode_only:
            # The split grid is sized from the block table's width, not the host lengths: under a CUDA graph
            # the table is the static one (max_model_len wide) and the lengths change at every replay.
            max_keys = batch.block_tables.shape[1] * batch.page_size
            return decode_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                    max_keys, scale, sliding_window, kv_scale=self.kv_scale)
        return prefill_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                 batch.max_query_len, scale, sliding_window, kv_scale=self.kv_scale)
