"""Reference paged attention in plain torch: works on any device, the oracle for the kernels.

Decode rows (query_len 1) of all requests run as one padded batch; each prefill chunk runs on its
own (a step holds few). Both gather the request's K/V from its pages and call SDPA with a mask:

    request i, context of c tokens, q new rows (the last q positions of the context):
    key position:     0  1  2  ...  c-q  ...  c-1   (c .. max_ctx-1: padding, masked)
    new row j sees:   [0, c-q+j]  (and only (c-q+j-w, c-q+j] with a sliding window w)
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from banyan.layers.attention.base import AttentionBackend, write_kv_cache
from banyan.runner.forward_batch import ForwardBatch


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, batch: ForwardBatch, scale: float, sliding_window=None):
        write_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping)
        starts = [0, *itertools.accumulate(batch.query_lens)]
        decode = [i for i, n in enumerate(batch.query_lens) if n == 1]
        if len(decode) == batch.num_seqs:  # decode-only step: every row is its request's only row
            out = paged_attention(q[:, None], k_cache, v_cache, batch.block_tables,
                                  batch.context_lens, batch.query_lens, scale, sliding_window)
            return out[:, 0]
        out = torch.empty_like(q)
        if decode:
            rows = torch.tensor([starts[i] for i in decode], device=q.device)
            seqs = torch.tensor(decode, device=q.device)
            out[rows] = paged_attention(
                q[rows][:, None], k_cache, v_cache, batch.block_tables[seqs],
                [batch.context_lens[i] for i in decode], [1] * len(decode), scale, sliding_window,
            )[:, 0]
        for i, n in enumerate(batch.query_lens):
            if n > 1:
                rows = slice(starts[i], starts[i + 1])
                out[rows] = paged_attention(
                    q[None, rows], k_cache, v_cache, batch.block_tables[i : i + 1],
                    [batch.context_lens[i]], [n], scale, sliding_window,
                )[0]
        return out


def paged_attention(
    q: torch.Tensor,  # [num_seqs, max_query_len, num_heads, head_dim], padded after each query_len
    k_cache: torch.Tensor,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_pages]
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [num_seqs, max_query_len, num_heads, head_dim]
    """Causal attention of each sequence's new rows over its whole paged context."""
    device, page_size = q.device, k_cache.shape[1]
    max_ctx = max(context_lens)
    num_pages = -(-max_ctx // page_size)
    pages = block_tables[:, :num_pages].long()
    k = k_cache[pages].flatten(1, 2)[:, :max_ctx]  # [num_seqs, max_ctx, num_kv_heads, head_dim]
    v = v_cache[pages].flatten(1, 2)[:, :max_ctx]

    ctx = torch.tensor(context_lens, device=device)[:, None, None]  # [num_seqs, 1, 1]
    first = ctx - torch.tensor(query_lens, device=device)[:, None, None]  # position of row 0
    q_pos = first + torch.arange(q.shape[1], device=device)[None, :, None]  # [num_seqs, max_q, 1]
    kv_pos = torch.arange(max_ctx, device=device)[None, None, :]  # [1, 1, max_ctx]
    mask = (kv_pos <= q_pos) & (kv_pos < ctx)  # [num_seqs, max_q, max_ctx]
    if sliding_window is not None:
        mask &= kv_pos > q_pos - sliding_window

    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2).to(q.dtype), v.transpose(1, 2).to(q.dtype),
        attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != k.shape[2],
    )  # [num_seqs, num_heads, max_q, head_dim]
    return out.transpose(1, 2)
