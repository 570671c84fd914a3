"""AttentionBackend: paged causal attention over a ragged batch (see runner/forward_batch.py)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from banyan.runner.forward_batch import ForwardBatch


class AttentionBackend(ABC):
    """One stateless instance serves every layer; the layer passes its own cache pages.

    Contract of `forward`:
      1. write the new k/v rows into k_cache/v_cache at batch.slot_mapping;
      2. each new row of request i attends causally to its context: the first
         `context_lens[i] - query_lens[i] + j + 1` tokens for its j-th new row, read from the pages
         in batch.block_tables[i] (cached prefix and new tokens alike);
      3. with `sliding_window` w, a row at position p sees only positions > p - w (Mistral).
    Any mix of decode rows (query_len 1) and prefill chunks with a cached prefix is allowed.
    """

    name: str

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
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store each new row's K/V at its slot (page * page_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
