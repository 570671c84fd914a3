"""ForwardBatch: everything one forward pass needs, passed explicitly to the model and attention: the
contract between the runner (which builds it) and the models and layers (which read it), so it lives
below all of them.

A step runs several requests as one ragged batch of new tokens, no padding between requests:

    request:          r0 (prefill chunk, 3 new)   r1 (decode, 1 new)   r2 (prefill, 2 new)
    rows (tokens):    [ t0  t1  t2 ]              [ t3 ]               [ t4  t5 ]
    query_start_loc:  0                           3                    4           6
    seq_lens:         cached0 + 3                 cached1 + 1          cached2 + 2

Request i's new tokens are rows [query_start_loc[i], query_start_loc[i+1]); they sit at the last
query_len positions of its context of seq_lens[i] tokens. Its KV lives in pages block_tables[i];
token at position p is in page block_tables[i][p // page_size], offset p % page_size, i.e. slot
page * page_size + offset. slot_mapping gives that slot for every new row, so attention can write
the new K/V before it reads the context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64, absolute position of each row in its sequence
    slot_mapping: torch.Tensor  # [num_tokens] int64, KV slot each new row is written to
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    block_tables: torch.Tensor  # [num_seqs, max_pages] int32, padded with 0
    logits_indices: torch.Tensor  # [num_logits] int64, rows whose hidden states become logits
    query_lens: list[int]  # host copies: backends never sync the device to learn shapes
    context_lens: list[int]  # host copy of seq_lens
    page_size: int

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_seqs

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens, default=0)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values (a list, or a CPU tensor) as a tensor on `device`, without a wait: torch.tensor(values,
    device="cuda") copies from pageable memory and then synchronizes the stream, so the host stops until the
    forward queued before has run (a hidden read's wait, runner/host_reads.py). Through pinned memory the copy
    is queued like a kernel. On a CPU: the plain tensor."""
    if device.type != "cuda":
        return torch.as_tensor(values, dtype=dtype, device=device)
    return torch.as_tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
