"""The token bitmask every backend fills, and the one function that applies it to logits.

    bitmask: int32 [max_rows, ceil(vocab / 32)], on the CPU (pinned when CUDA is there)
        token t is allowed in row r  <=>  (bitmask[r, t // 32] >> (t % 32)) & 1
    word:     |31 ............ 1 0|       bits of word w cover tokens [32w, 32w + 32)

Rows are compact: row j belongs to the j-th constrained request of the step, and `rows[j]` is that
request's row in the logits. Unconstrained rows are never touched, so they pay nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

_NEG_INF = float("-inf")
_BITS = torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32)  # bit k of an int32 word


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_bitmask(max_rows: int, vocab_size: int) -> torch.Tensor:
    """All-allowed rows; pinned so that the copy to the GPU can be asynchronous. A pinned mask is
    in flight until the step's stream catches up: the caller fills it only after that."""
    pin = torch.cuda.is_available()
    return torch.full((max_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int] | torch.Tensor | None = None) -> None:
    """Set disallowed logits to -inf, in place. logits: [batch, V] on any device.

    rows None: bitmask[i] masks logits[i] for every row. Otherwise bitmask[j] masks logits[rows[j]].
    Columns past 32 * words (a padded lm_head) are disallowed too. One host-to-device copy of the
    used bitmask rows and a few tensor ops, whatever the number of rows: no per-row host sync.
    """
    num_rows = logits.shape[0] if rows is None else len(rows)
    if num_rows == 0:
        return
    device, vocab = logits.device, logits.shape[1]
    words = bitmask[:num_rows].to(device, non_blocking=True)  # [R, W]
    blocked = (words.unsqueeze(-1) & _bits(device)).eq(0).flatten(1)  # [R, 32W], token order
    if blocked.shape[1] < vocab:  # a padded lm_head: its extra columns are never allowed
        blocked = torch.nn.functional.pad(blocked, (0, vocab - blocked.shape[1]), value=True)
    blocked = blocked[:, :vocab]
    if rows is None:
        logits.masked_fill_(blocked, _NEG_INF)
        return
    index = torch.as_tensor(rows, dtype=torch.long).to(device, non_blocking=True)
    logits[index] = logits[index].masked_fill(blocked, _NEG_INF)


@functools.cache
def _bits(device: torch.device) -> torch.Tensor:
    return _BITS.to(device)


def allowed_tokens(bitmask: torch.Tensor, row: int, vocab_size: int) -> torch.Tensor:
    """The ids allowed in one row (tests and debugging; syncs)."""
    allowed = (bitmask[row].cpu().unsqueeze(-1) & _BITS).ne(0).flatten()
    return allowed[:vocab_size].nonzero().flatten()
